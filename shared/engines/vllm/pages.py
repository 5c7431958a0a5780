"""K/V into and out of vLLM's paged cache, layer by layer.

Every attention backend the connector writes keeps a layer as [num_blocks, kv_heads, block_size,
2 * head_dim]; what the last two dimensions hold is the backend's (its layout, `layout_of`):

* `CPU_ATTN`: K in the first block_size rows of each (block, head) viewed as [blocks, heads,
  2 * block_size, head_dim], V in the rest; the order inside each half depends on the kernel's ISA
  (K transposed for "vec", both tiled for "amx"), which names the layout. K/V go in through the op
  vLLM's own attention writes with (`cpu_attn_reshape_and_cache`), never by indexing: what lands
  is exactly what vLLM would have written had it computed those tokens.
* `FLASH_ATTN`, `TRITON_ATTN`, `FLEX_ATTENTION` (the GPU backends; layout `FLASH`): each token's K
  then V along the last dimension, so the layer transposed is [blocks, block_size, heads,
  2 * head_dim] and K, V are its halves (the views those backends' own kernels read, whatever the
  physical stride order). Their write op (`reshape_and_cache_flash`) copies each token's K/V to
  its slot unchanged for an unquantized cache, the only kind the connector accepts, so the
  connector writes the same slots by indexing those views.

Any other backend (FlashInfer, MLA, ...) is refused (`UnsupportedLayout`): its requests fall back
to vLLM's own prefill and nothing is held, never a wrong cache. Reading back (`read_slots`: what
vLLM prefilled, held for the mesh) undoes the write's layout by views; the system test checks the
CPU layouts against vLLM's write op itself (every element read back is the one written, bit for bit).
"""

from __future__ import annotations

import re

import torch

LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
CPU_BACKEND = "CPU_ATTN"
FLASH = "flash"  # the layout of the backends below: per token, K then V along the last dimension
FLASH_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})


class UnsupportedLayout(ValueError):
    """A layer's cache is laid out in a way the connector does not write or read."""


def layer_index(name: str) -> int:
    """vLLM's attention layer name ("model.layers.12.self_attn.attn") -> 12."""
    m = LAYER_INDEX.search(f".{name}")
    if m is None:
        raise ValueError(f"no layer index in vLLM layer name {name!r}")
    return int(m.group(1))


