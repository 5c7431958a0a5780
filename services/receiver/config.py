"""Receiver configuration (flags / DM_RECEIVER_* / DM_* env)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.holding.settings import HolderSettings
from droidmesh.shared.model.device import DTYPES, check_device_name, default_dtype_name
from droidmesh.shared.service.batching import DEFAULT_MAX_BATCH
from droidmesh.shared.transport.bulk import TRANSPORTS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReceiverConfig(HolderSettings):
    """Hosts a model (and adapters of it); answers generate requests, reusing a holder's cache when
    it can, and holds what its own prefills computed for the next request (`hold`)."""

    model_path: str = dataclasses.field(metadata={"help": "local HF checkpoint directory"})
    model_id: str = dataclasses.field(default="", metadata={"help": "id served (default: directory name)"})
    transport: str = dataclasses.field(default="ucx", metadata={
        "help": "bulk channel to pull over (ucx; nixl; shm: senders on this host; inproc: same process, tests)"})
    device: str = dataclasses.field(default="cpu", metadata={"help": "cpu, cuda or cuda:N: where the model runs"})
    dtype: str = dataclasses.field(default="", metadata={"help": "weights and cache dtype (default: bfloat16 on cuda, float32 on cpu)"})
    default_group: tuple[int, ...] = dataclasses.field(
        default=(), metadata={"help": "recompute group 'start,end' used without a profile (empty: full prefill)"})
    lookup_timeout_s: float = dataclasses.field(default=0.5, metadata={"help": "broker lookup deadline"})
    reuse_timeout_s: float = dataclasses.field(default=10.0, metadata={"help": "deadline for pulling + reuse"})
    request_timeout_s: float = dataclasses.field(default=60.0, metadata={"help": "default request deadline"})
    max_concurrent_pulls: int = dataclasses.field(default=4, metadata={"help": "bound on pulls in flight"})
    receiver_id: str = dataclasses.field(default="", metadata={"help": "unique id (default: model_id-pid)"})
    max_new_tokens_limit: int = dataclasses.field(
        default=1024, metadata={"help": "largest max_new_tokens a request may ask for"})
    max_prompt_chars: int = dataclasses.field(
        default=500_000, metadata={"help": "largest prompt a request may send (context + question, or all chat contents), in characters"})
    max_queued_requests: int = dataclasses.field(
        default=64, metadata={"help": "requests held at once (queued, computing or pulling); more are refused 'overloaded'"})
    max_batch: int = dataclasses.field(default=DEFAULT_MAX_BATCH, metadata={
        "help": "continuous batching: decode steps of at most this many requests run as one forward (each with its "
                "own cache, sampler and stops; a request joins after its prefill and leaves when done); 1: one "
                "request's decode at a time"})
    decode_pool_tokens: int = dataclasses.field(default=0, metadata={
        "help": "decode pool: the batch decodes in max_batch fixed slots of this many tokens each (prompt and "
                "answer; memory 2 x layers x max_batch x tokens x KV width per served model, allocated at start), one "
                "attention call "
                "per layer for the whole batch; a request that does not fit decodes beside it; 0: off (each "
                "request's own cache, rows attended one by one)"})
    cuda_graphs: bool = dataclasses.field(default=True, metadata={
        "help": "on a CUDA device, captured at start and replayed as CUDA graphs (no per-kernel launch cost): every "
                "short pass (<= 128 new tokens: a suffix over a reused prefix, one request's decode step) as its "
                "layers' pieces around the attention, and with a decode pool each (batch, context) bucket's step; "
                "off: all eager"})
    breaker_failures: int = dataclasses.field(
        default=3, metadata={"help": "consecutive failed pulls from one sender that open its circuit (no pulls from it for a cool-down)"})
    breaker_cooldown_s: float = dataclasses.field(
        default=10.0, metadata={"help": "how long an open circuit skips its sender before one request probes it again"})
    kv_screen: bool = dataclasses.field(default=True, metadata={
        "help": "screen every pulled K/V/E against this model's own statistics, measured once on a fixed text "
                "(per tensor its scale and common offset, per request the offsets' direction): a failure makes the "
                "request fall back (reason 'integrity: screen: ...'); off: only the range checks"})
    shadow_share: float = dataclasses.field(default=0.0, metadata={
        "help": "randomized audit: share of relayed greedy requests also answered by full prefill when the receiver "
                "is idle, off the critical path; the token agreement is logged (event 'shadow')"})
    holdout_share: float = dataclasses.field(default=0.0, metadata={
        "help": "randomized audit: share of requests the policy would relay that are served by full prefill "
                "instead (control), the assignment logged"})

    blind_share: float = dataclasses.field(default=0.0, metadata={
        "help": "randomized audit: share of relayable requests relayed whatever the policy predicts (assignment "
                "'blind'), so the audit measures relaying itself where the policy would not relay"})
    quality_threshold: float = dataclasses.field(default=0.8, metadata={
        "help": "quality watch: a sender model's mean shadow agreement below this (over quality_window shadows) "
                "raises dm_quality_drift and asks the profiler to re-profile the pair on recent contexts; 0: off"})
    quality_window: int = dataclasses.field(default=20, metadata={"help": "shadows the quality watch averages, per sender model"})
    reprofile: bool = dataclasses.field(default=True, metadata={
        "help": "on a quality drop, ask the profiler service to re-profile the pair (under NATS users it publishes "
                "re-profiles for operators only: a receiver's request tells them, `reprofile_wanted`)"})
    reprofile_timeout_s: float = dataclasses.field(default=900.0, metadata={"help": "deadline of a re-profile request"})
    translators: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "translated pairs: per translator 'FILE@SHA256', or 'SHA256' alone to fetch it from the maps bucket "
                "(`droidmesh profile --translate [--publish]` prints the sha256); a context a model of another family "
                "or tokenizer holds is translated instead of prefilled; a translator whose hash differs is refused "
                "and such requests get the receiver's own prefill, with the reason"})

    min_reuse_fraction: float = dataclasses.field(default=0.5, metadata={
        "help": "in auto mode, a holder (of any weights) is used only when it covers at least this share of "
                "the prompt's tokens: a shared opening (chat template, system prompt) would cost quality or a pull "
                "for little compute, and the own prefill is what this receiver holds for the next request"})
    hold: bool = dataclasses.field(default=True, metadata={
        "help": "offer what this receiver's own full prefills computed (the prompt's KV, and E at the layers pair "
                "configs naming its model as the sender use) as a holder, within store_bytes: the next request over "
                "the same text, to this model or a paired one, reuses it with no prefill command"})
    public_holding: bool = dataclasses.field(default=False, metadata={
        "help": "a request that names no scope reads and is held in `public`: every client and tenant may reuse "
                "what it caused to be held, and tell from reused-token counts what its prompt began with. Off (the "
                "default): it is its NATS user's own (`user:<name>`), reused by that user alone"})
    holder_id: str = dataclasses.field(default="", metadata={
        "help": "id its held contexts are announced and granted under (default: receiver_id, without NATS auth); "
                "under NATS auth the roster must name it (`droidmesh nats-auth --holder MODEL=ID`), and without "
                "one this receiver holds nothing"})
    hold_e_layers: tuple[int, ...] = dataclasses.field(default=(), metadata={
        "help": "layers whose E is kept with every held context, besides those pair configs ask for"})
    adapters: tuple[str, ...] = dataclasses.field(default=(), metadata={
        "help": "adapters of model_path served by this process too, 'NAME=DIR' each: one copy of the base's weights, "
                "the adapter chosen per request by its model id NAME; KV computed under one is reused by another in "
                "process (no transfer)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        p = Path(self.model_path)
        if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
            raise ConfigError(f"model_path {self.model_path!r} holds no checkpoint")
        check_device_name(self.device)
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport {self.transport!r} not one of {TRANSPORTS}")
        if not self.dtype:
            object.__setattr__(self, "dtype", default_dtype_name(self.device))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.default_group and (len(self.default_group) != 2 or not 0 <= self.default_group[0] < self.default_group[1]):
            raise ConfigError(f"default_group must be 'start,end' with start < end, got {self.default_group}")
        for name in ("lookup_timeout_s", "reuse_timeout_s", "request_timeout_s", "breaker_cooldown_s",
                     "reprofile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in ("max_concurrent_pulls", "max_new_tokens_limit", "max_prompt_chars", "max_queued_requests",
                     "max_batch", "breaker_failures", "quality_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.decode_pool_tokens < 0 or self.decode_pool_tokens == 1:
            raise ConfigError(f"decode_pool_tokens must be 0 (off) or >= 2, got {self.decode_pool_tokens}")
        for name in ("holdout_share", "shadow_share", "blind_share", "quality_threshold", "min_reuse_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} {getattr(self, name)} outside [0, 1]")
        if self.holdout_share + self.blind_share > 1.0:
            raise ConfigError(f"holdout_share + blind_share = {self.holdout_share + self.blind_share:g} > 1")
        for entry in self.translators:
            path, at, sha = entry.rpartition("@")
            if (at and not path) or not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise ConfigError(f"translator {entry!r} is not 'FILE@SHA256' or 'SHA256' (64 lowercase hex digits)")
        if not self.model_id:
            object.__setattr__(self, "model_id", p.name)
        if not self.receiver_id:
            object.__setattr__(self, "receiver_id", f"{self.model_id}-{os.getpid()}")
        if not self.holder_id and not (self.nats_user or self.nats_creds):
            # Under NATS auth a holder may publish only under an id the roster names (`--holder`):
            # without one given, this receiver holds nothing (`holding` is False; logged at start).
            object.__setattr__(self, "holder_id", self.receiver_id)
        if any(l < 0 for l in self.hold_e_layers):
            raise ConfigError(f"hold_e_layers must be >= 0: {self.hold_e_layers}")
        names = [self.model_id]
        for entry in self.adapters:
            name, eq, path = entry.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name) or not path:
                raise ConfigError(f"adapter {entry!r} is not 'NAME=DIR' (NAME: letters, digits, '.', '_', '-')")
            if not (Path(path) / "adapter_config.json").is_file():
                raise ConfigError(f"adapter {name}: {path!r} holds no adapter_config.json")
            names.append(name)
        if len(set(names)) != len(names):
            raise ConfigError(f"served model ids must differ: {names}")

    @property
    def holding(self) -> bool:
        """Whether this receiver holds what it prefills: `hold`, with a holder id to do it under."""
        return self.hold and bool(self.holder_id)

    def adapter_dirs(self) -> dict[str, Path]:
        """The adapters served besides the base: model id -> directory."""
        return {name: Path(path) for name, _, path in (e.partition("=") for e in self.adapters)}
