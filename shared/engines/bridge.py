"""The mesh from inside another engine's process: lookups, plans and pulls behind blocking calls.

An engine's connector hooks are plain synchronous methods on the engine's own threads (vLLM: the
scheduler's step and the worker's forward). The mesh is asyncio (NATS, the bulk channels), so a
`MeshBridge` runs its own event loop on a daemon thread and every hook's call into it waits on a
future with a deadline: a slow broker or sender costs the hook its timeout, never a hang.

Two halves, one per side of the engine (each a separate process in vLLM):
  - `plan_for` (scheduler side): the broker's best holder of the prompt under the engine's scope,
    and the pair's published plan (`kv/policy.decide`, as a receiver decides), as a `Match` the
    engine carries to its worker; configs follow the config board.
  - `hold` (worker side, with `hold`): a prompt the engine prefilled, held for the mesh by an
    `EngineHolder` on this loop (vLLM as a sender);
  - `context_kv` (worker side): one pull of the match's items (E first) while the receiver's own
    layers recompute the plan's groups over it (`kv/context.py`), every tensor screened
    (`kv/screen.py`) and checked; the reused prefix's K/V of every layer, or a `ReuseError`.
Everything a holder or the broker says is checked as a receiver checks it: the holder's scope,
fingerprint, dtype and every tensor; a failure is a `ReuseError` the engine turns into its own
prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
import torch

from droidmesh.shared import __version__
from droidmesh.shared.engines.holding import EngineHolder
from droidmesh.shared.engines.models import EngineModels
from droidmesh.shared.engines.settings import EngineSettings
from droidmesh.shared.errors import DroidMeshError, ReuseError, TransferError
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.context import KV, context_kv_steps
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.screen import Screen, ScreenedSource
from droidmesh.shared.kv.sources import ArrivingSource, LayerSource, run_steps
from droidmesh.shared.mesh.bus import NatsBus
from droidmesh.shared.model.adapter import ModelAdapter, load_tokenizer, lora_base
from droidmesh.shared.model.fingerprint import fingerprint_of
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.transport import codecs
from droidmesh.shared.transport.bulk import BulkClient, make_client
from droidmesh.shared.transport.pull import pull_into, pull_items, request_grant, source_for
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.hashing import PUBLIC, common_prefix

log = structlog.get_logger("engine")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Match:
    """What the scheduler side found and chose for one request: carried to the worker (pickled)."""

    model_id: str  # the receiver model the request is served as
    holder: bytes  # the holder's `CacheAvailable`, as the broker sent it (msgpack)
    plan: ReusePlan
    codec: str
    codec_params: dict[str, Any]
    tokens: int  # m: the prompt tokens the engine takes from the mesh (never its last one)
    path: schemas.Path  # "partial" or "full_reuse"


@dataclasses.dataclass(frozen=True)
class Facts:
    """A served model as the policy and the broker know it, read from its checkpoint's files."""

    receiver: policy.Receiver
    fingerprint_id: str


def facts_of(model_id: str, path: str) -> Facts:
    """From the checkpoint's config, tokenizer and weights' hash (no weights loaded)."""
    from transformers import AutoConfig

    p = Path(path)
    cfg = AutoConfig.from_pretrained(lora_base(p) or p, local_files_only=True)
    tok = load_tokenizer(p)
    receiver = policy.Receiver(model_id=model_id, model_sha256=weights_sha256(p), num_layers=cfg.num_hidden_layers)
    return Facts(receiver, fingerprint_of(cfg, tok).id)


