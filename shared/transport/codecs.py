"""Wire codecs: how one tensor travels as bytes, and the registry a receiver decodes from.

A `Codec` (stateless; both methods block while they compute, on whatever thread calls them):
  - `encode(t, params)`        sender, serving a pull: tensor -> (uint8 payload, params as sent)
  - `decode(payload, header, out)`  receiver, as the item lands: write the decoded tensor into
                               `out`, the caller's buffer (its shape, dtype and device)
  - `max_nbytes(shape, dtype, params)`  receiver, before receiving: the largest payload a
                               well-behaved sender can send for that tensor. A header claiming more
                               is refused before any buffer is allocated for it.
  - `sends_own_bytes(t, params)`  optional, sender: `encode` would return `t`'s own bytes (no
                               copy), so the pull is not charged for one; a codec without it copies.
Registered here: `raw` (the tensor's own bytes, no copy on either side when the buffer is on the
CPU), `int8` and `int4` (quantized, `shared/kv/quant.py`; see "Quantized codecs" below),
`lowrank` (SCD codes under a pair's learned maps, `shared/kv/scd.py`; see "SCD codes" below),
`layered` (raw, int8 or int4 per layer, `LayeredCodec`: a profile's per-layer choice, one pull);
`register` adds more (compressed codecs plug in here, nothing else changes). Both ends share
`payload_view` and `integrity.checksum`; a receiver lands each payload where `placement.py` says.

The sender passes the item's kind ("K", "V" or "E") and layer to `encode` and `max_nbytes` as the
params `KIND_PARAM` and `LAYER_PARAM` (whatever the request said under those names is replaced); a
codec whose layout depends on them echoes them in the header's params, so the receiver's
`max_nbytes` is exact.

SCD codes (`lowrank`). The request names the pair's maps by their sha256 (`MAPS_PARAM`); both ends
must have loaded that file (`LOWRANK.add_maps`, after checking its hash: `scd.Maps.from_bytes`),
else the item is refused (`IntegrityError`, the receiver falls back to its own prefill and says
why). An item the maps hold a code for travels as its codes [H, T, r] (E: [T, r]) in the stored
dtype; any other item of the same pull travels as its raw bytes. A K or V decodes into the
receiver's estimate of its own K or V; an E decodes into the receiver's estimate of its
normalized attention input at that layer (a patch layer, see `shared/kv/plan.py`).

Quantized codecs (`int8`, `int4`; layouts in `shared/kv/quant.py`). Scales and zero points travel
in the payload, under its checksum (per-token scales grow with the context, control frames are
capped); `codec_params` carry only the kind and int4's `group`. Each pull encodes on the stored tensor's
device (the store keeps raw tensors: receivers ask for other codecs, groups and token prefixes);
CUDA payloads are staged in pinned host memory, and the receiver dequantizes on `out.device`. Bad
input is an `IntegrityError` before `out` is written: a kind or group that does not fit the buffer,
unexpected params, a payload of another size than the layout's, scales that are negative or NaN or
would decode beyond the buffer dtype's range (so no NaN / inf comes out of a decode).

Raw and CUDA tensors. A payload is host memory unless a channel that can move device memory asks
for device payloads (`DEVICE_PARAM` in the request's codec params; UCX, with its CUDA transports: `capabilities.py`):
  1. the receiver asks (every buffer on CUDA); the sender's encode answers a CUDA tensor with its
     own device bytes and echoes `DEVICE_PARAM` in the header, or, not asked, with a copy in
     pinned host memory (a CPU tensor is always its own host bytes, the param not echoed);
  2. the receiver lands a header carrying `DEVICE_PARAM` in its CUDA buffer itself
     (`placement.receive_buffer`), any other payload for a CUDA buffer in pinned host memory;
  3. `decode` copies a staged payload into `out` (host to device for pinned staging).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import msgspec
import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv import quant, scd
from droidmesh.shared.transport.prepared import PreparedCodes
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.schemas import CodecParams, TensorHeader


class Codec(Protocol):
    name: str

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]: ...

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None: ...

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int: ...


_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec) -> None:
    """Make `codec` available to both ends of every bulk channel in this process."""
    _REGISTRY[codec.name] = codec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Codec:
    """The registered codec `name`; `IntegrityError` for one this build does not know."""
    codec = _REGISTRY.get(name)
    if codec is None:
        raise IntegrityError(f"unknown codec {name!r}; this build knows {sorted(_REGISTRY)}")
    return codec


def names() -> list[str]:
    return sorted(_REGISTRY)


def sends_own_bytes(codec: Codec, params: CodecParams, t: torch.Tensor) -> bool:
    """Whether `codec.encode(t, params)` copies nothing (see the module docstring)."""
    own = getattr(codec, "sends_own_bytes", None)
    return own is not None and bool(own(t, params))


def payload_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage [nbytes] (no copy)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(torch.uint8).reshape(-1)  # [numel * itemsize]


def nbytes_of(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize


# Raw codec param: "cuda" in a request = the receiver takes device payloads; in a header = this
# payload is device memory. Set by the UCX channel only (see the module docstring).
DEVICE_PARAM = "payload_memory"


def asks_device(params: CodecParams) -> bool:
    return params.get(DEVICE_PARAM) == "cuda"


class RawCodec:
    """The tensor's own bytes. Decoding into a CPU buffer needs no copy at all: channels receive
    straight into `out`, nor into a CUDA buffer when the payload travels as device memory (see
    `placement.receive_buffer`)."""

    name = "raw"

    def sends_own_bytes(self, t: torch.Tensor, params: CodecParams) -> bool:  # contiguous, where the receiver takes it
        return t.is_contiguous() and (t.device.type != "cuda" or asks_device(params))

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        if t.device.type != "cuda":
            return payload_view(t), {}
        if asks_device(params):
            return payload_view(t), {DEVICE_PARAM: "cuda"}
        return pinned_copy(payload_view(t)), {}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        if payload.numel() != nbytes_of(out.shape, out.dtype):
            raise IntegrityError(f"layer {header.layer} {header.kind}: {payload.numel()} bytes for {list(out.shape)}")
        if payload.data_ptr() != out.data_ptr() or not out.is_contiguous():  # staged, not received in place
            out.copy_(payload.view(out.dtype).reshape(out.shape), non_blocking=True)  # inside `streams.landing`

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        return nbytes_of(shape, dtype)


def pinned_copy(source: torch.Tensor) -> torch.Tensor:
    """A uint8 device payload copied to pinned host memory (device-to-host at full speed)."""
    staged = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    staged.copy_(source)
    return staged


# Quantized codec params: the item's kind (set by the sender's server, echoed) and int4's group.
KIND_PARAM = "kind"
LAYER_PARAM = "layer"
GROUP_PARAM = "group"
MAPS_PARAM = schemas.MAPS_PARAM


def _host(payload: torch.Tensor) -> torch.Tensor:
    return pinned_copy(payload) if payload.device.type == "cuda" else payload


def _kind(params: CodecParams, codec: str) -> str:
    kind = params.get(KIND_PARAM)
    if not isinstance(kind, str) or kind not in quant.KINDS:
        raise IntegrityError(f"{codec}: param {KIND_PARAM!r} = {kind!r}, expected one of {quant.KINDS}")
    return kind


def _only(header: TensorHeader, keys: set[str]) -> None:
    if set(header.codec_params) != keys:
        raise IntegrityError(f"layer {header.layer} {header.kind}: {header.codec} params {sorted(header.codec_params)}, "
                             f"expected {sorted(keys)}")


def _echoed_kind(header: TensorHeader, keys: set[str]) -> str:
    """The item's kind, once its params are exactly `keys` and the kind they echo is the item's own."""
    _only(header, keys)
    if (laid := header.codec_params[KIND_PARAM]) != header.kind:
        raise IntegrityError(f"layer {header.layer} {header.kind}: {header.codec} laid out for kind {laid!r}")
    return header.kind


class Int8Codec:
    """Symmetric int8: K with one scale per (head, dim), V per token, E per token and 32 dims
    (`quant`); |x - x_hat| <= scale / 2 (+ rounding). About 1/2 of bf16's bytes. The header echoes
    the kind, which the layout depends on."""

    name = "int8"

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        kind = _kind(params, self.name)
        return _host(quant.int8_quantize(t, kind)), {KIND_PARAM: kind}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        kind = _echoed_kind(header, {KIND_PARAM})
        try:
            quant.int8_dequantize(payload, kind, out)
        except IntegrityError as e:
            raise IntegrityError(f"layer {header.layer} {header.kind}: {e}") from None

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        """Exact for the kind in `params`; without one, the largest over the kinds `shape` fits."""
        if KIND_PARAM in params:
            return quant.int8_nbytes(shape, _kind(params, self.name))
        return max((quant.int8_nbytes(shape, k) for k in quant.KINDS if len(shape) >= (2 if k == "K" else 1)), default=0)


class Int4Codec:
    """Asymmetric int4 per group of `GROUP_PARAM` values (default `quant.default_group`, 32): K per
    channel over that many tokens, V and E per token over that many dims (it must divide the last
    dim); two values per byte (`quant.int4_*`), |x - x_hat| <= scale / 2 (+ rounding). With group
    32: 3/16 of float32's bytes, 3/8 of bf16's. The header echoes the group and the kind."""

    name = "int4"

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        kind, shape = _kind(params, self.name), tuple(t.shape)
        group = quant.check_group(shape, params.get(GROUP_PARAM, quant.default_group(shape)), kind)
        return _host(quant.int4_quantize(t, group, kind)), {GROUP_PARAM: group, KIND_PARAM: kind}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        kind = _echoed_kind(header, {GROUP_PARAM, KIND_PARAM})
        try:
            group = quant.check_group(tuple(out.shape), header.codec_params[GROUP_PARAM], kind)
            quant.int4_dequantize(payload, group, out, kind)
        except IntegrityError as e:
            raise IntegrityError(f"layer {header.layer} {header.kind}: {e}") from None

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        """Exact for the kind in `params`; without one, K's or V's, the larger (`IntegrityError`: a bad group)."""
        kind = _kind(params, self.name) if KIND_PARAM in params else None
        group = quant.check_group(shape, params.get(GROUP_PARAM, quant.default_group(shape)), kind)
        if kind is not None:
            return quant.int4_nbytes(shape, group, kind)
        return max(quant.int4_nbytes(shape, group), quant.int4_nbytes(shape, group, "K") if len(shape) > 1 else 0)


class LowRankCodec:
    """SCD codes under loaded maps (see "SCD codes" in the module docstring). `add_maps` is called
    by the services when a pair config's maps have been fetched and checked (on their loop; it
    does not block); the codec methods may run on any thread."""

    name = schemas.LOWRANK_CODEC

    def __init__(self) -> None:
        self._maps: dict[str, scd.Maps] = {}
        self._prepared = PreparedCodes()  # of stored tensors, by where they lie: `prepare`

    def add_maps(self, maps: scd.Maps) -> None:
        self._maps[maps.sha256] = maps

    def loaded(self) -> list[scd.Maps]:
        return list(self._maps.values())

    def prepare(self, t: torch.Tensor, layer: int, kind: str, maps: scd.Maps) -> torch.Tensor | None:
        """Sender, when it stores a context (torch thread; blocks while encoding): the codes of
        the stored tensor `t` under `maps` (None: no code for this item). The caller keeps them
        (its store counts them); while `t` lives, `encode` of `t` or of a token prefix of it
        slices them instead of encoding: codes are per token, so a prefix's codes are a prefix."""
        code = maps.code(layer, kind)
        if code is None:
            return None
        codes = scd.encode(t, kind, code, maps.rope)  # [H, T, r] | [T, r]
        self._prepared.put(t, maps.sha256, codes)
        return codes

    def has_maps(self, sha256: str) -> bool:
        return sha256 in self._maps

    def maps(self, sha256: str) -> scd.Maps:
        found = self._maps.get(sha256)
        if found is None:
            raise IntegrityError(f"lowrank: maps {str(sha256)[:12]}... not loaded here")
        return found

    def _item(self, params: CodecParams) -> tuple[scd.Maps, str, int, scd.LinearCode | None]:
        sha, layer = params.get(MAPS_PARAM), params.get(LAYER_PARAM)
        if not isinstance(sha, str) or not isinstance(layer, int):
            raise IntegrityError(f"lowrank: params {MAPS_PARAM!r} (a sha256) and {LAYER_PARAM!r} (an int) are required")
        maps = self.maps(sha)
        kind = _kind(params, self.name)
        return maps, kind, layer, maps.code(layer, kind)

    def sends_own_bytes(self, t: torch.Tensor, params: CodecParams) -> bool:
        """An item the maps have no code for travels as its own bytes (host memory, contiguous)."""
        return self._item(params)[3] is None and t.device.type != "cuda" and t.is_contiguous()

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        maps, kind, layer, code = self._item(params)
        echo: CodecParams = {MAPS_PARAM: maps.sha256, KIND_PARAM: kind, LAYER_PARAM: layer}
        if code is None:
            return _host(payload_view(t)), echo
        scd.check_fits(kind, tuple(t.shape), code)
        codes = self._prepared.get(t, kind, maps.sha256)
        if codes is None:
            codes = scd.encode(t, kind, code, maps.rope)
        return _host(payload_view(codes)), echo

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        _only(header, {MAPS_PARAM, KIND_PARAM, LAYER_PARAM})
        maps, kind, layer, code = self._item(header.codec_params)
        if (kind, layer) != (header.kind, header.layer):
            raise IntegrityError(f"layer {header.layer} {header.kind}: lowrank laid out for layer {layer} {kind}")
        if code is None:
            get(RawCodec.name).decode(payload, header, out)
            return
        try:
            scd.check_fits(kind, tuple(out.shape), code)
        except IntegrityError as e:
            raise IntegrityError(f"layer {layer} {kind}: {e}") from None
        shape = scd.code_shape(kind, tuple(out.shape), code)
        if payload.numel() != nbytes_of(shape, out.dtype):
            raise IntegrityError(f"layer {layer} {kind}: {payload.numel()} bytes of codes, expected {list(shape)}")
        codes = payload.view(out.dtype).reshape(shape)  # [H, T, r] | [T, r]
        scd.decode(codes, kind, code, maps.rope, out)

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        """Exact for loaded maps; `IntegrityError` for maps not loaded here or a code that does not fit."""
        _, kind, _, code = self._item(params)
        if code is None:
            return nbytes_of(shape, dtype)
        scd.check_fits(kind, shape, code)
        return nbytes_of(scd.code_shape(kind, shape, code), dtype)


