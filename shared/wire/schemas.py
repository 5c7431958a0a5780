"""The wire format (msgpack via msgspec, which validates types) and the mesh's bus messages.

The sandbox IPC (`sandbox.py`), the bulk channels' control messages (`channels.py`), a generate
request and its streamed chunks (`generation.py`) and the log-probabilities a reply reports
(`logprobs.py`) are defined beside this module; every message is encoded and decoded here.

Each message is a tagged struct: its msgpack map carries `type` (the message kind) and `v`
(the schema version). `decode` checks, in order: size, msgpack-ness, version, then every field's
type (closed sets of names are `Literal`s, so an unknown mode or kind is refused at decode), and
raises a specific `BadMessageError` subclass naming what is wrong.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from droidmesh.shared.errors import BadMessageError, SchemaVersionError
from droidmesh.shared.wire.hashing import MAX_SCOPE_CHARS, PUBLIC, SCOPE_PATTERN
from droidmesh.shared.wire.logprobs import TokenLogprob

SCHEMA_VERSION = 8
MAX_MESSAGE_BYTES = 1 << 20  # NATS' default max payload; bulk tensors never ride the bus


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION


# Who may reuse a context (`hashing.py`): checked at decode, so a malformed one never gets further.
Scope = Annotated[str, msgspec.Meta(pattern=SCOPE_PATTERN, max_length=MAX_SCOPE_CHARS)]


class Fingerprint(msgspec.Struct):
    """`shared.model.fingerprint.ArchFingerprint` on the wire."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: str
    vocab_hash: str


# -- cache availability (events) ------------------------------------------------------------
Transport = Literal["ucx", "inproc", "nixl", "shm"]  # bulk channels (shared/transport/); `address` is theirs to parse
ItemKind = Literal["K", "V", "E"]
CodecParams = dict[str, int | float | str]
LOWRANK_CODEC = "lowrank"  # SCD codes (shared/transport/codecs.py); its plans name their maps file:
MAPS_PARAM = "maps"  # codec param: the maps' sha256 (shared/mesh/maps_store.py)


class CacheAvailable(Message, tag="cache.available"):
    """A sender holds a context's KV of every layer and E of `e_layers`, pullable over its bulk
    channel (`transport`, at `address`)."""

    sender_id: str
    model_id: str
    model_sha256: str  # content hash of the sender's weights: pair configs are bound to it
    fingerprint: Fingerprint
    fingerprint_id: str
    context_id: str  # hash of the token ids
    token_ids: list[int]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    kv_nbytes: list[int]  # per layer, K + V
    e_layers: list[int]
    e_nbytes: int  # per E tensor
    transport: Transport
    address: str  # ucx, nixl: "host:port"; shm: a Unix socket's path; inproc: the server's name
    published_at: float  # unix seconds
    scope: Scope = PUBLIC  # who may reuse it; `context_id` is seeded by it


class CacheEvicted(Message, tag="cache.evicted"):
    sender_id: str
    context_id: str


class SenderHeartbeat(Message, tag="sender.heartbeat"):
    """Liveness; `context_ids` lets a restarted broker drop holders that vanished meanwhile."""

    sender_id: str
    model_id: str
    context_ids: list[str]
    interval_s: float
    sent_at: float


class BrokerHello(Message, tag="broker.hello"):
    """A (re)started broker asks senders to re-announce what they hold; with `sender_id`, only
    that sender (one the broker had dropped and hears heart-beating again)."""

    broker_id: str
    sender_id: str = ""  # "" = every sender


# -- broker lookup --------------------------------------------------------------------------
class LookupRequest(Message, tag="lookup.request"):
    token_ids: list[int]
    fingerprint_id: str
    exclude_model: str | None = None  # e.g. the receiver itself
    exclude_sender: str | None = None  # a holder id whose contexts the asker does not want (its own)
    # sender models whose holders the asker can use (the pairs it has configs for, its own model):
    # their holders win over a longer prefix elsewhere, which would only send it to its own
    # prefill; [] = any
    models: list[str] = []
    scope: Scope = PUBLIC  # the asker's: only holders of this scope or public ones are found


class GrantRequest(Message, tag="grant.request"):
    """A receiver asks a holder's sender for one pull of a context (shared/transport/tokens.py)."""

    context_id: str


class GrantReply(Message, tag="grant.reply"):
    token: str  # single use, for `context_id` only
    expires_at: float  # unix seconds


class LookupReply(Message, tag="lookup.reply"):
    holder: CacheAvailable | None
    matched_tokens: int


# -- generate / prefill ---------------------------------------------------------------------
# What a client may ask for: auto (the reuse policy decides) or one forced path (benchmarks, demo).
Mode = Literal["auto", "full_prefill", "full_reuse"]
MODES: tuple[Mode, ...] = ("auto", "full_prefill", "full_reuse")
# The path a reply was served by: sender_own = a sender answering over its own cache; translate = a
# context another model (other size, family or tokenizer) holds, translated (shared/kv/translate.py).
Path = Literal["partial", "full_reuse", "cacheblend", "full_prefill", "fallback", "sender_own", "translate"]