def slots_of(block_ids: list[int], block_size: int, tokens: int) -> torch.Tensor:
    """The cache slot of each of the first `tokens` tokens of a request holding `block_ids`."""
    if tokens > len(block_ids) * block_size:
        raise ValueError(f"{tokens} tokens do not fit {len(block_ids)} blocks of {block_size}")
    b = torch.tensor(block_ids, dtype=torch.int64)
    return (b[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()[:tokens]  # [tokens]


def write_layer(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, layout: str) -> None:
    """Write K/V [1, kv_heads, m, head_dim] at `slots` [m] of one layer's paged `cache`, laid out as
    `layout` says; every shape and slot is checked first, so a refusal leaves the cache untouched."""
    blocks, heads, block_size, width = cache.shape
    if k.shape != v.shape or k.shape[0] != 1 or k.shape[1] != heads or 2 * k.shape[3] != width:
        raise ValueError(f"K/V {tuple(k.shape)} do not fit a cache of {heads} heads x {width // 2} dims")
    if k.shape[2] != slots.numel():
        raise ValueError(f"{k.shape[2]} tokens for {slots.numel()} slots")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= blocks * block_size):
        raise ValueError("a slot outside the cache")
    key = k[0].transpose(0, 1).to(device=cache.device, dtype=cache.dtype).contiguous()  # [1, H, m, D] -> [m, H, D]
    value = v[0].transpose(0, 1).to(device=cache.device, dtype=cache.dtype).contiguous()
    slots = _moved(slots, cache.device)
    if layout == FLASH:
        kc, vc = _flash_halves(cache)  # [blocks, block_size, H, D] each: views of `cache`
        block, offset = slots // block_size, slots % block_size  # [m] each
        kc[block, offset] = key
        vc[block, offset] = value
        return
    from vllm import _custom_ops as ops  # vLLM's own kernels: only in an engine's process

    kc, vc = cache.view(blocks, heads, 2 * block_size, width // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, layout)


def _moved(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device` without the host waiting for the device: a GPU's copy goes
    from pinned memory, queued on the current stream like the gather that reads it (torch keeps
    the pinned block until that copy is done)."""
    if device.type != "cuda" or index.is_cuda:
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def _flash_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A FLASH layer [blocks, H, block_size, 2 * D] as its K and V views, each [blocks, block_size, H, D]."""
    return cache.transpose(1, 2).split(cache.shape[3] // 2, dim=-1)


CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # vLLM's unquantized `--kv-cache-dtype` names


def cache_dtype_fits(cache_dtype: str | None, model_dtype: torch.dtype) -> bool:
    """Whether vLLM's `--kv-cache-dtype` keeps K/V in the model's own dtype, the only cache the
    connector writes and reads: "auto", or the model's dtype named (a quantized cache is not)."""
    return cache_dtype in ("auto", None) or CACHE_DTYPES.get(cache_dtype) == model_dtype


def layout_of(layer: object, cache: torch.Tensor, cache_dtype: str) -> str:
    """How `layer` lays out its `cache`: the CPU attention's ISA, or FLASH. `layer` is vLLM's
    attention layer (None where the engine did not say: a CPU cache is then the CPU backend's);
    `UnsupportedLayout` for any other backend."""
    backend = getattr(layer, "attn_backend", None)
    name = backend.get_name() if backend is not None else CPU_BACKEND if cache.device.type == "cpu" else None
    if name == CPU_BACKEND:
        return isa_of(layer, cache, cache_dtype)
    if name in FLASH_BACKENDS:
        return FLASH
    raise UnsupportedLayout(f"vLLM attention backend {name or 'unknown'} ({cache.device.type}): the DroidMesh "
                            f"connector writes {CPU_BACKEND} and {', '.join(sorted(FLASH_BACKENDS))} caches only")


def isa_of(layer: object, cache: torch.Tensor, cache_dtype: str) -> str:
    """The ISA vLLM's attention layer writes its cache with (set on the layer at load time)."""
    isa = getattr(getattr(layer, "impl", None), "isa", None) or getattr(layer, "isa", None)
    if isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2, cache_dtype)
    return str(isa)


def block_kv(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache [blocks, heads, block_size, 2 * head_dim] as K, V views, each
    [blocks, heads, block_size, head_dim] in token order, for `layout`."""
    blocks, heads, bs, width = cache.shape
    d = width // 2
    if layout == FLASH:
        kc, vc = _flash_halves(cache)  # [blocks, bs, H, D] each
        return kc.transpose(1, 2), vc.transpose(1, 2)
    halves = cache.view(blocks, heads, 2, bs * d)  # per (block, head): the K half, then the V half
    k, v = halves[:, :, 0], halves[:, :, 1]
    if layout in ("vec", "vec16"):  # K stored [head_dim, block_size] (transposed), V [block_size, head_dim]
        return k.view(blocks, heads, d, bs).transpose(2, 3), v.view(blocks, heads, bs, d)
    if layout == "amx":  # 16 x 2 tiles: K [bs/16, d/2, 16, 2], V [d/16, bs/2, 16, 2]
        key = k.view(blocks, heads, bs // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(blocks, heads, bs, d)
        value = v.view(blocks, heads, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(blocks, heads, bs, d)
        return key, value
    raise UnsupportedLayout(f"no read-back for vLLM's cache layout {layout!r}")


def read_slots(cache: torch.Tensor, slots: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V at `slots` [T] of one layer's paged `cache` (slot = block * block_size + offset, split
    by the cache's own block size, which may be a fraction of the scheduler's), each a fresh
    contiguous [1, kv_heads, T, head_dim] in the cache's dtype."""
    blocks, _, bs, _ = cache.shape
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= blocks * bs):
        raise ValueError("a slot outside the cache")
    # the indices are worked out where `slots` lie (the host, from `slots_of`), then moved: `unique`
    # on a device would wait for it once per layer
    block, offset = slots // bs, slots % bs  # [T] each
    touched, which = torch.unique(block, return_inverse=True)  # only the request's blocks are viewed
    touched, which, offset = (_moved(x, cache.device) for x in (touched, which, offset))
    k, v = block_kv(cache[touched], layout)  # [n, H, bs, D] each
    key = k[which, :, offset].permute(1, 0, 2)[None]  # [T, H, D] -> [1, H, T, D]
    value = v[which, :, offset].permute(1, 0, 2)[None]
    return key.contiguous(), value.contiguous()
