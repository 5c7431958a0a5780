"""Translated KV: a target model of another size, architecture or tokenizer reads a
context that a source model prefilled.

Sequence on the target (the fit that learns the maps is offline, `shared/profiling/translate_fit.py`):
  1. align: every target token's characters are covered by a contiguous span of source tokens
     (`align`, by character offsets; the start tokens map to each other);
  2. pool: per target token, the mean of the source's E over its span   [T_s, Ds] -> [T_t, Ds];
  3. features: the source's E entering each layer in `sources`, RMS-normalised per token with
     that source layer's own input norm (`source_norm`, kept in the file: the receiver has no
     source model), pooled; per target token its own row and the previous target token's row
     (a two-tap window: what a lookup binds is "this token after that one")
     f = [p_s(t), p_s(t-1) for s in sources]                      [T_t, 2 * |sources| * Ds]
  4. map, in attention-input space (where K and V are made from), per target layer l >= 1, through
     a shared projection P (when the fit kept one: each layer's map then reads r numbers, not F)
     z = [f, 1] @ P                                                        [T_t, F] -> [T_t, r]
     x̂_l = z @ W_l + b_l                                                   -> [T_t, Dt]
     Layer 0 reads the target's own embedding of its own tokens (exact, and free); the start
     token's input is the target's own (`start_x`: causal, it depends on nothing else);
  5. project: KV_l = the target's own layer-l K/V projections of x̂_l (RoPE at the target's
     positions), so an exact x̂ gives exactly the target's own KV.
On the zoo (family/large -> family/small, the small model's reader layer 2), held-out R² of the
reader layer's input: 0.70 from one source layer's E, 0.82 from two, 0.92 with the previous
token's row too. A translated context has no E past layer 0: a recompute group over it starts at 0.
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

from droidmesh.shared.errors import CacheLayoutError, IntegrityError, MissingLayerError, ReuseError
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
    ends at or before it (a token of whitespace alone overlaps nothing), or before any, the first."""
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
        elif texts:
            out.append((texts[0][0], texts[0][0] + 1))
        else:
            raise ReuseError("the source has no text tokens to read")
    return out


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of Llama-style models (the adapter's families), in its own order of operations:
    h [..., D] -> weight * h / sqrt(mean(h²) + eps), computed in float32."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x.to(h.dtype).float()


def pool(states: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Mean of `states` [T_s, D] over each span -> [len(spans), D] (float32). The running sum is
    float64: a difference of two long float32 sums would cancel away the few tokens in between."""
    x = states.double()
    csum = torch.cat([x.new_zeros(1, x.shape[1]), x.cumsum(0)])  # [T_s + 1, D]
    a = torch.tensor([s for s, _ in spans], device=x.device)
    b = torch.tensor([e for _, e in spans], device=x.device)
    return ((csum[b] - csum[a]) / (b - a).unsqueeze(1).to(x.dtype)).float()  # [T_t, D]


@dataclasses.dataclass(frozen=True)
class Translator:
    """Per target layer l >= 1: x_l ≈ features(pooled rms_norm(source E of `sources`)) @ W[l] + b[l]."""

    source_model: str
    target_model: str
    source_fp: ArchFingerprint
    target_fp: ArchFingerprint
    sources: tuple[int, ...]         # the source layers whose E the features read, ascending
    w: tuple[torch.Tensor, ...]      # per target layer >= 1: [F or r, Dt] float32
    b: tuple[torch.Tensor, ...]      # per target layer >= 1: [Dt] float32
    proj: torch.Tensor | None        # [F + 1, r] float32: features -> r shared scores (last row: offset), or None
    start_x: torch.Tensor            # [Lt, Dt] float32: the target's own attention input at its start token
    start_id: int                    # that start token (position 0 of every context; -1: none)
    source_norm: torch.Tensor        # [Ls, Ds] float32: each source layer's input RMSNorm weight
    source_eps: float                # and its epsilon
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # fit statistics
    # the source's tokenizer (`text.tokenizer_spec`): a target finds the source's cache of a text
    # by the source's token ids, which only the source's tokenizer gives ({}: none kept)
    source_tokenizer: dict[str, str] = dataclasses.field(default_factory=dict)
    # the weights it was fit on (sha256; "": not bound): a holder or receiver of other weights with
    # the same architecture must not use it
    source_sha256: str = ""
    target_sha256: str = ""

    @property
    def source_layers(self) -> list[int]:
        """The source E layers a translation reads (what a sender must keep for it)."""
        return list(self.sources)

    @staticmethod
    def identity(model: ModelAdapter, start_x: torch.Tensor, start_id: int) -> Translator:
        """source = target, every layer mapped to itself by the identity: the path is exact."""
        d, n = model.config.hidden_size, model.num_layers
        norms = [model.attn_norm(l) for l in range(n)]
        w = [torch.zeros(2 * n * d, d) for _ in range(1, n)]
        for l in range(1, n):
            w[l - 1][2 * l * d:(2 * l + 1) * d] = torch.eye(d)  # layer l's own row, current token
        return Translator(model.name, model.name, model.fingerprint, model.fingerprint, tuple(range(n)),
                          tuple(w), tuple(torch.zeros(d) for _ in range(1, n)), None,
                          start_x.float().cpu(), start_id, torch.stack([w.float().cpu() for w, _ in norms]),
                          norms[0][1], {"kind": "identity"})

    def to(self, device: torch.device) -> Translator:
        """This translator with its maps on `device` (once per receiver, not per request)."""
        return dataclasses.replace(self, w=tuple(w.to(device) for w in self.w), b=tuple(b.to(device) for b in self.b),
                                   proj=None if self.proj is None else self.proj.to(device),
                                   start_x=self.start_x.to(device), source_norm=self.source_norm.to(device))

    def check_models(self, source_fp: ArchFingerprint, target_fp: ArchFingerprint) -> None:
        """Raise unless this translator maps `source_fp`'s states into `target_fp`'s."""
        for what, mine, theirs in (("source", self.source_fp, source_fp), ("target", self.target_fp, target_fp)):
            if mine != theirs:
                raise TranslatorMismatchError(f"translator is for another {what} model: {sorted(mine.diff(theirs))} differ")

    def save(self, path: str | Path) -> str:
        """Write the file; return its sha256 (what the mesh publishes)."""
        tensors = {f"w.{l}": w.contiguous() for l, w in enumerate(self.w, start=1)}
        tensors |= {f"b.{l}": b.contiguous() for l, b in enumerate(self.b, start=1)}
        tensors["start_x"] = self.start_x.contiguous()
        if self.proj is not None:
            tensors["proj"] = self.proj.contiguous()
        tensors["source_norm"] = self.source_norm.contiguous()
        meta = {"format": FORMAT, "source_model": self.source_model, "target_model": self.target_model,
                "source_fp": self.source_fp.to_dict(), "target_fp": self.target_fp.to_dict(),
                "sources": list(self.sources), "start_id": self.start_id, "source_eps": self.source_eps, "info": self.info,
                "source_tokenizer": self.source_tokenizer, "source_sha256": self.source_sha256,
                "target_sha256": self.target_sha256}
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
    and every field and tensor is what its metadata implies (`IntegrityError`: nothing else
    escapes, whatever the bytes)."""
    if sha256 is not None and (got := hashlib.sha256(data).hexdigest()) != sha256:
        raise TranslatorMismatchError(f"translator {name} has sha256 {got[:16]}, expected {sha256[:16]}")
    try:
        return _parse(data)
    except IntegrityError as e:
        raise IntegrityError(f"not a translator file: {name}: {e}") from e
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, RecursionError, SafetensorError) as e:
        raise IntegrityError(f"not a translator file: {name}: {type(e).__name__}: {e}") from e


def _parse(data: bytes) -> Translator:
    head = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, then its JSON
    if not 0 < head <= len(data) - 8:
        raise IntegrityError("bad safetensors header length")
    meta = json.loads(json.loads(data[8:8 + head])["__metadata__"]["translator"])
    if meta.get("format") != FORMAT:
        raise IntegrityError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    src, tgt = ArchFingerprint.from_dict(meta["source_fp"]), ArchFingerprint.from_dict(meta["target_fp"])
    for fp in (src, tgt):
        sizes = (fp.num_layers, fp.hidden_size, fp.num_heads, fp.num_kv_heads, fp.head_dim)
        if not all(type(v) is int and 0 < v <= 1 << 20 for v in sizes):
            raise IntegrityError(f"fingerprint sizes {sizes} are not positive integers")
    sources = tuple(int(l) for l in meta["sources"])
    n, ds, dt = tgt.num_layers, src.hidden_size, tgt.hidden_size
    if not sources or list(sources) != sorted(set(sources)) or not 0 <= sources[0] <= sources[-1] < src.num_layers:
        raise IntegrityError(f"source layers {sources} are not ascending layers of a {src.num_layers}-layer source")
    tensors = load_bytes(data)
    f = 2 * len(sources) * ds
    rank = tensors["proj"].shape[-1] if "proj" in tensors else None
    if rank is not None and not 0 < rank <= f:
        raise IntegrityError(f"projection rank {rank} outside 1..{f}")
    want = ({f"w.{l}": (rank or f, dt) for l in range(1, n)} | {f"b.{l}": (dt,) for l in range(1, n)}
            | ({"proj": (f + 1, rank)} if rank else {}) | {"start_x": (n, dt), "source_norm": (src.num_layers, ds)})
    eps = meta["source_eps"]
    if type(eps) is not float or not 0 < eps < 1:
        raise IntegrityError(f"source_eps {eps!r} is not a small positive float")
    if {k: tuple(v.shape) for k, v in tensors.items()} != want or any(v.dtype != torch.float32 for v in tensors.values()):
        raise IntegrityError("tensors do not have the shapes and dtype its models imply")
    for key, t in tensors.items():
        check_values(f"translator {key}", t)
    texts = {k: meta.get(k, "") for k in ("source_model", "target_model", "source_sha256", "target_sha256")}
    tok = meta.get("source_tokenizer", {})
    if not all(isinstance(v, str) for v in texts.values()) or not isinstance(tok, dict) or not isinstance(meta.get("info", {}), dict):
        raise IntegrityError("metadata fields of the wrong type")
    return Translator(texts["source_model"], texts["target_model"], src, tgt, sources,
                      tuple(tensors[f"w.{l}"] for l in range(1, n)), tuple(tensors[f"b.{l}"] for l in range(1, n)),
                      tensors.get("proj"), tensors["start_x"], int(meta["start_id"]), tensors["source_norm"], eps, meta.get("info", {}),
                      tok, texts["source_sha256"], texts["target_sha256"])


def features(pooled: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per target token, each pooled source layer's row and the previous token's (zeros before
    the first): [T_t, Ds] per source layer -> [T_t, 2 * layers * Ds]."""
    parts = []
    for p in pooled:
        prev = torch.cat([p.new_zeros(1, p.shape[1]), p[:-1]])  # [T_t, Ds], row t = p[t - 1]
        parts += [p, prev]
    return torch.cat(parts, 1)


def pooled_inputs(e: torch.Tensor, norm: torch.Tensor, eps: float, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """A source layer's E [T_s, Ds] -> normalised with its input norm, pooled onto target tokens [T_t, Ds]."""
    return pool(rms_norm(e, norm.to(e.device), eps), spans)


class TranslatedSource:
    """A `LayerSource` for the target over a source of the source model's E (see the module's
    sequence). Called from the engine's thread like any source; the first translated layer
    blocks on the inner source's E of every layer in `sources` (the lowest layers a pull sends
    first), later ones reuse the features. The maps run where that E landed (the receiver keeps
    its translator there: `Translator.to`)."""

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
        self._features: torch.Tensor | None = None  # [T_t, F], once every source layer landed

    def e(self, layer: int, deadline: float) -> torch.Tensor:
        """E_0, the target's own embedding [1, T_t, Dt]; past layer 0 a translation has no E."""
        if layer != 0:
            raise MissingLayerError(f"a translated context has no E of layer {layer}: recompute groups start at 0")
        with torch.inference_mode():
            return self.target.embed(self.target.token_tensor(self.token_ids))  # [1, T_t, Dt]

    def kv(self, layer: int, deadline: float) -> KVBlock:
        """The target's own K/V projections of x̂_layer."""
        with torch.inference_mode():
            k, v = self.target.project_kv(self._attn_input(layer, deadline), layer)  # each [1, kvh, T_t, hd]
        return KVBlock(layer, k, v)

    def _attn_input(self, layer: int, deadline: float) -> torch.Tensor:
        """x̂_layer [1, T_t, Dt] in the target's dtype (module sequence, steps 2-4)."""
        t = self.target
        if layer == 0:
            return t.attn_input(self.e(0, deadline), 0)
        if self._features is None:
            tr = self.tr
            f = features([pooled_inputs(self.inner.e(s, deadline)[0], tr.source_norm[s], tr.source_eps, self.spans)
                          for s in tr.sources])  # [T_t, F]
            if tr.proj is not None:
                proj = tr.proj.to(f.device)
                f = f @ proj[:-1] + proj[-1]  # [T_t, r]
            self._features = f
        f = self._features
        x = f @ self.tr.w[layer - 1].to(f.device) + self.tr.b[layer - 1].to(f.device)  # [T_t, Dt]
        if self.token_ids and self.token_ids[0] == self.tr.start_id:
            x[0] = self.tr.start_x[layer].to(x.device)
        return x.to(device=t.device, dtype=t.dtype).unsqueeze(0)  # [1, T_t, Dt]

    def has(self, need: Need) -> bool:
        """Whether `need` can be served without waiting (drivers ask before the engine reads)."""
        has: Callable[[Need], bool] | None = getattr(self.inner, "has", None)
        if need.kind in ("turn", "decode") or need.layer == 0 or has is None or self._features is not None:
            return True
        return all(has(dataclasses.replace(need, kind="e", layer=s)) for s in self.tr.sources)

    def watch(self, fn: Callable[[], None]) -> None:
        watch: Callable[[Callable[[], None]], None] | None = getattr(self.inner, "watch", None)
        if watch is not None:
            watch(fn)