Role = Literal["system", "user", "assistant"]
FinishReason = Literal["stop", "length"]  # a stop sequence or EOS; max_new_tokens reached


class ChatMessage(msgspec.Struct):
    role: Role
    content: str


class SampleReply(msgspec.Struct):
    """One more sample of a request's answer (`GenerateRequest.n` > 1), as the reply's own fields."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None


class GenerateReply(Message, tag="generate.reply"):
    request_id: str
    text: str
    token_ids: list[int]
    path: Path
    fallback_reason: str | None
    plan: str
    sender_id: str | None
    bytes_pulled: int
    ttft_ms: float
    stages_ms: dict[str, float]
    served_by: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the sender
    finish_reason: FinishReason = "length"
    codec: str = ""  # the wire codec the reused tensors came under ("" when nothing was reused)
    predicted_ttft_ms: float = 0.0  # the reuse policy's prediction for the path taken (0: no latency fit)
    options_ms: dict[str, float] = {}  # its prediction per option it weighed ("full prefill", each plan)
    logprobs: list[TokenLogprob] | None = None  # per token of `token_ids`, when `Sampling.logprobs` asked
    samples: list[SampleReply] = []  # samples 2..n of the answer, when the request asked for n > 1


class PrefillRequest(Message, tag="prefill.request"):
    """Prefill `context` as completions and `ask` will send it, or, with `chat`, the token prefix
    every chat opening with these messages shares (`text.chat_prefix_ids`: the chat template's
    default system turn included; then `context` is empty). A sender that predates `chat` ignores
    it and caches the empty context, its start token alone: a reply of 1 token tells (`prefill`
    says so)."""

    request_id: str
    context: str
    chat: list[ChatMessage] | None = None
    scope: Scope = PUBLIC  # who may reuse the cached context


class PrefillReply(Message, tag="prefill.reply"):
    request_id: str
    context_id: str
    tokens: int
    nbytes: int


class ErrorReply(Message, tag="error"):
    code: str
    message: str
    request_id: str | None = None


# -- recompute configs (profiler -> JetStream KV bucket -> receivers, senders) --------------
class PlanSpec(msgspec.Struct):
    """A whole reuse plan as published: the recompute groups, and how reused layers travel."""

    groups: list[tuple[int, int]]  # recompute [start, end) each, ascending; [] means full reuse
    codec: str = "raw"  # wire codec of the reused tensors (shared/transport/codecs.py)
    codec_params: CodecParams = {}
    patch_layers: list[int] = []  # SCD patch layers (shared/kv/plan.py): their KV projected from a decoded E


class FrontierPoint(msgspec.Struct):
    plan: PlanSpec
    recomputed_layers: int
    quality: float
    wire_bytes_per_token: int = 0  # what a pull under this plan moves per context token; 0: raw (from the latency fit)


class LatencyFit(msgspec.Struct):
    """Prefill seconds ~= c0 + c_tok * tokens + c_layer_tok * tokens * layers + c_attn * tokens^2 * layers."""

    c0: float
    c_tok: float
    c_layer_tok: float
    c_attn: float
    kv_bytes_per_token_layer: int  # K + V bytes one reused layer costs per token
    e_bytes_per_token: int


class RelayBucket(msgspec.Struct, frozen=True):
    """The relay audit's verdict (`droidmesh audit --policy`) for requests whose reusable-prefix
    fraction lies in [lo, hi) (hi = 1 includes 1): relay False sends them to the receiver's own
    prefill; True or None (undecided) leaves the choice to the latency prediction."""

    lo: float
    hi: float
    relay: bool | None = None


class RecomputeConfig(Message, tag="recompute.config"):
    """A pair's profile. It applies only to the exact weights profiled (the sha256s): a model
    re-trained under the same name never inherits it."""

    sender_model: str
    receiver_model: str
    sender_sha256: str
    receiver_sha256: str
    profile_version: int
    task: str
    tolerance: float
    chosen: FrontierPoint
    frontier: list[FrontierPoint]  # raw: best quality per recomputed-layer count, ascending; then coded points (SCD, int8, int4)
    full_prefill_quality: float
    full_reuse_quality: float
    total_layers: int
    latency: LatencyFit | None = None
    created_at: float = 0.0
    relay: list[RelayBucket] = []  # the audit's policy file, when one was applied (`droidmesh config relay-policy`)
    # The chosen plan checked on the profile's test split, never used to choose (None: a config
    # made without one). test_interval: the chosen plan's relative difference to full prefill on
    # the same test_rows, 95 % bootstrap [lo, hi]; test_verdict: the rule applied to it ("within",
    # "below", "undecided"). passes_test: True / False / None for those verdicts, or, for a
    # profile without per-row scores, chosen_quality_test >= (1 - tolerance) x
    # full_prefill_quality_test. `droidmesh config publish` refuses a False without --force, the
    # profiler service refuses it outright.
    chosen_quality_test: float | None = None
    full_prefill_quality_test: float | None = None
    passes_test: bool | None = None
    test_rows: int | None = None
    test_interval: list[float] | None = None
    test_verdict: Literal["within", "below", "undecided"] | None = None


class ProfileRow(msgspec.Struct):
    """A calibration row sent with a profile request: a context, a question and reference answers
    (a receiver's recent relayed request, answered by its own full prefill)."""

    context: str
    input: str
    answers: list[str]


class ProfileRequest(Message, tag="profile.request"):
    """Profile a pair offline and publish its config (checkpoint paths local to the profiler).
    Operators may set every field; a receiver's re-profile (its own subject) only the pair's model
    ids, task, row counts, granularity, tolerance, search, max layers, rows and sha256s, with exhaustive false
    (services/profiler/checks.py)."""

    request_id: str
    sender_path: str
    receiver_path: str
    task: str
    sender_model: str = ""  # ids the config is published under (default: directory names)
    receiver_model: str = ""
    n_train: int = 50
    n_test: int = 50
    granularity: int = 2
    tolerance: float = 0.05
    exhaustive: bool = True
    search: str = "guided"  # how the group is found: guided, coarse or fidelity (shared/profiling/profile.py SEARCHES)
    max_layers: int | None = None  # the fidelity search's cap on the group's layers (None: any)
    data_train: str | None = None  # LongBench-style JSONL instead of the zoo's generated split: a file under the profiler's data root
    data_test: str | None = None
    version: int = 0  # 0: the profiler picks one (unix seconds, above the pair's newest); never far ahead of its clock
    other_tasks: list[str] | None = None  # robustness check tasks or data files (None: every other zoo task)
    transfer: bool = False  # also search codecs / SCD maps (shared/profiling/transfer.py); maps published too
    rows: list[ProfileRow] = []  # profile on these (split in two) instead of the task's rows or files
    sender_sha256: str = ""  # the weights the asker holds a config for: a profiler with others refuses ("": any)
    receiver_sha256: str = ""
    relay: list[RelayBucket] = []  # the audit's verdicts the new config gets (a re-profile keeps its pair's newest config's)


class ProfileReply(Message, tag="profile.reply"):
    request_id: str
    config: RecomputeConfig
    result_json: str


# -- the UCX pull protocol (rides the UCX endpoint, not NATS) ------------------------------
class PullItem(msgspec.Struct, omit_defaults=True):
    layer: int
    kind: ItemKind
    start: int = 0  # first context token sent (K / V of a sliding-window layer: its window's keys only)


class PullRequest(Message, tag="pull.request"):
    context_id: str
    items: list[PullItem]  # served in this order: E first lets the receiver start early
    token: str = ""  # a grant from the holder's sender (GrantRequest), used up by this pull
    codec: str = "raw"  # how the receiver wants the tensors encoded
    codec_params: CodecParams = {}
    tokens: int = 0  # leading context tokens wanted (0: all); the sender slices [.., item.start:tokens, ..]
    device_exports: bool = False  # shm: the receiver opens device exports (CUDA IPC); else device-held items come copied


class TensorHeader(Message, tag="tensor.header"):
    """Precedes each tensor's encoded bytes. `shape` and `dtype` are the decoded tensor's;
    `nbytes` is the encoded size and `checksum` covers exactly those bytes (xxh3-64 of host bytes,
    `integrity.device_checksum` of device bytes)."""

    context_id: str
    layer: int
    kind: ItemKind
    shape: list[int]
    dtype: str
    codec: str
    codec_params: CodecParams
    nbytes: int
    checksum: str


class PullResponse(Message, tag="pull.response"):
    """The sender's answer to a PullRequest: every item's header up front (then the bytes of
    each, in order), or an error and no bytes."""

    headers: list[TensorHeader]
    error: str | None = None


M = TypeVar("M", bound=Message)
_ENCODER = msgspec.msgpack.Encoder()
_RAW = msgspec.msgpack.Decoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def _decoder(kind: type[M]) -> msgspec.msgpack.Decoder[M]:
    dec = _DECODERS.get(kind)
    if dec is None:
        dec = _DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    return dec


def decode(data: bytes, kind: type[M]) -> M:
    """Decode `data` as a `kind` message or raise a BadMessageError saying exactly why."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        raw: Any = _RAW.decode(data)
    except msgspec.DecodeError as e:
        raise BadMessageError(f"not msgpack: {e}") from None
    if not isinstance(raw, dict):
        raise BadMessageError(f"expected a msgpack map, got {type(raw).__name__}")
    if raw.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise SchemaVersionError(f"schema version {raw.get('v')!r}; this build speaks {SCHEMA_VERSION}")
    try:
        return _decoder(kind).decode(data)
    except msgspec.ValidationError as e:
        raise BadMessageError(f"invalid {kind.__name__}: {e}") from None
    except msgspec.DecodeError as e:  # pragma: no cover - raw decode above already succeeded
        raise BadMessageError(str(e)) from None


def fingerprint_to_wire(fp: Any) -> Fingerprint:
    return Fingerprint(**fp.to_dict())
