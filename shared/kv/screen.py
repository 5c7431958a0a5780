"""The receiver's statistics screen of pulled K / V / E: finite garbage of the right layout fails it.

The range check (`blocks.check_values`) rejects NaN, inf and absurd magnitudes, and a checksum
vouches only for the bytes a sender chose to send. A sender serving all zeros, sign-flipped
tensors or random values at the right scale passes both. The screen compares cheap statistics of
each pulled tensor with the receiver's own, measured once on a fixed text through its own
capturing prefill (`Screen.build`). Fine-tunes of one base keep these statistics close (an honest
sender is such a fine-tune: the fingerprints already matched), garbage does not.

Per tensor, viewed as [H, T, d] (K / V: kv heads; E: one group of `hidden` channels) over tokens
1..T-1 (token 0 left out: often an attention sink with outsized activations), C = H * d channels:
  rms        sqrt(mean of x^2)
  mean       the per-channel mean over tokens [C]; keys are rotated back before RoPE first (the
             mean of rotated keys depends on the context's length, the keys' own offset does not)
  structure  |mean| / (rms sqrt(C)): the share of the scale that is an offset common to all tokens
             (1: every token the same vector; noise with no offset: about 1/sqrt(T-1))
  cosine     cos(mean, mean_ref): where the offset points, against the receiver's own
Tests, against the same layer and kind of the reference:
  scale      per tensor: rms / rms_ref within [1/SCALE, SCALE]                    zeros fail
  structure  per tensor: structure >= STRUCTURE * structure_ref                   offset-free noise fails
  direction  per request: the mean cosine over its pulled K and E >= MIN_MEAN_COS  sign-flipped fails
The structure test applies only where STRUCTURE * structure_ref >= NOISE / sqrt(T-1) (enough tokens
that noise's own structure is below the bound). Direction is judged over the whole request, not
per layer: a fine-tune may turn one layer's offset away from the receiver's (on the ci tier an
honest E has cosine -0.66 at one layer), but not the cache as a whole; V and SCD patch inputs (X) are
left out of it (an honest demo pair's layer-11 V has cosine -0.33), as are layers whose own offset
is too weak to point anywhere (structure_ref < MIN_REF_STRUCTURE).

Not detected: anything with the right statistics (an honest tensor of another context, tokens
shuffled, honest values plus small noise, a random offset), and a sign flip confined to V, to E
or to a few layers.
Cost per tensor: two fused reductions (keys: two products with RoPE tables, in CHUNK-token float32
pieces) and one device-to-host read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch

from droidmesh.shared.errors import IntegrityError
from droidmesh.shared.kv.blocks import KVBlock
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.sources import LayerSource
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.device import same_device

Kind = Literal["K", "V", "E", "X"]

# Measured on the zoo's honest cross-fine-tune pairs (demo and ci tiers, every K/V/E of 48 test contexts each):
SCALE = 10.0  # rms ratios 0.26..3.6 (demo), 0.46..2.3 (ci); zeros: 0
STRUCTURE = 0.25  # structure ratios >= 0.66 (demo), >= 0.44 (ci); noise: <= 0.11
NOISE = 2.0  # noise's structure is 1/sqrt(T-1) within a relative ~1/sqrt(2C): twice it is far out
# A sign flip negates the mean cosine. Honest: >= 0.74 (demo), >= -0.04 (ci: qa -> summ reusing only
# the layers its full fine-tune turned; >= 0.19 otherwise). Below 0, to pass every honest cache
# measured: a flip is caught wherever the honest mean exceeds 0.2.
MIN_MEAN_COS = -0.2
MIN_REF_STRUCTURE = 0.2  # below it the receiver's own offset is too weak to have a direction
CHUNK = 2048  # tokens per float32 temporary
REFERENCE_TOKENS = 256
# Plain text of common words (ordinary for any English tokenizer; the demo zoo's byte-level one
# splits those outside its word list). Only its statistics matter, not what it says.
REFERENCE_TEXT = (
    "the old town has a small market near the bridge and many people visit it in the morning . "
    "the new station was built after the winter and is often busy in the evening . a quiet road "
    "runs under the tower to the school , and the garden beyond it was opened during the summer . "
    "visitors rarely come in autumn , but in spring the market is large and the square is full of "
    "people with bags and baskets . the bridge had been closed for a long time before the town "
    "built a new one above the river . at the school the children read short stories , write "
    "letters and learn numbers ; after school they walk home along the road past the garden . in "
    "the evening the lights of the station shine over the water and the old tower stands quiet . "
    "a few shops near the market sell bread , fruit , tea and books , and the library next to the "
    "tower has many old maps of the town , the river and the hills beyond . people say the town "
    "is small , but it has seen many visitors and many changes over the years ."
)


@dataclasses.dataclass(frozen=True)
class Stats:
    """One tensor's (or the reference's) statistics, see the module's docstring."""

    rms: float
    mean: torch.Tensor  # [C] float32, on the tensor's device (K: before RoPE)
    mean_norm: float
    tokens: int  # tokens measured (T - 1)

    @property
    def structure(self) -> float:
        if self.rms <= 0 or self.tokens == 0:
            return 0.0
        return self.mean_norm / (self.rms * math.sqrt(self.mean.numel()))


