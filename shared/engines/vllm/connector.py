"""`DroidMeshConnector`: vLLM's KV connector that reuses another model's cache from the mesh.

Loaded by vLLM from outside (`--kv-transfer-config '{"kv_connector": "DroidMeshConnector",
"kv_connector_module_path": "droidmesh.shared.engines.vllm.connector", "kv_role": "kv_consumer",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'`, the settings of
`engines/settings.py`). vLLM builds one instance per side, each in its own process:

  scheduler (`get_num_new_matched_tokens`): the broker's holder and the pair's plan
      (`MeshBridge.plan_for`); the tokens the plan reuses (all but the prompt's last) are reported
      as matched, so vLLM allocates their blocks and computes only the rest of the prompt;
  worker (`start_load_kv`, before the step's forward): the pull and the plan's recompute
      (`MeshBridge.context_kv`), then every layer's K/V written into the request's blocks
      (`pages.write_layer`).

A miss, a refused plan, a fault, a deadline or a screen rejection: nothing is written, and the
request's blocks are reported as failed loads (`get_block_ids_with_load_errors`), which vLLM's
"recompute" policy turns into its own prefill of those tokens. So a request gets the plan's cache
or vLLM's own, never a partial one. Each decision is one JSON log line (`request`, `reuse_fallback`)
with the reason's code, as the receiver's.

With `hold` (role `kv_both`), vLLM is a sender too: a prompt it prefilled itself is, once its
last prefill step ran (`build_connector_meta` follows chunked prefills), copied out of its blocks
in `wait_for_save` (`pages.read_slots`) and held for the mesh (`engines/holding.py`: E computed
beside the engine, announced, served over the bulk channel). Blocks are never kept past the step.

Loads are synchronous (the step waits for them, bounded by `reuse_timeout_s`); a request that
vLLM's own prefix cache already covers is left to it. A request may ask for a mode in
`SamplingParams.extra_args["droidmesh_mode"]` ("auto", "full_prefill", "full_reuse").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from droidmesh.shared.engines.bridge import Match, MeshBridge
from droidmesh.shared.engines.settings import MODES, EngineSettings
from droidmesh.shared.engines.vllm import pages
from droidmesh.shared.errors import ConfigError, DroidMeshError
from droidmesh.shared.service.log import configure_logging

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger("vllm_connector")


@dataclasses.dataclass
class Load:
    """One request's load, scheduler -> worker: its match, prompt and the blocks vLLM gave it."""

    request_id: str
    match: Match
    prompt: list[int]
    block_ids: list[int]


@dataclasses.dataclass
class Save:
    """A prompt vLLM prefilled itself, to hold once its last prefill step ran: scheduler -> worker."""

    request_id: str
    model_id: str
    prompt: list[int]
    block_ids: list[int]
    computed: int = 0  # prompt tokens computed before the step this is sent in (scheduler side)


@dataclasses.dataclass
class DroidMeshMetadata(KVConnectorMetadata):
    loads: list[Load] = dataclasses.field(default_factory=list)
    saves: list[Save] = dataclasses.field(default_factory=list)


def _mode(request: Any) -> str:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    mode = extra.get("droidmesh_mode", "auto")
    return mode if mode in MODES else "invalid"


class DroidMeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = EngineSettings.from_mapping(tc.kv_connector_extra_config or {})
        configure_logging("vllm_connector", self.settings.log_level, json=True)
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ConfigError('the DroidMesh connector needs "kv_load_failure_policy": "recompute": a failed '
                              "pull must fall back to vLLM's own prefill, never fail the request")
        if self.settings.hold and not tc.is_kv_producer:
            raise ConfigError('"hold" makes vLLM a sender too: it needs "kv_role": "kv_both"')
        cache_dtype, model_dtype = vllm_config.cache_config.cache_dtype, vllm_config.model_config.dtype
        if not pages.cache_dtype_fits(cache_dtype, model_dtype):
            raise ConfigError(f"kv cache dtype {cache_dtype} for a {model_dtype} model: the DroidMesh connector "
                              "needs the model's own dtype (auto)")
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:  # a hybrid model: a load would need blocks of every group
            raise ConfigError(f"{len(groups)} KV cache groups (a hybrid or sliding-window model): the DroidMesh "
                              "connector serves full-attention models only")
        self.block_size = vllm_config.cache_config.block_size
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self.bridge = MeshBridge(self.settings, side)
        # scheduler side: per request id, what plan_for answered (vLLM may ask twice) and the loads
        # allocated since the last step's metadata
        self._matched: dict[str, Match | None] = {}
        self._pending: dict[str, Load] = {}
        self._saving: dict[str, Save] = {}  # prompts being prefilled by vLLM itself (`hold`)
        self._from_mesh: set[str] = set()  # requests whose context was loaded from the mesh: never held
        # worker side
        self._caches: dict[int, tuple[str, torch.Tensor]] = {}
        self._cache_device = torch.device("cpu")  # where vLLM's caches live (one device per worker)
        self._layers: dict[str, Any] = {}  # vLLM's attention layers by name (from the first forward)
        self._layouts: dict[str, str] = {}  # layer name -> its cache layout, as its attention writes it
        self._failed_blocks: set[int] = set()
        # `async_load`: loads run one at a time on this thread, off the step; request id -> (its load, done)
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._loading: dict[str, tuple[Load, concurrent.futures.Future[bool]]] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save is a cache for others: one dropped is a later miss, never a wrong answer

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the plan reuses, whether they load asynchronously: `async_load`)."""
        rid = request.request_id
        if rid not in self._matched:
            self._matched[rid] = self._decide(request, num_computed_tokens)
        match = self._matched[rid]
        tokens = match.tokens if match is not None and num_computed_tokens == 0 else 0
        return tokens, bool(tokens) and self.settings.async_load

    def _decide(self, request: Request, num_computed_tokens: int) -> Match | None:
        prompt = list(request.prompt_token_ids or [])
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        model = self.settings.model_for(lora)
        mode = _mode(request)
        if model is None or mode == "invalid" or num_computed_tokens > 0:
            why = ("not_served" if model is None else "bad_mode" if mode == "invalid" else "engine_prefix_cache")
            log.info("request", request_id=request.request_id, path="full_prefill", reason=why, tokens=len(prompt))
            return None
        began = time.perf_counter()
        try:
            match, reason = self.bridge.plan_for(prompt, model, mode)
        except Exception as e:  # a bug or a broken reply costs this request its reuse, never the scheduler
            match, reason = None, ("lookup_failed", f"{type(e).__name__}: {e}")
        ms = round((time.perf_counter() - began) * 1e3, 1)
        if match is None:
            code, why = reason or ("no_cache", "")
            log.info("request", request_id=request.request_id, model=model, path="full_prefill", reason=code,
                     detail=why[:200], tokens=len(prompt), lookup_ms=ms)
            return None
        log.info("request", request_id=request.request_id, model=model, path=match.path, plan=match.plan.label(),
                 reused_tokens=match.tokens, tokens=len(prompt), lookup_ms=ms)
        return match

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        match = self._matched.get(request.request_id)
        if num_external_tokens <= 0 or match is None:
            return
        (block_ids,) = blocks.get_block_ids()  # one KV cache group: full attention only
        self._pending[request.request_id] = Load(request.request_id, match, list(request.prompt_token_ids or []),
                                                 list(block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DroidMeshMetadata()
        if self.settings.async_load:  # waiting for their loads, not scheduled: each goes out once allocated
            meta.loads = list(self._pending.values())
            self._pending.clear()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(dataclasses.replace(load, block_ids=list(new.block_ids[0])))
        for sent in meta.loads:
            self._from_mesh.add(sent.request_id)
            # once only: a request vLLM preempts and resumes later is recomputed by vLLM, since
            # its blocks are then new and nothing would load them
            self._matched[sent.request_id] = None
        if self.settings.hold:
            meta.saves = self._saves(scheduler_output)
        return meta

    def _saves(self, out: SchedulerOutput) -> list[Save]:
        """The prompts whose prefill ends in this step, computed by vLLM itself (a load's blocks
        hold the mesh's K/V, which is not this model's own). A prompt prefilled in chunks is
        followed from step to step: its blocks grow, or are replaced when vLLM resumes it."""
        for new in out.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            model = self.settings.model_for(new.lora_request.lora_name if new.lora_request is not None else None)
            if model is not None and new.req_id not in self._from_mesh and len(prompt) >= 2:
                self._saving[new.req_id] = Save(new.req_id, model, prompt, list(new.block_ids[0]), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            save = self._saving.get(rid)
            if save is None:
                continue
            grown = cached.new_block_ids[i]
            if grown is not None:
                save.block_ids = list(grown[0]) if rid in cached.resumed_req_ids else save.block_ids + list(grown[0])
            save.computed = cached.num_computed_tokens[i]
        done = [save for rid, save in self._saving.items()
                if out.num_scheduled_tokens.get(rid, 0) and save.computed + out.num_scheduled_tokens[rid] >= len(save.prompt)]
        for save in done:
            del self._saving[save.request_id]
        return done

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._saving.pop(request.request_id, None)
        self._from_mesh.discard(request.request_id)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = {pages.layer_index(name): (name, t) for name, t in kv_caches.items()}
        self._cache_device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        if self.settings.preload:  # vLLM's caches are allocated by now: our weights take what is left
            loading = self.bridge.preload()
            if self._cache_device.type == "cuda":  # vLLM captures its CUDA graphs next, and an allocation
                loading.join()  # from another thread during a capture fails it: load before, here

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DroidMeshMetadata)
        self._layers = self._layers or dict(getattr(forward_context, "no_compile_layers", {}) or {})
        for load in meta.loads:
            if self.settings.async_load:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="droidmesh-load")
                self._loading[load.request_id] = (load, self._loader.submit(self._load, load, self._queued()))
            elif not self._load(load):
                self._failed_blocks.update(load.block_ids)

    def _queued(self) -> torch.cuda.Event | None:
        """On a GPU, an event after the work vLLM has queued so far (a step still writing a block
        just given to another request): an asynchronous load writes only after it."""
        if self._cache_device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._cache_device))
        return event

    def _load(self, load: Load, after: torch.cuda.Event | None = None) -> bool:
        """Pull and recompute one request's K/V and write it into its blocks (bounded by
        `reuse_timeout_s`), after `after` on a GPU; False, logged, for anything that keeps it from
        being exactly the plan's."""
        began = time.perf_counter()
        try:
            kv, pulled = self.bridge.context_kv(load.match, load.prompt)
            if len(kv) != len(self._caches):
                raise DroidMeshError(f"{len(kv)} layers of K/V for an engine of {len(self._caches)}")
            slots = pages.slots_of(load.block_ids, self.block_size, load.match.tokens)
            if after is not None:  # this thread's stream does not wait for vLLM's by itself
                torch.cuda.current_stream(self._cache_device).wait_event(after)
            for index, (name, cache) in sorted(self._caches.items()):
                k, v = kv[index]
                pages.write_layer(cache, k, v, slots, self._layout(name, cache))
            if self.settings.async_load and self._cache_device.type == "cuda":
                torch.cuda.synchronize(self._cache_device)  # written on this thread's stream: landed before vLLM is told
        except Exception as e:  # whatever a peer sent or did: this request falls back, the engine goes on
            code = getattr(e, "code", type(e).__name__)
            log.warning("reuse_fallback", request_id=load.request_id, reason=f"{code}: {str(e)[:200]}")
            return False
        log.info("loaded", request_id=load.request_id, tokens=load.match.tokens, layers=len(kv),
                 bytes_pulled=pulled, ms=round((time.perf_counter() - began) * 1e3, 1))
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads done since the last step, each reported once; a failed one's
        blocks go to `get_block_ids_with_load_errors`, which vLLM asks right after, in the same step."""
        done = {rid for rid, (_, future) in self._loading.items() if future.done()}
        for rid in done:
            load, future = self._loading.pop(rid)
            if not future.result():  # `_load` returns False rather than raising
                self._failed_blocks.update(load.block_ids)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load is whole before its request's forward (start_load_kv; with async_load, get_finished)

    def _read(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V at `slots`, copied out of vLLM's cache (each [1, kv_heads, T, head_dim]).
        On a GPU the copies are done before this returns: the holder reads them on a thread of
        its own, whose stream does not wait for vLLM's."""
        read = [pages.read_slots(cache, slots, self._layout(name, cache)) for _, (name, cache) in sorted(self._caches.items())]
        if self._cache_device.type == "cuda":
            torch.cuda.current_stream(self._cache_device).synchronize()
        return read

    def _layout(self, name: str, cache: torch.Tensor) -> str:
        """The layer's cache layout (kept once vLLM's layer told it; `UnsupportedLayout`, raised
        in the load or hold it costs, for a backend the connector does not write)."""
        layout = self._layouts.get(name)
        if layout is None:
            layer = self._layers.get(name)
            layout = pages.layout_of(layer, cache, "auto")
            if layer is not None:
                self._layouts[name] = layout
        return layout

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # prompts are copied out whole, after the step's forward (`wait_for_save`)

    def wait_for_save(self) -> None:
        """Copy out each prompt whose prefill this step finished and hand it to the holder; a
        failure costs that prompt its holding, never the step."""
        if not self.settings.hold or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, DroidMeshMetadata)
        for save in meta.saves:
            began = time.perf_counter()
            try:
                slots = pages.slots_of(save.block_ids, self.block_size, len(save.prompt))
                if not self.bridge.hold(save.model_id, save.prompt, functools.partial(self._read, slots)):
                    continue  # the holder is busy (it logged why)
            except Exception as e:  # noqa: BLE001 - not held; the request itself is unaffected
                log.warning("hold_skipped", request_id=save.request_id, reason=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            log.info("saved", request_id=save.request_id, model=save.model_id, tokens=len(save.prompt),
                     ms=round((time.perf_counter() - began) * 1e3, 1))

    def shutdown(self) -> None:
        if self._loader is not None:  # a load in flight ends within reuse_timeout_s
            self._loader.shutdown(wait=True, cancel_futures=True)
        self.bridge.close()