class MeshBridge:
    """One per engine process and side; `close()` when the engine shuts down."""

    def __init__(self, cfg: EngineSettings, side: str):
        self.cfg, self.side = cfg, side
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"droidmesh-{side}", daemon=True)
        self._thread.start()
        opts = cfg.nats_options()
        self._bus: NatsBus = self._wait(NatsBus.connect(None, f"droidmesh-vllm-{side}", __version__, **opts),
                                        cfg.connect_timeout_s)
        self._facts: dict[str, Facts] = {}
        self._configs: dict[str, dict[str, schemas.RecomputeConfig]] = {}  # receiver model -> sender model ->
        self.models = EngineModels(cfg.models, cfg.device, cfg.dtype)  # the receiver's own weights
        self._screens: dict[str, Screen | None] = {}
        self._bulk: BulkClient | None = None
        self._holder: EngineHolder | None = None
        if side == "worker" and cfg.hold:  # vLLM as a sender: what it prefills, held here
            self._holder = EngineHolder(cfg, self._bus, self._loop, self.models)
            self._wait(self._holder.start(), cfg.connect_timeout_s)
        if side == "scheduler":
            self._facts = {m: facts_of(m, p) for m, p in cfg.models.items()}
            self._watch = asyncio.run_coroutine_threadsafe(self._follow_configs(), self._loop)
        log.info("bridge_started", side=side, models=sorted(cfg.models), scope=cfg.scope)

    def _wait(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise

    async def _follow_configs(self) -> None:
        async def on_config(cfg: schemas.RecomputeConfig) -> None:
            facts = self._facts.get(cfg.receiver_model)
            if facts is not None and policy.accepts(cfg, facts.receiver):
                # our latency fit is the DroidMesh engine's, not this engine's: no prediction from it
                self._configs.setdefault(cfg.receiver_model, {})[cfg.sender_model] = msgspec.structs.replace(
                    cfg, latency=None)
                log.info("config_loaded", pair=f"{cfg.sender_model}->{cfg.receiver_model}", version=cfg.profile_version,
                         plan=policy.plan_of(cfg.chosen.plan).label())

        async def on_withdrawn(cfg: schemas.RecomputeConfig, left: list[schemas.RecomputeConfig]) -> None:
            # the plan in use gives way to the newest config left for the pair, else to none
            # (this engine's own prefill for what that sender holds), from the next request on
            configs = self._configs.get(cfg.receiver_model, {})
            current = configs.get(cfg.sender_model)
            if current is None or current.profile_version != cfg.profile_version:
                return
            configs.pop(cfg.sender_model)
            for c in sorted(left, key=lambda c: c.profile_version):
                if (c.sender_model, c.receiver_model) == (cfg.sender_model, cfg.receiver_model):
                    await on_config(c)
            log.info("config_withdrawn", pair=f"{cfg.sender_model}->{cfg.receiver_model}", version=cfg.profile_version,
                     now_version=getattr(configs.get(cfg.sender_model), "profile_version", None))

        await self._bus.config_board().watch(on_config, on_withdrawn)

    # -- scheduler side -------------------------------------------------------------------
    def plan_for(self, prompt: list[int], model_id: str, mode: str) -> tuple[Match | None, policy.Reason | None]:
        """The holder and plan for `prompt` served as `model_id`, or (None, why not). Waits for
        the broker at most `lookup_timeout_s`."""
        facts = self._facts[model_id]
        if mode == "full_prefill" or len(prompt) < 2:
            return None, ("forced" if mode == "full_prefill" else "short_prompt", "nothing to reuse")
        configs = self._configs.get(model_id, {})
        usable = sorted({*configs, model_id})
        req = schemas.LookupRequest(token_ids=prompt, fingerprint_id=facts.fingerprint_id, models=usable,
                                    scope=self.cfg.scope)
        try:
            data = self._wait(self._bus.request(subjects.BROKER_LOOKUP, schemas.encode(req),
                                                timeout=self.cfg.lookup_timeout_s), self.cfg.lookup_timeout_s + 1)
            reply = schemas.decode(data, schemas.LookupReply)
        except (TimeoutError, DroidMeshError) as e:
            return None, ("broker_unavailable", f"broker: {type(e).__name__}: {e}")
        holder = reply.holder
        if holder is None or holder.scope not in (self.cfg.scope, PUBLIC):
            return None, ("no_cache", "no cached prefix")
        m = min(common_prefix(holder.token_ids, prompt), len(prompt) - 1)
        online = policy.Online(tokens=len(prompt), reused_tokens=m)
        config = policy.config_for(holder, facts.receiver, configs)
        d = policy.decide(mode, holder, None, config, facts.receiver, online)  # type: ignore[arg-type]
        if d.plan.mode == "full_prefill" or m < 1:
            return None, d.reason or ("short_prefix", "no reusable prefix")
        return Match(model_id, schemas.encode(holder), d.plan, d.codec, dict(d.codec_params), m, d.path), None

    # -- worker side ----------------------------------------------------------------------
    def context_kv(self, match: Match, prompt: list[int]) -> tuple[list[KV], int]:
        """The reused prefix's K/V of every layer (each [1, kv_heads, m, head_dim] in the settings'
        dtype on their device: the receiver's own weights recompute the plan's groups) and the bytes pulled.
        Raises `ReuseError` for anything that keeps it from being exactly the plan's."""
        began = time.monotonic()
        holder = schemas.decode(match.holder, schemas.CacheAvailable)
        model = self.models.get(match.model_id)
        if match.codec == codecs.LOWRANK.name and not codecs.LOWRANK.has_maps(
                str(match.codec_params.get(codecs.MAPS_PARAM, ""))):
            raise ReuseError("maps_unavailable: the plan's SCD maps are not loaded in this engine")
        source = source_for(holder, prompt)
        items = pull_items(match.plan, model.num_layers)
        pulling = asyncio.run_coroutine_threadsafe(self._pull(holder, items, model, source, match), self._loop)
        try:
            with self.models.using(match.model_id), torch.inference_mode():  # the pull goes on meanwhile
                screen = self._screen(match.model_id, model)
                read: LayerSource = source if screen is None else ScreenedSource(
                    source, screen, model, [(i.kind, i.layer) for i in items], match.plan.patch)
                kv = run_steps(context_kv_steps(model, prompt, match.plan, read, timeout_s=self.cfg.reuse_timeout_s))
            pulled = pulling.result(max(0.01, self.cfg.reuse_timeout_s - (time.monotonic() - began)))
        except BaseException:
            pulling.cancel()
            raise
        if kv[0][0].shape[2] != match.tokens:
            raise TransferError(f"the holder's prefix gave {kv[0][0].shape[2]} tokens, the engine expects {match.tokens}")
        return kv, pulled

    async def _pull(self, holder: schemas.CacheAvailable, items: list[schemas.PullItem], model: ModelAdapter,
                    source: ArrivingSource, match: Match) -> int:
        until = time.monotonic() + self.cfg.reuse_timeout_s
        try:
            if self._bulk is None:
                self._bulk = make_client(self.cfg.transport)
            token = await request_grant(self._bus.request, holder, self.cfg.reuse_timeout_s)
            return await pull_into(self._bulk, holder, items, model, source, max(0.01, until - time.monotonic()),
                                   token=token, codec=match.codec, codec_params=match.codec_params)
        except BaseException as e:
            source.fail(e)
            raise

    def hold(self, model_id: str, prompt: list[int], read: Callable[[], list[KV]]) -> bool:
        """Hold a prompt the engine prefilled itself (`read()` copies its every layer's K/V out of
        the engine's cache, on the caller's thread); returns at once, False (nothing read) when
        the holder is too busy to take it (`engines/holding.py`)."""
        if self._holder is None:
            raise DroidMeshError("this engine does not hold (the connector's `hold` is off)")
        return self._holder.hold(model_id, prompt, read)

    def preload(self) -> threading.Thread:
        """Load the receiver's own weights and build their screens on a thread of their own (the
        engine's start goes on); a failure is logged, and the first request that needs the model
        meets it again as its reuse's fallback."""
        def load() -> None:
            began = time.monotonic()
            try:
                self.models.preload()
                for model_id in self.cfg.models:
                    with self.models.using(model_id) as model, torch.inference_mode():
                        self._screen(model_id, model)
            except Exception as e:  # a bad checkpoint: each request that reuses falls back, as without preloading
                log.warning("preload_failed", error=f"{type(e).__name__}: {e}"[:300])
                return
            log.info("models_preloaded", models=sorted(self.cfg.models), seconds=round(time.monotonic() - began, 2))

        thread = threading.Thread(target=load, name="droidmesh-preload", daemon=True)
        thread.start()
        return thread

    def _screen(self, model_id: str, model: ModelAdapter) -> Screen | None:
        if not self.cfg.kv_screen:
            return None
        if model_id not in self._screens:
            with torch.inference_mode():
                self._screens[model_id] = Screen.of_model(model)
        return self._screens[model_id]

    def close(self) -> None:
        async def shut() -> None:
            if self._holder is not None:
                await self._holder.stop()
            if self._bulk is not None:
                await self._bulk.close()
            await self._bus.close()

        try:
            self._wait(shut(), 5.0)
        except Exception as e:  # closing must never fail the engine's own shutdown
            log.warning("bridge_close_failed", error=repr(e))
        self._loop.call_soon_threadsafe(self._loop.stop)