@dataclasses.dataclass(frozen=True)
class Reading:
    """One tensor against its reference: each test's value, None where the test does not apply."""

    what: str
    scale: float | None  # rms / rms_ref
    structure: float | None  # structure / structure_ref
    cosine: float | None  # cos(mean, mean_ref): None for V, X and weak reference offsets

    def failure(self) -> str | None:
        """Why the tensor fails the per-tensor tests, or None."""
        if self.scale is not None and not 1 / SCALE <= self.scale <= SCALE:
            return f"rms {self.scale:.3g}x the receiver's own, outside [{1 / SCALE:g}, {SCALE:g}]"
        if self.structure is not None and self.structure < STRUCTURE:
            return f"common offset {self.structure:.3g}x the receiver's own, below {STRUCTURE:g}"
        return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [..., d]: RoPE's pair partner, negated first


def rope_tables(inv_freq: torch.Tensor, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [tokens, d] float32 of RoPE at positions 0..tokens-1 (angles in float64)."""
    angle = torch.arange(tokens, dtype=torch.float64, device=device)[:, None] * inv_freq.double().to(device)[None]  # [T, d / 2]
    return angle.cos().float().repeat(1, 2), angle.sin().float().repeat(1, 2)  # each [T, d]


def measure(t: torch.Tensor, kind: Kind, tables: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sum of squares [], per-channel mean [C], n) of `t` (K / V [1, H, T, d], E / X [1, T, D])
    over its n = T-1 tokens after token 0, as device tensors (no host read). With `tables`
    (`rope_tables` for at least T positions), keys are rotated back first: RoPE at position p
    is a rotation R(p), so the sum of R(p)^-1 k_p is sum(k_p cos) - rotate_half(sum(k_p sin)).
    Reductions run over the whole tensor and token 0 is subtracted (position 0: R is the
    identity): a strided view of tokens 1.. makes the norm ~10x slower."""
    x = t[0] if kind in ("K", "V") else t  # [H, T, d]
    h, n, d = x.shape[0], x.shape[1] - 1, x.shape[2]
    first = x[:, 0].float()  # [H, d]
    squares = torch.linalg.vector_norm(x, dtype=torch.float32).square() - first.square().sum()
    if tables is None:
        total = x.sum(1, dtype=torch.float32)  # [H, d]
    else:
        # tables' row 0 is the first token's position: 0 (the identity), or a later window's start
        first = first * tables[0][0] - rotate_half(first * tables[1][0])
        total = torch.zeros(h, d, dtype=torch.float32, device=x.device)
        sin_total = torch.zeros_like(total)
        for a in range(0, n + 1, CHUNK):  # float32 temporaries of CHUNK tokens
            c = x[:, a:a + CHUNK]  # [H, tc, d]
            total += (c * tables[0][a:a + c.shape[1]]).sum(1)
            sin_total += (c * tables[1][a:a + c.shape[1]]).sum(1)
        total -= rotate_half(sin_total)
    return squares, (total - first).reshape(-1) / max(n, 1), n  # [H, d] -> [C]


def stats(t: torch.Tensor, kind: Kind, inv_freq: torch.Tensor | None = None) -> Stats:
    """`t` measured (`measure`); K rotated back by RoPE's `inv_freq` [d / 2] when given."""
    x = t[0] if kind in ("K", "V") else t  # [H, T, d]
    rope = kind == "K" and inv_freq is not None and 2 * inv_freq.numel() == x.shape[2]
    tables = rope_tables(inv_freq, x.shape[1], x.device) if rope and inv_freq is not None else None
    squares, mean, n = measure(t, kind, tables)
    sq, norm = torch.stack([squares, mean.norm()]).tolist()
    return Stats(rms=math.sqrt(max(sq, 0.0) / max(n * mean.numel(), 1)), mean=mean, mean_norm=norm, tokens=n)


class Screen:
    """A receiver's reference statistics per (kind, layer); `check` raises `IntegrityError` for a
    tensor that fails them."""

    def __init__(self, reference: dict[tuple[Kind, int], Stats],
                 inv_freq: torch.Tensor | Sequence[torch.Tensor] | None, model_name: str):
        """`inv_freq`: the RoPE [d / 2] every layer shares, or one per layer (Gemma 3's local and
        global layers rotate by different bases), or None (keys are measured as they are)."""
        self.reference, self.model_name = reference, model_name
        self.inv_freq: tuple[torch.Tensor, ...] | torch.Tensor | None = (
            inv_freq if inv_freq is None or isinstance(inv_freq, torch.Tensor) else tuple(inv_freq))
        # RoPE tables per distinct inv_freq, for the most positions a read needed so far (reads
        # slice them): a request's layers, and requests on one context, share them. Tokens x
        # head_dim x 8 bytes each. Reads run on the engine's (one) compute thread.
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer_inv_freq(self, layer: int) -> torch.Tensor | None:
        """The RoPE inv_freq [d / 2] of layer `layer`'s keys (None: not known)."""
        if self.inv_freq is None or isinstance(self.inv_freq, torch.Tensor):
            return self.inv_freq
        return self.inv_freq[layer] if 0 <= layer < len(self.inv_freq) else None

    @classmethod
    @torch.inference_mode()
    def build(cls, model: ModelAdapter, token_ids: Sequence[int]) -> Screen:
        """The reference: `model`'s own capturing prefill of `token_ids` (every layer's K, V, E,
        and each layer's normalized attention input X)."""
        cap = capture_prefill(model, token_ids, e_layers=range(model.num_layers))
        # per layer (Gemma 3's local and global layers rotate by different bases); one tensor per
        # RoPE kind, so `_rope` keeps one table per kind
        per_kind: dict[str | None, torch.Tensor] = {}
        inv_freq = [per_kind.setdefault(model.rope_kinds[l], model.rope_tables(l)[0]) for l in range(model.num_layers)]
        ref: dict[tuple[Kind, int], Stats] = {}
        for layer in range(model.num_layers):
            ref["K", layer] = stats(cap.kv[layer].k, "K", inv_freq[layer])
            ref["V", layer] = stats(cap.kv[layer].v, "V")
            ref["E", layer] = stats(cap.e[layer], "E")
            ref["X", layer] = stats(model.attn_input(cap.e[layer], layer), "X")
        return cls(ref, inv_freq, model.name)

    @classmethod
    def of_model(cls, model: ModelAdapter) -> Screen | None:
        """`build` on REFERENCE_TEXT in the model's own tokens (<bos> first, REFERENCE_TOKENS in
        all); None for a model without a tokenizer."""
        tok = model.tokenizer
        if tok is None:
            return None
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        ids = tok(REFERENCE_TEXT, add_special_tokens=False)["input_ids"][: REFERENCE_TOKENS - 1]
        return cls.build(model, ([bos] if bos is not None else []) + ids)

    def read(self, kind: Kind, layer: int, t: torch.Tensor) -> Reading:
        """`t` against the reference: a few fused reductions and one device-to-host read."""
        return self.read_many([(kind, layer, t)])[0]

    @torch.inference_mode()
    def read_many(self, tensors: Sequence[tuple[Kind, int, torch.Tensor]], offset: int = 0) -> list[Reading]:
        """`read` of each, with one device-to-host read for all (a layer's K and V); `offset`: the
        position of the tensors' first token (a sliding-window layer pulled from a later token)."""
        sums: list[torch.Tensor] = []
        for kind, layer, t in tensors:
            ref = self.reference.get((kind, layer))
            if ref is None or ref.rms <= 0 or t.shape[-2] <= 1:
                sums.append(torch.zeros(3, device=t.device))
                continue
            inv_freq = self.layer_inv_freq(layer) if kind == "K" else None
            rope = inv_freq is not None and 2 * inv_freq.numel() == t.shape[-1]
            tables = None
            if rope and inv_freq is not None:
                cos, sin = self._rope(inv_freq, offset + t.shape[-2], t.device)  # each [>= offset + T, d]
                tables = cos[offset:], sin[offset:]
            squares, mean, _ = measure(t, kind, tables)
            sums.append(torch.stack([squares, mean.norm(), mean @ ref.mean.to(mean.device)]))
        values = torch.stack(sums).tolist() if sums else []
        return [self._reading(kind, layer, t, *v) for (kind, layer, t), v in zip(tensors, values, strict=True)]

    def _reading(self, kind: Kind, layer: int, t: torch.Tensor, sq: float, norm: float, dot: float) -> Reading:
        what = f"{kind if kind != 'X' else 'patch input'} of layer {layer}"
        ref = self.reference.get((kind, layer))
        # No reference, no tokens after token 0, or values the range check will refuse (a NaN or
        # an inf makes the sums non-finite): not judged here.
        if ref is None or ref.rms <= 0 or t.shape[-2] <= 1 or not math.isfinite(sq + norm + dot):
            return Reading(what, None, None, None)
        n, root_c = t.shape[-2] - 1, math.sqrt(ref.mean.numel())
        rms = math.sqrt(max(sq, 0.0) / (n * ref.mean.numel()))
        # the structure test applies only where its bound is above noise's own structure (1/sqrt(n))
        told = STRUCTURE * ref.structure >= NOISE / math.sqrt(n)
        structure = (norm / (rms * root_c) if rms > 0 else 0.0) / ref.structure if told else None
        cosine = None
        if kind in ("K", "E") and ref.structure >= MIN_REF_STRUCTURE:
            cosine = dot / (norm * ref.mean_norm) if norm > 0 else 0.0
        return Reading(what, rms / ref.rms, structure, cosine)

    def _rope(self, inv_freq: torch.Tensor, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(inv_freq)  # layers of one RoPE kind share one tensor (`build`), held by self.inv_freq
        got = self._tables.get(key)
        if got is None or got[0].shape[0] < tokens or got[0].device != device:
            got = self._tables[key] = rope_tables(inv_freq, tokens, device)
        return got

    def check(self, kind: Kind, layer: int, t: torch.Tensor) -> Reading:
        """`read`, raising `IntegrityError` when the tensor fails a per-tensor test."""
        return self.check_many([(kind, layer, t)])[0]

    def check_many(self, tensors: Sequence[tuple[Kind, int, torch.Tensor]], offset: int = 0) -> list[Reading]:
        readings = self.read_many(tensors, offset)
        for reading in readings:
            why = reading.failure()
            if why is not None:
                raise IntegrityError(f"screen: {reading.what}: {why} (statistics of {self.model_name}'s own cache)")
        return readings

    def check_direction(self, cosines: Sequence[float]) -> None:
        """Raise `IntegrityError` when a request's pulled K / E offsets point, on average, away
        from the receiver's own (`cosines`: their readings' cosines)."""
        if cosines and sum(cosines) / len(cosines) < MIN_MEAN_COS:
            raise IntegrityError(f"screen: direction: the pulled K/E offsets' mean cosine to the receiver's own is "
                                 f"{sum(cosines) / len(cosines):.3g} over {len(cosines)} tensors, below "
                                 f"{MIN_MEAN_COS:g} (statistics of {self.model_name}'s own cache)")

    def structure_tokens(self) -> int:
        """Context tokens from which the structure test applies to every layer and kind (logged):
        below, noise at the right scale is not told from an offset."""
        weakest = min((r.structure for r in self.reference.values()), default=0.0)
        return math.ceil((NOISE / (STRUCTURE * weakest)) ** 2) + 1 if weakest > 0 else 2**31

    def coverage(self) -> dict[str, list[int]]:
        """Layers whose reference offset is too weak for the direction test, per kind (logged)."""
        out: dict[str, list[int]] = {}
        for (kind, layer), ref in sorted(self.reference.items()):
            if kind in ("K", "E") and ref.structure < MIN_REF_STRUCTURE:
                out.setdefault(kind, []).append(layer)
        return out


class ScreenedSource:
    """`inner`, each tensor screened as the engine reads it: the per-tensor tests, and once the
    last of `expected` ((kind, layer) of what the plan pulls: "K" for a layer's K/V, "E") has been
    read, the direction test over them. E of a `patch` layer is an SCD patch input (kind X).
    A tensor of another shape, dtype or device, or with a NaN or an inf, is passed on unjudged:
    the engine's own checks, right after the read, refuse it with their own reasons."""

    def __init__(self, inner: LayerSource, screen: Screen, receiver: ModelAdapter,
                 expected: Iterable[tuple[str, int]] = (), patch: Iterable[int] = (),
                 starts: Mapping[int, int] | None = None):
        self.inner, self.screen, self.receiver, self.patch = inner, screen, receiver, frozenset(patch)
        self.starts = dict(starts or {})  # layer -> first token pulled (earlier ones are zeros, never read)
        self.token_ids = inner.token_ids
        self.fingerprint = inner.fingerprint
        self._pending = {(k, l) for k, l in expected if k == "K" or (k == "E" and l not in self.patch)}
        self._cosines: list[float] = []

    def kv(self, layer: int, deadline: float) -> KVBlock:
        block = self.inner.kv(layer, deadline)
        shape = self.receiver.kv_shape(len(self.token_ids))
        if self._fits(block.k, shape) and self._fits(block.v, shape):
            a = self.starts.get(layer, 0)  # judged on the tokens pulled, at their own positions
            k, _ = self.screen.check_many([("K", layer, block.k[:, :, a:]), ("V", layer, block.v[:, :, a:])], a)
            self._judged("K", layer, k)
        return block

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        e = self.inner.e(layer, deadline)
        if self._fits(e, self.receiver.e_shape(len(self.token_ids))):
            self._judged("E", layer, self.screen.check("X" if layer in self.patch else "E", layer, e))
        return e

    def _fits(self, t: torch.Tensor, shape: tuple[int, ...]) -> bool:
        r = self.receiver
        return tuple(t.shape) == tuple(shape) and t.dtype == r.dtype and same_device(t.device, r.device)

    def _judged(self, kind: str, layer: int, reading: Reading) -> None:
        if (kind, layer) not in self._pending:
            return
        self._pending.discard((kind, layer))
        if reading.cosine is not None:
            self._cosines.append(reading.cosine)
        if not self._pending:
            self.screen.check_direction(self._cosines)