LAYERS_PARAM = "layers"  # the layered codec's param: per layer of the sender's model, its items' codec
LETTERS = {"r": "raw", "8": "int8", "4": "int4"}
_ECHOED = {"raw": {DEVICE_PARAM}, "int8": {KIND_PARAM}, "int4": {GROUP_PARAM, KIND_PARAM}}  # what each one's header carries


class LayeredCodec:
    """Per layer, raw / int8 / int4 (`LAYERS_PARAM`: "8844rr...", a letter per layer), in one pull:
    an item goes (and is checked) under its layer's codec; the header adds the layers and the layer."""

    name = "layered"

    @staticmethod
    def check(params: CodecParams, num_layers: int | None = None) -> str:
        """The layers string; `IntegrityError` unless a letter of `LETTERS` per layer (`num_layers`)."""
        layers = params.get(LAYERS_PARAM)
        if not isinstance(layers, str) or not layers or set(layers) - set(LETTERS):
            raise IntegrityError(f"layered: param {LAYERS_PARAM!r} is a string of {sorted(LETTERS)}, one per layer")
        if num_layers is not None and len(layers) != num_layers:
            raise IntegrityError(f"layered: {len(layers)} layers' codecs for a model of {num_layers} layers")
        return layers

    def _sub(self, params: CodecParams, layer: object) -> tuple[Codec, CodecParams]:  # `layer`'s codec, its params
        layers = self.check(params)
        if not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise IntegrityError(f"layered: layer {layer!r} outside the {len(layers)} layers its codecs name")
        codec = get(LETTERS[layers[layer]])
        return codec, {k: v for k, v in params.items() if k in _ECHOED[codec.name]}

    def sends_own_bytes(self, t: torch.Tensor, params: CodecParams) -> bool:
        return sends_own_bytes(*self._sub(params, params.get(LAYER_PARAM)), t)

    def encode(self, t: torch.Tensor, params: CodecParams) -> tuple[torch.Tensor, CodecParams]:
        codec, sub = self._sub(params, params.get(LAYER_PARAM))
        payload, echo = codec.encode(t, sub)
        return payload, {LAYERS_PARAM: params[LAYERS_PARAM], LAYER_PARAM: params[LAYER_PARAM], **echo}

    def decode(self, payload: torch.Tensor, header: TensorHeader, out: torch.Tensor) -> None:
        params = header.codec_params
        if params.get(LAYER_PARAM) != header.layer:
            raise IntegrityError(f"layer {header.layer} {header.kind}: layered params for layer {params.get(LAYER_PARAM)!r}")
        codec, sub = self._sub(params, header.layer)
        if set(params) - {LAYERS_PARAM, LAYER_PARAM} - _ECHOED[codec.name]:
            raise IntegrityError(f"layer {header.layer} {header.kind}: layered params {sorted(params)} "
                                 f"for a {codec.name} item")
        codec.decode(payload, msgspec.structs.replace(header, codec=codec.name, codec_params=sub), out)

    def max_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, params: CodecParams) -> int:
        codec, sub = self._sub(params, params.get(LAYER_PARAM))
        return codec.max_nbytes(shape, dtype, sub)


def layers_param(codec_of_layer: Sequence[str]) -> CodecParams:
    """The layered codec's params for per-layer codec names (`LETTERS`' values; KeyError for another)."""
    letter = {name: ch for ch, name in LETTERS.items()}
    return {LAYERS_PARAM: "".join(letter[c] for c in codec_of_layer)}


LOWRANK = LowRankCodec()
LAYERED = LayeredCodec()

register(RawCodec())
register(Int8Codec())
register(Int4Codec())
register(LOWRANK)
register(LAYERED)
