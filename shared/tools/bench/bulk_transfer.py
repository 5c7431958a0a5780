"""`droidmesh bench transfer`: pulls between two processes over each bulk channel, against a
memcpy of the same bytes; its pieces are also the GPU transfer check's (`gpu_transfer`).

Called by `shared/tools/cli/bench/data_plane.py` (`run_transfer`) and `gpu_transfer`. Blocks: a tensor
server takes up to `tensor_proc.SERVER_START_S` to listen, each size is pulled `repeats` + 1 times. It trusts
UCX's own protocol tables (UCX_PROTO_INFO=y on stdout) to say which transport carried a payload.

Sequence of a measurement:
  1. the reference first, while no other process competes for the cores: `memcpy_reference`
     (one CPU thread, warm and out of cache; the GPU check times its device copies itself);
  2. `TensorServer` (`tensor_proc`): `shared.tools.bench.tensor_server TRANSPORT SIZES --device D` in a child process,
     with `UCX_PROTO_INFO=y` for ucx (unless set), holding one bf16 tensor per size; its address
     or why it did not start, and every line it printed;
  3. `pull_rates`: per size, one warm-up pull, then the median wall time of `repeats` pulls into
     one preallocated buffer on `device` (a pull ends when its payload has landed and passed its
     checksum);
  4. `ucx_proto.ucx_tables` / `ucx_protocol_for`: which UCX transport and protocol carried a
     payload of a given size, from the tables the server (or a reading client) printed.
`run_transfer` does 1. for every size, then 2.-4. per channel, and reduces the rows to ratios.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import torch

from droidmesh.shared.service.localmesh import THREADS
from droidmesh.shared.tools.bench.tensor_proc import NIXL_RAW, TensorServer
from droidmesh.shared.tools.bench.tensor_server import GRANT_SENDER, one_line, start_server, tensors_for
from droidmesh.shared.tools.bench.ucx_proto import ucx_protocol_for, ucx_tables

KIB, MIB = 1 << 10, 1 << 20
TRANSFER_SIZES = [256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
RATIO_FROM_BYTES = 16 * MIB  # `over_memcpy` / `ucx_over_memcpy`: the smallest ratio from this size up
FIXED_BYTES = 4 * KIB  # a pull's fixed cost: one item this small
FIXED_SAMPLES, FIXED_WARMUP = 200, 20
def llc_bytes() -> int:
    """The last-level cache's size (sysfs, then sysconf; 64 MiB if neither says)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for index in sorted(os.listdir(base)):
            with open(f"{base}/{index}/size") as f:
                text = f.read().strip().upper()
            mult = {"K": KIB, "M": MIB, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    if not best:
        try:
            best = int(os.sysconf("SC_LEVEL3_CACHE_SIZE"))
        except (OSError, ValueError):
            best = 0
    return best if best > 0 else 64 * MIB


def memcpy_reference(nbytes: int, repeats: int, llc: int | None = None) -> dict[str, Any]:
    """A copy of `nbytes` with `torch.Tensor.copy_` into a preallocated destination, on one
    thread (a bulk channel moves a payload on one thread too), median of `repeats` samples.

    warm: one source/destination pair, both written before timing and copied once untimed, then
    copied over and over (each sample times a batch of copies of at least 16 MiB in all, so
    small sizes are not timer noise); they stay cached when they fit.
    cold: a set of pairs whose footprint between two uses of a pair, (pairs - 1) x 2 x nbytes,
    is at least twice the last-level cache; all written beforehand, then copied in turn,
    cycling, so each copy reads a source (and writes a destination) evicted since its last use.
    """
    llc = llc or llc_bytes()
    pairs = max(2, -(-2 * llc // nbytes) + 1)
    batch = max(1, 16 * MIB // nbytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bufs = [(torch.empty(nbytes, dtype=torch.uint8).fill_(i % 251), torch.empty(nbytes, dtype=torch.uint8).fill_(0))
                for i in range(pairs)]
        src, dst = bufs[0]
        dst.copy_(src)
        warm = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(batch):
                dst.copy_(src)
            warm.append((time.perf_counter() - t0) / batch)
        cold_batch, i = min(batch, pairs - 1), 1
        for _ in range(pairs):  # one untimed pass: every pair faulted in and written
            s, d = bufs[i % pairs]
            d.copy_(s)
            i += 1
        cold = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(cold_batch):
                s, d = bufs[i % pairs]
                d.copy_(s)
                i += 1
            cold.append((time.perf_counter() - t0) / cold_batch)
    finally:
        torch.set_num_threads(threads)
    return {"bytes": nbytes, "memcpy_gb_s": nbytes / statistics.median(warm) / 1e9,
            "memcpy_cold_gb_s": nbytes / statistics.median(cold) / 1e9, "cold_pairs": pairs, "threads": 1}


class _Granting(NamedTuple):
    sender_id: str
    context_id: str


GrantFn = Callable[[str], Awaitable[str]]  # context id -> a single-use grant for one pull of it


async def pull_rates(transport: str, address: str, sizes: list[int], repeats: int,
                     device: str | torch.device = "cpu", lanes: int | None = None, items: int = 1,
                     grant: GrantFn | None = None) -> dict[int, float]:
    """Pull throughput (GB/s) per size: one warm-up pull, then the median of `repeats` pulls of
    all `items` items of that size's context in one request, each into the same preallocated,
    already written bf16 buffers on `device`; `lanes`: the shm client's copy threads (None: the
    receiver's); `grant`: each pull's grant, asked for before its clock starts."""
    from droidmesh.shared.wire.schemas import PullItem, PullRequest

    client = _client(transport, lanes)
    rates = {}
    try:
        await client.warm(address)
        for nbytes in sizes:
            into = [torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device) for _ in range(items)]  # pages exist
            if into[0].is_cuda:  # the fill ran on this thread's stream; a channel's copy stream does not wait for it
                torch.cuda.synchronize(into[0].device)
            times = []
            for _ in range(repeats + 1):
                token = await grant(str(nbytes)) if grant is not None else ""
                req = PullRequest(context_id=str(nbytes), items=[PullItem(i, "K") for i in range(items)], token=token)
                t0 = time.perf_counter()
                await client.pull(address, req, into, lambda *a: None, 120)
                times.append(time.perf_counter() - t0)
            rates[nbytes] = nbytes * items / statistics.median(times[1:]) / 1e9
    finally:
        await client.close()
    return rates


def _client(transport: str, lanes: int | None) -> Any:
    from droidmesh.shared.transport.bulk import make_client
    from droidmesh.shared.transport.shm import ShmBulkClient

    return ShmBulkClient(lanes) if transport == "shm" and lanes else make_client(transport)


async def fixed_cost(transport: str, address: str, grant: GrantFn | None, samples: int = FIXED_SAMPLES,
                     lanes: int | None = None) -> dict[str, Any]:
    """A pull's fixed cost: one item of `FIXED_BYTES` (its own context), `samples` times after
    `FIXED_WARMUP` untimed ones; medians in microseconds of the grant round trip (NATS request
    to the server and back: None without `grant`), of the pull alone, and of both in turn."""
    from droidmesh.shared.wire.schemas import PullItem, PullRequest

    client = _client(transport, lanes)
    into = [torch.zeros(FIXED_BYTES // 2, dtype=torch.bfloat16)]
    grants, pulls, both = [], [], []
    try:
        await client.warm(address)
        for i in range(FIXED_WARMUP + samples):
            t0 = time.perf_counter()
            token = await grant(str(FIXED_BYTES)) if grant is not None else ""
            t1 = time.perf_counter()
            await client.pull(address, PullRequest(context_id=str(FIXED_BYTES), items=[PullItem(0, "K")], token=token),
                              into, lambda *a: None, 30)
            t2 = time.perf_counter()
            if i >= FIXED_WARMUP:
                grants.append(t1 - t0)
                pulls.append(t2 - t1)
                both.append(t2 - t0)
    finally:
        await client.close()
    us = 1e6
    return {"grant_us": statistics.median(grants) * us if grant is not None else None,
            "pull_us": statistics.median(pulls) * us,
            "with_grant_us": statistics.median(both) * us if grant is not None else None,
            "samples": samples, "bytes": FIXED_BYTES}


async def _measure_client(transport: str, address: str, sizes: list[int], repeats: int, lanes: int, items: int,
                          nats_url: str) -> tuple[dict[int, float], dict[str, Any]]:
    """Rates per size, then the fixed cost, both as a receiver pulls (grants over NATS when
    `nats_url`)."""
    nc, grant = None, None
    if nats_url:
        import nats

        from droidmesh.shared.transport.pull import request_grant, requester

        nc = await nats.connect(nats_url)
        ask = requester(nc)

        async def grant(context_id: str) -> str:
            return await request_grant(ask, _Granting(GRANT_SENDER, context_id), 10)
    try:
        rates = await pull_rates(transport, address, sizes, repeats, lanes=lanes, items=items, grant=grant)
        return rates, await fixed_cost(transport, address, grant, lanes=lanes)
    finally:
        if nc is not None:
            await nc.close()


# -- the suite ----------------------------------------------------------------------------------
def bench_transports() -> list[str]:
    """`bench transfer`'s default: every bulk channel that runs between processes (all of
    `bulk.TRANSPORTS` but inproc), so a channel added there is measured without a change here,
    and `nixl_raw` right after `nixl`."""
    from droidmesh.shared.transport.bulk import TRANSPORTS

    channels = [t for t in TRANSPORTS if t != "inproc"]
    return [x for t in channels for x in ([t, NIXL_RAW] if t == "nixl" else [t])]  # NIXL itself beside its channel


async def _pull_inproc(sizes: list[int], repeats: int, items: int) -> tuple[dict[int, float], dict[str, Any]]:
    """The in-process channel (no second process: the protocol's own cost, checksums included)."""
    server = start_server("inproc", tensors_for(sorted({*sizes, FIXED_BYTES}), items=items), name="bench-transfer")
    address = await server.start()
    try:
        return (await pull_rates("inproc", address, sizes, repeats, items=items),
                await fixed_cost("inproc", address, None))
    finally:
        await server.close()


Measured = tuple[dict[int, float], dict[int, str | None], dict[str, Any] | None, str | None]


def _measure(transport: str, sizes: list[int], repeats: int, shm_lanes: int, items: int, nats_url: str) -> Measured:
    """(GB/s per size, how each size travelled (UCX's transport and protocol; the shm copy; None
    where the channel does not say), the pull's fixed cost, None) or ({}, {}, None, reason)."""
    if transport == "inproc":
        try:
            inproc_rates, inproc_fixed = asyncio.run(_pull_inproc(sizes, repeats, items))
            return inproc_rates, dict.fromkeys(sizes), inproc_fixed, None
        except Exception as e:
            return {}, {}, None, one_line(e)
    server = TensorServer(transport, sorted({*sizes, FIXED_BYTES}), env=THREADS, items=items, nats_url=nats_url)
    rates: dict[int, float] = {}
    fixed: dict[str, Any] | None = None
    reason = None
    try:
        server.wait_ready()
        if server.address is None:
            reason = server.error or "tensor server gave no address"
        elif transport == NIXL_RAW:
            from droidmesh.shared.tools.bench.nixl_raw import raw_rates

            rates = raw_rates(server.address, sizes, items, repeats)
            one = raw_rates(server.address, [FIXED_BYTES], items, FIXED_SAMPLES, read=1)[FIXED_BYTES]
            fixed = {"grant_us": None, "pull_us": FIXED_BYTES / one / 1e3, "with_grant_us": None,
                     "samples": FIXED_SAMPLES, "bytes": FIXED_BYTES}
        else:
            rates, fixed = asyncio.run(_measure_client(transport, server.address, sizes, repeats, shm_lanes, items,
                                                       nats_url))
    except Exception as e:
        reason = one_line(e)
    finally:
        lines = server.stop()
    if reason is not None:
        return {}, {}, None, reason
    if transport == "shm":
        return rates, dict.fromkeys(sizes, f"memfd: mapped once, copied on {shm_lanes} lane(s)"), fixed, None
    if transport != "ucx":
        return rates, dict.fromkeys(sizes), fixed, None
    protocols = ucx_tables(lines).get("host memory", [])
    return rates, {n: ucx_protocol_for(n, protocols) or "unknown" for n in sizes}, fixed, None


def run_transfer(sizes: list[int], repeats: int, transports: list[str] | None = None, shm_lanes: int = 2,
                 items: int = 1, grants: bool = True, llc: int | None = None) -> dict[str, Any]:
    """Pulls over each bulk channel between two processes (a tensor server and this one) against
    a memcpy of the same bytes (warm and out of cache): per size, one pull of `items` items of
    that many bytes each (as a context's layers travel). With `grants`, a real nats-server runs
    and every pull needs a single-use grant from the server, asked for over it as a receiver does
    (outside the throughput clock; inside the fixed cost's `with_grant_us`).

    Returns `rows` (one per transport and size; a transport that cannot start is one row with
    `unavailable` and the reason), `over_memcpy` (per transport, the smallest ratio from 16 MiB
    pulled up), `ucx_over_memcpy`, `fixed_cost` (per transport: one 4 KiB item, medians in µs),
    `nixl_over_raw` (per size, the nixl channel's throughput over `nixl_raw`'s, when both ran)
    and `memcpy` (how the reference was taken). `llc`: the last-level cache's size the cold
    reference must overflow (default: this machine's; its buffers are ~4x it)."""
    transports = transports or bench_transports()
    llc = llc or llc_bytes()
    refs = {}
    for n in sizes:  # before any server runs, so no other process competes for the cores
        refs[n] = memcpy_reference(n * items, repeats, llc)
        gc.collect()
    nats, nats_url = None, ""
    if grants and any(t not in ("inproc", NIXL_RAW) for t in transports):
        from droidmesh.shared.service.launch import start_nats

        nats, nats_url = start_nats()
    rows: list[dict[str, Any]] = []
    fixed: dict[str, Any] = {}
    try:
        for transport in transports:
            measured = _measure(transport, sizes, repeats, shm_lanes, items, nats_url)
            if measured[3] is None:
                fixed[transport] = measured[2]
            rows += _rows(transport, measured, sizes, items, refs)
    finally:
        if nats is not None:
            nats.stop()
    over, vs_raw = _ratios(rows, transports, sizes)
    from droidmesh.shared.transport.memfd import shmem_thp
    from droidmesh.shared.transport.ucx import ucx_options

    return {"rows": rows, "items": items, "ucx_over_memcpy": over.get("ucx"), "over_memcpy": over, "fixed_cost": fixed,
            "nixl_over_raw": vs_raw, "grants": nats is not None, "shm_lanes": shm_lanes, "shmem_thp": shmem_thp(),
            "memcpy": {"method": "torch.Tensor.copy_ of the pull's bytes (items x size) into a preallocated "
                                 "destination, 1 thread, median of repeats",
                       "llc_bytes": llc, "cold_pairs": {str(n): refs[n]["cold_pairs"] for n in sizes}},
            "ucx_options": {**{f"UCX_{k}": v for k, v in ucx_options().items()},
                            **{k: v for k, v in os.environ.items() if k.startswith("UCX_")}}}


def _rows(transport: str, measured: Measured, sizes: list[int], items: int,
          refs: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """A transport's rows: one per size against its memcpy reference, or one `unavailable` row."""
    rates, chosen, _, reason = measured
    if reason is not None:
        return [{"bytes": None, "items": items, "item_bytes": None, "transport": transport, "throughput_gb_s": None,
                 "memcpy_gb_s": None, "memcpy_cold_gb_s": None, "ratio": None, "ucx_transports": None,
                 "unavailable": reason}]
    return [{"bytes": n * items, "items": items, "item_bytes": n, "transport": transport,
             "throughput_gb_s": rates[n], "memcpy_gb_s": refs[n]["memcpy_gb_s"],
             "memcpy_cold_gb_s": refs[n]["memcpy_cold_gb_s"], "ratio": rates[n] / refs[n]["memcpy_gb_s"],
             "ucx_transports": chosen.get(n)} for n in sizes]


def _ratios(rows: list[dict[str, Any]], transports: list[str], sizes: list[int]
            ) -> tuple[dict[str, float | None], dict[str, float]]:
    """(per transport the smallest ratio to memcpy from `RATIO_FROM_BYTES` up, per size nixl's
    throughput over `nixl_raw`'s where both ran)."""
    over: dict[str, float | None] = {}
    for transport in transports:
        ratios = [r["ratio"] for r in rows if r["transport"] == transport and r["ratio"] is not None
                  and r["bytes"] >= RATIO_FROM_BYTES]
        over[transport] = min(ratios) if ratios else None
    rate = {(r["transport"], r["item_bytes"]): r["throughput_gb_s"] for r in rows if r["ratio"] is not None}
    vs_raw = {str(n): rate[("nixl", n)] / rate[(NIXL_RAW, n)] for n in sizes
              if ("nixl", n) in rate and (NIXL_RAW, n) in rate}
    return over, vs_raw
