"""Translated KV (paper 002): a target model of another size, architecture or tokenizer reads a
context that a source model prefilled.

Sequence on the target (the fit that learns the maps is offline, `fit.py`):
  1. align: every target token's characters are covered by a contiguous span of source tokens
     (`align`, by character offsets; the start tokens map to each other);
  2. pool: per target token, the mean of the source's E over its span   [T_s, Ds] -> [T_t, Ds];
  3. map: target layer l's E is an affine map of the source E entering layer `layers[l]`:
     Ê_l = pooled @ W_l + b_l                                              [T_t, Ds] -> [T_t, Dt]
     E_0 is the target's own embedding of its own tokens (exact, and free);
     the start token's E is the target's own (`start_e`: causal, it depends on nothing else);
  4. project: KV_l = the target's own layer-l K/V projections of Ê_l (RoPE at the target's
     positions), so an exact Ê gives exactly the target's own KV, and a recompute group that
     starts at l reads Ê_l as its E.
`TranslatedSource` is a `LayerSource` doing 2-4 per layer as the source's E lands (each target
layer waits only for the one source layer it maps from). A `Translator` is one file (safetensors
with its metadata) that the mesh publishes by sha256; `load` refuses a file whose hash or shapes
are not what the caller expects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from droidmesh.shared.errors import CacheLayoutError, IntegrityError, ReuseError
from droidmesh.shared.kv.blocks import KVBlock, check_values
from droidmesh.shared.kv.sources import LayerSource, Need
from droidmesh.shared.model.adapter import ModelAdapter
from droidmesh.shared.model.fingerprint import ArchFingerprint

FORMAT = "droidmesh-translator/1"
Span = tuple[int, int] | None  # a token's [start, end) characters in its text; None: a special token


class TranslatorMismatchError(ReuseError):
    """A translator that is not the one published for this pair, or not for these two models."""

    code = "translator_mismatch"


def align(source: Sequence[Span], target: Sequence[Span]) -> list[tuple[int, int]]:
    """For each target token, the source tokens [a, b) it reads: specials map to the source's
    special of the same rank; a text token to every source token overlapping its characters (a
    contiguous run, since both sides cover the text in order), else to the last source token that
    ends at or before it (a token of whitespace alone overlaps nothing)."""
    specials = [i for i, s in enumerate(source) if s is None]
    texts = [(i, s) for i, s in enumerate(source) if s is not None]
    out: list[tuple[int, int]] = []
    rank, j = 0, 0
    for span in target:
        if span is None:
            if rank >= len(specials):
                raise ReuseError("the target has a special token the source lacks")
            out.append((specials[rank], specials[rank] + 1))
            rank += 1
            continue
        start, end = span
        while j < len(texts) and texts[j][1][1] <= start:  # source tokens wholly before this one
            j += 1
        k = j
        while k < len(texts) and texts[k][1][0] < end:
            k += 1
        if k > j:
            out.append((texts[j][0], texts[k - 1][0] + 1))
        elif j > 0:
            out.append((texts[j - 1][0], texts[j - 1][0] + 1))
        else:
            raise ReuseError(f"target characters {span} precede every source token")
    return out


def pool(states: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Mean of `states` [T_s, D] over each span -> [len(spans), D] (float32)."""
    x = states.float()
    csum = torch.cat([x.new_zeros(1, x.shape[1]), x.cumsum(0)])  # [T_s + 1, D]
    a = torch.tensor([s for s, _ in spans], device=x.device)
    b = torch.tensor([e for _, e in spans], device=x.device)
    return (csum[b] - csum[a]) / (b - a).unsqueeze(1).to(x.dtype)  # [T_t, D]


