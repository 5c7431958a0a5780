"""SCD (Semantic Cache Distillation): a pair's learned maps and how tensors travel as codes.

A `Maps` belongs to one sender -> receiver pair (both weights' sha256s in its metadata) and holds
one `LinearCode` per coded item, keyed by (layer, kind):
  Reuse  (layer, "K") / (layer, "V"): the sender's K or V of one head -> r codes -> an estimate of
         the *receiver's* own K or V of that head, so decoding also corrects the cross-model drift.
         Keys are mapped before RoPE: the sender un-rotates its K at positions 0..T-1, the receiver
         rotates the estimate back (`Rope`; the layer's own where its base differs, as on Gemma 3's
         global layers: `LinearCode.rope`); a rotation depends on the position, a map must not.
  Patch  (layer, "E"): the sender's E_layer -> r codes -> an estimate of the receiver's normalized
         attention input at that layer; the receiver's own projections (and RoPE) then make the
         layer's K/V (`ModelAdapter.project_kv`), with no attention or MLP run.
Items without a code travel as their raw bytes. The sequence per item:
  sender    x [T, d_in] (float32) -> codes = (x - mu_in) @ enc   [T, r], sent in the stored dtype
  receiver  y = codes @ dec + mu_out  [T, d_out] -> (K: RoPE) -> the receiver's buffer
`Moments.fit` learns one code by reduced-rank ridge regression (closed form); with rank = d_in,
no ridge and x = y (a same-model pair) it is the identity, up to float rounding.

A `Maps` is stored as one safetensors file named by its sha256 (`to_bytes` / `from_bytes`), so
senders and receivers fetching it by that name check exactly what they got.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from droidmesh.shared.errors import IntegrityError

FORMAT = "droidmesh-scd-1"


@dataclasses.dataclass(frozen=True)
class LinearCode:
    """One head group's code: `heads` independent maps d_in -> r -> d_out (E: heads = 1)."""

    mu_in: torch.Tensor  # [H, d_in] float32
    enc: torch.Tensor  # [H, d_in, r]
    dec: torch.Tensor  # [H, r, d_out]
    mu_out: torch.Tensor  # [H, d_out]
    _copies: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)
    # A K code of a layer whose keys rotate by another RoPE than the maps' own (Gemma 3's global
    # layers): that RoPE, used by `encode` / `decode` in place of the one they are handed.
    rope: Rope | None = None

    @property
    def rank(self) -> int:
        return self.enc.shape[-1]

    def to(self, device: torch.device) -> LinearCode:
        """This code on `device`: itself there, else a copy made once per device (every pull
        encodes or decodes with it, so a CUDA copy must not be made per item)."""
        if self.enc.device == device:
            return self
        key = str(device)
        if key not in self._copies:
            mu_in, enc, dec, mu_out = (t.to(device) for t in (self.mu_in, self.enc, self.dec, self.mu_out))
            self._copies[key] = LinearCode(mu_in, enc, dec, mu_out, rope=self.rope)
        return self._copies[key]


@dataclasses.dataclass(frozen=True)
class Rope:
    """The receiver's RoPE (Llama convention: rotate_half pairs dim i with dim i + head_dim / 2)."""

    inv_freq: torch.Tensor  # [head_dim / 2] float32
    scaling: float
    _tables: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def tables(self, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, head_dim / 2] float32, at positions 0..T-1 (cached per length and
        device: a sender serves the same context length again and again). Encodes run on several
        threads: a lookup, a store or an eviction another thread races loses a cache entry at
        worst, never raises."""
        key = (tokens, str(device))
        found = self._tables.get(key)
        if found is None:
            pos = torch.arange(tokens, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device)[None]  # [T, hd/2]
            found = (freqs.cos() * self.scaling, freqs.sin() * self.scaling)
            if len(self._tables) >= 8:
                with contextlib.suppress(StopIteration, RuntimeError):  # emptied, or changed meanwhile, by another thread
                    self._tables.pop(next(iter(self._tables)), None)
            self._tables[key] = found
        return found

    def rotate(self, x: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
        """x [H, T, hd] float32 at positions 0..T-1 -> RoPE(x) (sign -1: by -theta)."""
        cos, sin = self.tables(x.shape[1], x.device)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]  # [H, T, hd/2] each
        out = torch.empty_like(x)
        torch.addcmul(x1 * cos, x2, sin, value=-sign, out=out[..., :half])  # x1 cos - x2 sin
        torch.addcmul(x2 * cos, x1, sin, value=sign, out=out[..., half:])  # x2 cos + x1 sin
        return out

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `rotate` (a rotation by -theta, undoing the scaling)."""
        x = self.rotate(y, sign=-1.0)
        return x if self.scaling == 1.0 else x / (self.scaling * self.scaling)

    def same(self, other: Rope) -> bool:
        return self.scaling == other.scaling and torch.equal(self.inv_freq, other.inv_freq)


