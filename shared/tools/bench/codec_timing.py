"""The codec timings of `droidmesh bench codecs` (`codec_sweep`, in the `bench codecs` process):
encode and decode seconds and payload bytes of every item a config pulls, on a context the
sender captures in process. Blocks on the CPU, one torch thread (restored afterwards); the
configs and maps are `codec_tradeoff`'s, already registered with this process's `lowrank` codec.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from droidmesh.shared.tools.bench.codec_tradeoff import Config, wire_of

Timing = tuple[float, float, float, int]  # (encode per pull, decode, prepare once) seconds, payload bytes


def codec_seconds(sender: Any, cs: Sequence[Config], maps: dict[str, tuple[str, str]], tokens: int,
                  repeats: int = 3) -> dict[str, Timing]:
    """Per config name: (encode per pull, decode, prepare once) seconds per context of `tokens`
    tokens over every item the config pulls (`pull_items`), CPU, one torch thread, median of
    `repeats` after a warm-up, and the payload bytes those items encode to (what a pull moves).
    Lowrank items are prepared first, as a sender does when it stores a context
    (`LowRankCodec.prepare`), so the per-pull encode is what a pull then costs."""
    import torch

    from droidmesh.shared.kv.capture import capture_prefill

    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, sender.config.vocab_size, (tokens,), generator=g).tolist()
    L = sender.num_layers
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        captured = capture_prefill(sender, ids, e_layers=range(L))
        out: dict[str, Timing] = {}
        for c in cs:
            if c.family == "full prefill":
                out[c.name] = (0.0, 0.0, 0.0, 0)
                continue
            out[c.name] = _config_seconds(c, captured, L, maps, repeats)
        return out
    finally:
        torch.set_num_threads(threads)


def _config_seconds(c: Config, captured: Any, L: int, maps: dict[str, tuple[str, str]], repeats: int) -> Timing:
    from droidmesh.shared.transport import codecs as wire_codecs
    from droidmesh.shared.transport.pull import pull_items

    codec = wire_codecs.get(c.codec)
    params = dict(wire_of(c, maps.get(c.name, (None,))[0]).params)
    items = []
    for it in pull_items(c.plan, L):
        t = captured.e[it.layer] if it.kind == "E" else (
            captured.kv[it.layer].k if it.kind == "K" else captured.kv[it.layer].v)
        items.append((it, t.contiguous()))
    prepare_s, kept = 0.0, []
    if c.codec == wire_codecs.LOWRANK.name:
        m = wire_codecs.LOWRANK.maps(str(params[wire_codecs.MAPS_PARAM]))
        t0 = time.perf_counter()
        kept = [wire_codecs.LOWRANK.prepare(t, it.layer, it.kind, m) for it, t in items]
        prepare_s = time.perf_counter() - t0
    enc, dec = [], []
    nbytes = 0
    for _ in range(repeats + 1):
        e, d, nbytes = _round(codec, c, items, params)
        enc.append(e)
        dec.append(d)
    del kept  # the prepared codes live through the rounds, as a sender's stored context does
    return statistics.median(enc[1:]), statistics.median(dec[1:]), prepare_s, nbytes


def _round(codec: Any, c: Config, items: list[tuple[Any, Any]], params: dict[str, Any]) -> tuple[float, float, int]:
    """Encode then decode every item once: (encode seconds, decode seconds, payload bytes)."""
    import torch

    from droidmesh.shared.model.device import dtype_name
    from droidmesh.shared.transport import codecs as wire_codecs
    from droidmesh.shared.wire.schemas import TensorHeader

    t0 = time.perf_counter()
    encoded = [(it, t, *codec.encode(t, {**params, wire_codecs.KIND_PARAM: it.kind,
                                         wire_codecs.LAYER_PARAM: it.layer})) for it, t in items]
    t1 = time.perf_counter()
    bufs = [torch.empty_like(t) for _, t, _, _ in encoded]
    t2 = time.perf_counter()
    for (it, t, payload, hp), buf in zip(encoded, bufs, strict=True):
        header = TensorHeader(context_id="bench", layer=it.layer, kind=it.kind, shape=list(t.shape),
                              dtype=dtype_name(t.dtype), codec=c.codec, codec_params=hp,
                              nbytes=payload.numel(), checksum="")
        codec.decode(payload, header, buf)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, sum(payload.numel() * payload.element_size() for _, _, payload, _ in encoded)