@dataclasses.dataclass(frozen=True)
class Translator:
    """Per target layer l >= 1: E_l ≈ pooled source E_{layers[l]} @ W[l] + b[l]."""

    source_model: str
    target_model: str
    source_fp: ArchFingerprint
    target_fp: ArchFingerprint
    layers: tuple[int, ...]          # source layer per target layer; layers[0] is -1 (own embedding)
    w: tuple[torch.Tensor, ...]      # per target layer >= 1: [Ds, Dt] float32
    b: tuple[torch.Tensor, ...]      # per target layer >= 1: [Dt] float32
    start_e: torch.Tensor            # [Lt, Dt] float32: the target's own E of its start token
    start_id: int                    # that start token (position 0 of every context; -1: none)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # fit statistics
    # the source's tokenizer (`text.tokenizer_spec`): a target finds the source's cache of a text
    # by the source's token ids, which only the source's tokenizer gives ({}: none kept)
    source_tokenizer: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def source_layers(self) -> list[int]:
        """The source E layers a translation reads (what a sender must keep for it)."""
        return sorted(set(self.layers[1:]))

    @staticmethod
    def identity(model: ModelAdapter, start_e: torch.Tensor, start_id: int) -> Translator:
        """source = target, every layer mapped to itself by the identity: the path is exact."""
        d, n = model.config.hidden_size, model.num_layers
        return Translator(model.name, model.name, model.fingerprint, model.fingerprint, (-1, *range(1, n)),
                          tuple(torch.eye(d) for _ in range(1, n)), tuple(torch.zeros(d) for _ in range(1, n)),
                          start_e.float().cpu(), start_id,
                          {"kind": "identity"})

    def check_models(self, source_fp: ArchFingerprint, target_fp: ArchFingerprint) -> None:
        """Raise unless this translator maps `source_fp`'s states into `target_fp`'s."""
        for what, mine, theirs in (("source", self.source_fp, source_fp), ("target", self.target_fp, target_fp)):
            if mine != theirs:
                raise TranslatorMismatchError(f"translator is for another {what} model: {sorted(mine.diff(theirs))} differ")

    def save(self, path: str | Path) -> str:
        """Write the file; return its sha256 (what the mesh publishes)."""
        tensors = {f"w.{l}": w.contiguous() for l, w in enumerate(self.w, start=1)}
        tensors |= {f"b.{l}": b.contiguous() for l, b in enumerate(self.b, start=1)}
        tensors["start_e"] = self.start_e.contiguous()
        meta = {"format": FORMAT, "source_model": self.source_model, "target_model": self.target_model,
                "source_fp": self.source_fp.to_dict(), "target_fp": self.target_fp.to_dict(),
                "layers": list(self.layers), "start_id": self.start_id, "info": self.info,
                "source_tokenizer": self.source_tokenizer}
        save_file(tensors, str(path), metadata={"translator": json.dumps(meta, sort_keys=True)})
        return file_sha256(path)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path: str | Path, sha256: str | None = None) -> Translator:
    """Read a translator file (`from_bytes`), naming it in errors."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TranslatorMismatchError(f"translator {Path(path).name}: {e.strerror or e}") from e
    return from_bytes(data, sha256, Path(path).name)


def from_bytes(data: bytes, sha256: str | None = None, name: str = "translator") -> Translator:
    """A translator from its file's bytes, refused unless their sha256 is `sha256` (when given)
    and every tensor has the shape its metadata implies (`IntegrityError`)."""
    if sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != sha256:
        raise TranslatorMismatchError(f"translator {name} has sha256 {got[:16]}, expected {sha256[:16]}")
    try:
        head = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, then its JSON
        if not 0 < head <= len(data) - 8:
            raise ValueError("bad safetensors header length")
        meta = json.loads(json.loads(data[8:8 + head])["__metadata__"]["translator"])
        tensors = load_bytes(data)
        src, tgt = ArchFingerprint.from_dict(meta["source_fp"]), ArchFingerprint.from_dict(meta["target_fp"])
        layers = tuple(int(l) for l in meta["layers"])
    except (KeyError, ValueError, TypeError, SafetensorError) as e:
        raise IntegrityError(f"not a translator file: {name}: {e}") from e
    if meta.get("format") != FORMAT:
        raise IntegrityError(f"translator format {meta.get('format')!r}, expected {FORMAT!r}")
    n, ds, dt = tgt.num_layers, src.hidden_size, tgt.hidden_size
    if len(layers) != n or layers[0] != -1 or any(not 0 <= l < src.num_layers for l in layers[1:]):
        raise IntegrityError(f"translator layer map {layers} does not fit {src.num_layers} -> {n} layers")
    want = {f"w.{l}": (ds, dt) for l in range(1, n)} | {f"b.{l}": (dt,) for l in range(1, n)} | {"start_e": (n, dt)}
    got_shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if got_shapes != want or any(v.dtype != torch.float32 for v in tensors.values()):
        raise IntegrityError("translator tensors do not have the shapes and dtype its models imply")
    for key, t in tensors.items():
        check_values(f"translator {key}", t)
    return Translator(meta["source_model"], meta["target_model"], src, tgt, layers,
                      tuple(tensors[f"w.{l}"] for l in range(1, n)), tuple(tensors[f"b.{l}"] for l in range(1, n)),
                      tensors["start_e"], int(meta["start_id"]), meta.get("info", {}), meta.get("source_tokenizer", {}))


class TranslatedSource:
    """A `LayerSource` for the target over a source of the source model's E (see the module's
    sequence). Called from the engine's thread like any source; `kv` and `e` block on the inner
    source's E for the one source layer they map from."""

    def __init__(self, inner: LayerSource, translator: Translator, target: ModelAdapter,
                 token_ids: Sequence[int], spans: Sequence[tuple[int, int]], source_fp: ArchFingerprint):
        translator.check_models(source_fp, target.fingerprint)
        if len(spans) != len(token_ids):
            raise CacheLayoutError(f"{len(spans)} aligned spans for {len(token_ids)} target tokens")
        if spans and max(b for _, b in spans) > len(inner.token_ids):
            raise CacheLayoutError("aligned spans reach past the source's tokens")
        self.inner, self.tr, self.target = inner, translator, target
        self.token_ids, self.fingerprint = tuple(token_ids), target.fingerprint
        self.spans = list(spans)
        self._e: dict[int, torch.Tensor] = {}       # target layer -> Ê
        self._pooled: dict[int, torch.Tensor] = {}  # source layer -> pooled E [T_t, Ds] (several targets may read one)

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        """Ê_layer [1, T_t, Dt] in the target's dtype."""
        if layer not in self._e:
            self._e[layer] = self._translate(layer, deadline)
        return self._e[layer]

    def kv(self, layer: int, deadline: float) -> KVBlock:
        """The target's own K/V projections of Ê_layer."""
        with torch.inference_mode():
            x = self.target.attn_input(self.e(layer, deadline), layer)  # [1, T_t, Dt]
            k, v = self.target.project_kv(x, layer)  # each [1, kvh, T_t, hd]
        return KVBlock(layer, k, v)

    def has(self, need: Need) -> bool:
        """Whether `need` can be served without waiting (drivers ask before the engine reads)."""
        has: Callable[[Need], bool] | None = getattr(self.inner, "has", None)
        if need.kind == "turn" or need.layer == 0 or has is None:
            return True
        return has(dataclasses.replace(need, kind="e", layer=self.tr.layers[need.layer]))

    def watch(self, fn: Callable[[], None]) -> None:
        watch: Callable[[Callable[[], None]], None] | None = getattr(self.inner, "watch", None)
        if watch is not None:
            watch(fn)

    def _translate(self, layer: int, deadline: float) -> torch.Tensor:
        t = self.target
        with torch.inference_mode():
            if layer == 0:
                return t.embed(t.token_tensor(self.token_ids))  # [1, T_t, Dt]
            s = self.tr.layers[layer]
            if s not in self._pooled:
                src = self.inner.e(s, deadline)  # [1, T_s, Ds]
                self._pooled[s] = pool(src[0].to(self.tr.w[layer - 1].device), self.spans)  # [T_t, Ds]
            e = self._pooled[s] @ self.tr.w[layer - 1] + self.tr.b[layer - 1]  # [T_t, Dt]
            if self.token_ids and self.token_ids[0] == self.tr.start_id:
                e[0] = self.tr.start_e[layer]
            return e.to(device=t.device, dtype=t.dtype).unsqueeze(0)  # [1, T_t, Dt]