@dataclasses.dataclass(frozen=True)
class Maps:
    """A pair's codes; `sha256` names the file they were read from (or written to)."""

    codes: dict[tuple[int, str], LinearCode]  # (layer, "K" | "V" | "E")
    rope: Rope  # the receiver's keys' RoPE; a K code with its own `rope` overrides it for its layer
    meta: dict[str, str]  # sender/receiver sha256, fit settings and timings (strings, as safetensors keeps them)
    sha256: str = ""

    def code(self, layer: int, kind: str) -> LinearCode | None:
        return self.codes.get((layer, kind))

    def ranks(self) -> dict[str, int]:
        return {f"{l}.{k}": c.rank for (l, k), c in sorted(self.codes.items())}

    # -- the file --------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        tensors = {"rope.inv_freq": self.rope.inv_freq.float().contiguous()}
        for (l, k), c in self.codes.items():
            for name, t in (("mu_in", c.mu_in), ("enc", c.enc), ("dec", c.dec), ("mu_out", c.mu_out)):
                tensors[f"{l}.{k}.{name}"] = t.float().cpu().contiguous().clone()  # safetensors refuses shared memory
        meta = {**self.meta, "format": FORMAT, "rope.scaling": repr(self.rope.scaling)}
        for (l, k), c in self.codes.items():
            if k == "K" and c.rope is not None:  # a layer with its own RoPE: rope.{layer}.*
                tensors[f"rope.{l}.inv_freq"] = c.rope.inv_freq.float().contiguous().clone()  # layers share one
                meta[f"rope.{l}.scaling"] = repr(c.rope.scaling)
        return st_save(tensors, metadata=meta)

    @staticmethod
    def from_bytes(data: bytes, sha256: str) -> Maps:
        """Read a maps file; `IntegrityError` unless its sha256 is `sha256` and its tensors are consistent."""
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise IntegrityError(f"maps file hash {got[:12]}... is not the published {sha256[:12]}...")
        try:
            tensors = st_load(data)
            meta = _metadata(data)
        except Exception as e:  # a malformed file: safetensors raises its own error types
            raise IntegrityError(f"maps {sha256[:12]}...: not a safetensors file ({e})") from None
        if meta.get("format") != FORMAT or "rope.inv_freq" not in tensors:
            raise IntegrityError(f"maps {sha256[:12]}...: format {meta.get('format')!r}, expected {FORMAT!r}")
        rope = Rope(tensors.pop("rope.inv_freq"), float(meta.pop("rope.scaling", "1.0")))
        layer_ropes: dict[int, Rope] = {}
        for name in [n for n in tensors if n.startswith("rope.")]:
            layer_s = name.removeprefix("rope.").removesuffix(".inv_freq")
            if not layer_s.isdigit() or name != f"rope.{layer_s}.inv_freq":
                raise IntegrityError(f"maps {sha256[:12]}...: unexpected tensor {name!r}")
            layer_ropes[int(layer_s)] = Rope(tensors.pop(name), float(meta.pop(f"rope.{layer_s}.scaling", "1.0")))
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            where, _, part = name.rpartition(".")
            layer, _, kind = where.partition(".")
            if not layer.isdigit() or kind not in ("K", "V", "E"):
                raise IntegrityError(f"maps {sha256[:12]}...: unexpected tensor {name!r}")
            parts.setdefault((int(layer), kind), {})[part] = t
        codes = {}
        for key, p in parts.items():
            if set(p) != {"mu_in", "enc", "dec", "mu_out"}:
                raise IntegrityError(f"maps {sha256[:12]}...: malformed entry {key}")
            own = layer_ropes.pop(key[0]) if key[1] == "K" and key[0] in layer_ropes else None
            c = LinearCode(p["mu_in"], p["enc"], p["dec"], p["mu_out"], rope=own)
            _check_code(c, f"{key}")
            codes[key] = c
        if layer_ropes:
            raise IntegrityError(f"maps {sha256[:12]}...: RoPE for layers {sorted(layer_ropes)} without a K code")
        return Maps(codes=codes, rope=rope, meta=meta, sha256=sha256)


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")  # safetensors: an 8-byte header length, then a JSON header
    return dict(json.loads(data[8:8 + n]).get("__metadata__") or {})


def _check_code(c: LinearCode, what: str) -> None:
    h, d_in, r = c.enc.shape
    if c.mu_in.shape != (h, d_in) or c.dec.shape[:2] != (h, r) or c.mu_out.shape != (h, c.dec.shape[2]):
        raise IntegrityError(f"maps entry {what}: inconsistent shapes")
    if not all(torch.isfinite(t).all() for t in (c.mu_in, c.enc, c.dec, c.mu_out)):
        raise IntegrityError(f"maps entry {what}: non-finite values")


# -- encode (sender) and decode (receiver) ------------------------------------------------------
def code_shape(kind: str, shape: tuple[int, ...], code: LinearCode) -> tuple[int, ...]:
    """The codes' shape for an item of `shape`: K / V [1, H, T, hd] -> [H, T, r]; E [1, T, D] -> [T, r]."""
    return (shape[1], shape[2], code.rank) if kind != "E" else (shape[1], code.rank)


def check_fits(kind: str, shape: tuple[int, ...], code: LinearCode) -> None:
    """`IntegrityError` unless `code` maps an item of `shape` (K / V [1, H, T, hd], E [1, T, D])
    into a buffer of the same shape."""
    h, d_in, _ = code.enc.shape
    if kind == "E":
        ok = len(shape) == 3 and shape[0] == 1 and h == 1 and shape[2] == d_in
    else:
        ok = len(shape) == 4 and shape[0] == 1 and shape[1] == h and shape[3] == d_in
    if not ok or code.dec.shape[2] != d_in:
        raise IntegrityError(f"code for {kind} maps {h} x {d_in} -> {code.dec.shape[2]}, the item is {list(shape)}")


def encode(t: torch.Tensor, kind: str, code: LinearCode, rope: Rope) -> torch.Tensor:
    """Sender: K / V [1, H, T, hd] or E [1, T, D] -> codes [H, T, r] / [T, r] in t's dtype."""
    x = t[0].float() if kind != "E" else t.float()  # [H, T, hd] | [1, T, D]
    if kind == "K":
        x = (code.rope or rope).unrotate(x)
    c = code.to(t.device)
    codes = torch.matmul(x - c.mu_in[:, None], c.enc)  # [H, T, d_in] @ [H, d_in, r] -> [H, T, r]
    codes = codes if kind != "E" else codes[0]  # E: [1, T, r] -> [T, r]
    return codes.to(t.dtype).contiguous()


def decode(codes: torch.Tensor, kind: str, code: LinearCode, rope: Rope, out: torch.Tensor) -> None:
    """Receiver: codes [H, T, r] / [T, r] -> the estimate, written into `out` (its shape, dtype, device)."""
    c = code.to(out.device)
    z = codes.to(out.device).float()
    z = z if kind != "E" else z[None]  # E: [T, r] -> [1, T, r]
    y = torch.matmul(z, c.dec) + c.mu_out[:, None]  # [H, T, r] @ [H, r, d_out] -> [H, T, d_out]
    if kind == "K":
        y = (code.rope or rope).rotate(y)
    out.copy_(y.reshape(out.shape))  # [H, T, hd] -> [1, H, T, hd]; E [1, T, D] as is


# -- fit (offline, the profiler) -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fit:
    """A full-rank reduced-rank-regression solution for one head group; `truncate(r)` is its rank-r code."""

    mu_in: torch.Tensor  # [H, d_in] float64
    mu_out: torch.Tensor  # [H, d_out]
    coef: torch.Tensor  # [H, d_in, d_out] ridge solution B
    basis: torch.Tensor  # [H, d_out, d_out] right singular vectors of X B, by decreasing energy
    energy: torch.Tensor  # [H, d_out] their share of the fitted variance, decreasing

    def truncate(self, rank: int) -> LinearCode:
        v = self.basis[..., :rank]  # [H, d_out, r]
        return LinearCode(self.mu_in.float(), (self.coef @ v).float(), v.transpose(1, 2).contiguous().float(),
                          self.mu_out.float())

    def rank_for(self, share: float) -> int:
        """The smallest rank whose codes keep `share` of the fitted variance, in every head."""
        kept = torch.cumsum(self.energy, dim=-1)  # [H, d_out]
        need = (kept < share - 1e-12).sum(dim=-1) + 1  # per head
        return int(min(int(need.max()), self.energy.shape[-1]))


class Moments:
    """Running sums for one head group's regression x [H, N, d_in] -> y [H, N, d_out] (float64),
    so calibration never holds its samples: memory is O(H d^2) whatever the token count."""

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = torch.zeros(0, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double().cpu(), y.double().cpu()  # [H, N, d_in], [H, N, d_out]
        parts = (x.sum(1), y.sum(1), x.transpose(1, 2) @ x, x.transpose(1, 2) @ y)
        if self.n == 0:
            self.sx, self.sy, self.sxx, self.sxy = parts
        else:
            self.sx, self.sy, self.sxx, self.sxy = (a + b for a, b in zip((self.sx, self.sy, self.sxx, self.sxy), parts, strict=True))
        self.n += x.shape[1]

    def fit(self, ridge: float = 1e-3) -> Fit:
        """Reduced-rank ridge regression per head.

        B = (Xc'Xc + ridge * mean(diag Xc'Xc) * I)^-1 Xc'Yc; the rank-r code keeps the top r right
        singular vectors V_r of the fitted Xc B (enc = B V_r, dec = V_r'), the best rank-r
        approximation of the ridge fit. ridge = 0 with x = y at full rank gives the identity."""
        if self.n < 2:
            raise ValueError("a fit needs at least 2 samples")
        mu_in, mu_out = self.sx / self.n, self.sy / self.n  # [H, d]
        gram = self.sxx - self.n * mu_in[:, :, None] * mu_in[:, None, :]  # Xc'Xc [H, d_in, d_in]
        cross = self.sxy - self.n * mu_in[:, :, None] * mu_out[:, None, :]  # Xc'Yc [H, d_in, d_out]
        scale = torch.diagonal(gram, dim1=1, dim2=2).mean(dim=1).clamp_min(1e-12)  # [H]
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
        coef = torch.linalg.solve(gram + ridge * scale[:, None, None] * eye, cross)  # [H, d_in, d_out]
        fitted = coef.transpose(1, 2) @ gram @ coef  # (Xc B)'(Xc B) [H, d_out, d_out]
        vals, vecs = torch.linalg.eigh(fitted)  # ascending
        vals, vecs = vals.flip(-1).clamp_min(0), vecs.flip(-1)
        energy = vals / vals.sum(dim=-1, keepdim=True).clamp_min(1e-300)
        return Fit(mu_in, mu_out, coef, vecs, energy)
