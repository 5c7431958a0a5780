"""`droidmesh bench load`'s requests workload: Poisson arrivals against 1..N receiver copies,
DroidMesh's own choice of path (`auto`) against full prefill; and its concurrency workload
(continuous batching of decode against one request at a time, below).

Called by `shared/tools/cli/bench/` (the agents workload is `shared/tools/apps/agents.py`'s). Per number of
copies it starts a mesh (nats-server, broker, one sender, the receiver copies under one model id),
prefills a few contexts on the sender and warms every copy on them, then per rate and mode sends
requests at exponential gaps for `seconds` and waits for them all. Blocks for the whole sweep;
every process is stopped after each mesh. TTFT is measured at the client: the reply's own
decode time is subtracted from its end-to-end time, so it includes queueing.

The concurrency workload (`run_concurrency`) is a closed loop against one receiver per
`max_batch` value (its continuous-batching knob, 1 = one request's decode at a time): per
concurrency C, C clients each send `rounds` full-prefill requests back to back, so C requests
are in flight at all times; aggregate decode tokens/s and TTFT per (max_batch, C), then the
batched / one-at-a-time ratios per C (`concurrency_row`, `concurrency_compare`: pure, tested).
Every request is a full prefill so each computes its own prompt and no sender is needed; what
batching changes is the decode. Contexts: the demo tier's filler words (as `run_load`'s) for
the synthetic tiers, real text (the real tier's doc_qa rows, Python's stdlib docstrings, see
`shared/tasks/realtext.py`) cut to the receiver's tokens, for any other model. On the real tier,
serve real/base: real/docqa (the same SmolLM2-135M, a LoRA merged) answers a doc_qa question in
a few tokens and stops, which leaves little decode to batch.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Literal, NamedTuple

import numpy as np
from tqdm import tqdm

from droidmesh.shared import report
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user, sender_user
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import THREADS, launched_env, mesh
from droidmesh.shared.wire.schemas import Mode


async def _load_rate(access: MeshAccess, receiver: str, contexts: list[str], rate: float, seconds: float, mode: Mode,
                     slo_s: float, seed: int) -> dict[str, Any]:
    from droidmesh.shared.mesh.client import MeshClient

    client = await MeshClient.connect(access.url, **access.options("client"))
    rng = np.random.default_rng(seed)
    records: list[tuple[float, float, Any]] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        r = await client.ask(receiver, contexts[i % len(contexts)], f" who q{i}", max_new_tokens=8, mode=mode,
                             timeout=120, attempt_s=60)
        records.append((t0, time.perf_counter(), r))

    tasks, start, i = [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(rng.exponential(1.0 / rate))  # Poisson arrivals
    await asyncio.gather(*tasks)
    await client.close()
    ttft, tbt, e2e = [], [], []
    for t0, t1, r in records:
        decode_s = (r.stages_ms["done"] - r.stages_ms["first_token"]) / 1e3
        ttft.append(t1 - t0 - decode_s)  # client-side: queueing + lookup + transfer + prefill
        e2e.append(t1 - t0)
        if len(r.token_ids) > 1:
            tbt.append(decode_s / (len(r.token_ids) - 1))
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"rate": rate, "mode": mode, "requests": len(records), "seconds": seconds,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tbt_p50": pct(tbt, 50), "tbt_p99": pct(tbt, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99),
            "goodput": sum(1 for x in ttft if x <= slo_s) / seconds,
            "paths": sorted({r.path for _, _, r in records})}


def run_load(sender_path: str, receiver_path: str, group: tuple[int, int], tokens: int, rates: list[float],
             seconds: float, slo_s: float, copies: list[int], device: str = DEFAULT_DEVICE) -> list[dict[str, Any]]:
    """One row per (copies, rate, mode): TTFT / TBT / end-to-end p50 and p99, goodput (requests
    per second within `slo_s` TTFT) and the paths the replies took."""
    from droidmesh.shared.mesh.client import MeshClient
    from droidmesh.shared.tasks import vocab

    rng = np.random.default_rng(0)
    contexts = [" ".join(rng.choice(vocab.FILLER, tokens).tolist()) for _ in range(4)]
    rows = []
    for n in copies:
        with mesh(Roster.local(["load-sender"], ["load-receiver"])) as (access, procs):
            url = access.url
            procs.append(start_service("cache_broker", {}, url, env={**THREADS, **access.env_for("broker")}))
            # the receivers reuse it on a default group: a reader by setting
            procs.append(start_service("sender", {"model_path": sender_path, "model_id": "load-sender",
                                                  "sender_id": "load-sender", "readers": ["load-receiver"],
                                                  "dtype": "bfloat16", "e_layers": [group[0]]}, url,
                                       env={**launched_env(device), **access.env_for(sender_user("load-sender"))}))
            for k in range(n):
                procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "load-receiver",
                                                        "dtype": "bfloat16", "default_group": list(group)}, url,
                                           name=f"receiver{k}",
                                           env={**launched_env(device), **access.env_for(receiver_user("load-receiver"))}))

            async def prefill_all(access: MeshAccess = access) -> None:
                ops = await MeshClient.connect(access.url, **access.options("admin"))  # filling a store: an operator's
                client = await MeshClient.connect(access.url, **access.options("client"))
                try:
                    for c in contexts:
                        await ops.prefill("load-sender", c, timeout=300)
                    for c in contexts:  # once per receiver copy's endpoint warm-up and until the broker sees them
                        await client.ask("load-receiver", c, " who", max_new_tokens=1, timeout=300)
                finally:
                    await client.close()
                    await ops.close()

            asyncio.run(prefill_all())
            for rate in tqdm(rates, desc=f"load x{n}", unit="rate"):
                for mode in ("auto", "full_prefill"):
                    r = asyncio.run(_load_rate(access, "load-receiver", contexts, rate, seconds, mode, slo_s,
                                               seed=int(rate * 7)))
                    rows.append({"receivers": n, **r})
    return rows


# -- the concurrency workload -------------------------------------------------------------------
TextSource = Literal["filler", "real"]
ConcurrencyMode = Literal["full_prefill", "reuse"]
WARM_REQUESTS = 2  # per receiver, before any timed level: model load, first-call allocations


class Sample(NamedTuple):
    """One answered request, as the client saw it."""

    e2e_s: float  # request sent -> reply in
    decode_s: float  # the reply's own first token -> done
    tokens: int  # generated (fewer than asked when the model ended its answer)
    prompt_tokens: int


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def concurrency_row(max_batch: int, concurrency: int, samples: list[Sample], wall_s: float,
                    errors: int = 0) -> dict[str, Any]:
    """One level's row. Throughput is aggregate over the level's whole wall time (first request
    sent -> last reply in): decode tokens/s counts every token after each request's first (the
    first comes out of the prefill), tokens/s counts them all. TTFT as `_load_rate`'s: client
    side, end-to-end minus the reply's decode time, so it includes queueing."""
    ttft = [s.e2e_s - s.decode_s for s in samples]
    tbt = [s.decode_s / (s.tokens - 1) for s in samples if s.tokens > 1]
    decode_tokens = sum(max(s.tokens - 1, 0) for s in samples)
    all_tokens = sum(s.tokens for s in samples)
    n = len(samples)
    return {"max_batch": max_batch, "concurrency": concurrency, "requests": n, "errors": errors, "wall_s": wall_s,
            "decode_tokens_per_s": decode_tokens / wall_s if wall_s > 0 else None,
            "tokens_per_s": all_tokens / wall_s if wall_s > 0 else None,
            "tokens_mean": all_tokens / n if n else None,
            "prompt_tokens_mean": sum(s.prompt_tokens for s in samples) / n if n else None,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "e2e_p50": _pct([s.e2e_s for s in samples], 50),
            "e2e_p99": _pct([s.e2e_s for s in samples], 99), "tbt_p50": _pct(tbt, 50)}


def concurrency_compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency and batched max_batch: batched / one-at-a-time (the smallest max_batch
    measured, 1 unless left out) of decode tokens/s (`speedup_decode`, > 1 is better) and of
    TTFT p50 (`ttft_ratio`, < 1 is better); None where either side has no number."""
    if not rows:
        return []
    base_batch = min(r["max_batch"] for r in rows)
    base = {r["concurrency"]: r for r in rows if r["max_batch"] == base_batch}
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    out = []
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["max_batch"])):
        b = base.get(r["concurrency"])
        if r["max_batch"] == base_batch or b is None:
            continue
        out.append({"concurrency": r["concurrency"], "max_batch": r["max_batch"], "baseline_batch": base_batch,
                    "speedup_decode": ratio(r["decode_tokens_per_s"], b["decode_tokens_per_s"]),
                    "ttft_ratio": ratio(r["ttft_p50"], b["ttft_p50"])})
    return out


def concurrency_prompts(source: TextSource, tokens: int, n: int, tokenizer: Any = None) -> list[tuple[str, str]]:
    """`n` distinct (context, question) prompts of `tokens` context tokens: filler words (one
    demo-tokenizer token each) with a numbered question, or doc_qa test rows (their own
    questions) cut to `tokens` tokens of `tokenizer` (the receiver's); rows are drawn long, but a
    module's docs may still run out before `tokens`: those few come last and stay shorter (the
    rows' `prompt_tokens_mean` says what was sent)."""
    if source == "real":
        from droidmesh.shared.tasks.realtext import make_real_rows

        # a row's window is [budget / 2, budget] characters, ~3-4.5 a token: 5-7 a token makes most long enough
        rows = make_real_rows("doc_qa", "test", 3 * n + 10, chars=(5 * tokens, 7 * tokens))
        cut: list[tuple[str, str]] = []
        short: list[tuple[str, str]] = []
        for r in rows:
            ids = tokenizer(r["context"], add_special_tokens=False)["input_ids"]
            (cut if len(ids) >= tokens else short).append((tokenizer.decode(ids[:tokens]), r["input"]))
        out = list(dict.fromkeys(cut + short))[:n]  # two windows of one module may cut to the same prefix
        if len(out) < n:
            raise RuntimeError(f"only {len(out)} distinct doc_qa prompts of {tokens} tokens, {n} needed")
        return out
    from droidmesh.shared.tasks import vocab

    rng = np.random.default_rng(0)
    return [(" ".join(rng.choice(vocab.FILLER, tokens).tolist()), f" who q{i}") for i in range(n)]


def receiver_tokenizer(path: str) -> Any:
    """The tokenizer `path`'s checkpoint serves with (an adapter's: its base's)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from droidmesh.shared.model.adapter import lora_base

    return AutoTokenizer.from_pretrained(lora_base(Path(path)) or path, local_files_only=True)


async def _concurrency_level(access: MeshAccess, receiver: str, prompts: list[tuple[str, str]], concurrency: int,
                             rounds: int, new_tokens: int, timeout_s: float, mode: Mode
                             ) -> tuple[list[Sample], float, int, dict[str, int]]:
    """C clients in a closed loop (each sends its next request when its last is answered);
    (samples, wall seconds, failed requests, replies per path)."""
    from droidmesh.shared.mesh.client import MeshClient, MeshError

    client = await MeshClient.connect(access.url, **access.options("client"))
    samples: list[Sample] = []
    errors: list[str] = []
    paths: dict[str, int] = {}

    async def loop(c: int) -> None:
        for k in range(rounds):
            context, question = prompts[c * rounds + k]  # distinct per request of the level
            t0 = time.perf_counter()
            try:
                r = await client.ask(receiver, context, question, max_new_tokens=new_tokens, mode=mode,
                                     timeout=timeout_s)
            except (MeshError, TimeoutError) as e:  # counted, not fatal: one refusal should not lose a sweep
                errors.append(str(e))
                continue
            decode_s = (r.stages_ms["done"] - r.stages_ms["first_token"]) / 1e3
            samples.append(Sample(time.perf_counter() - t0, decode_s, len(r.token_ids), r.prompt_tokens))
            paths[r.path] = paths.get(r.path, 0) + 1

    start = time.perf_counter()
    try:
        await asyncio.gather(*(loop(c) for c in range(concurrency)))
    finally:
        wall = time.perf_counter() - start
        await client.close()
    return samples, wall, len(errors), paths


def run_concurrency(receiver_path: str, tokens: int, concurrencies: list[int], batches: list[int], rounds: int,
                    new_tokens: int, source: TextSource, device: str = DEFAULT_DEVICE, timeout_s: float = 1800.0,
                    mode: ConcurrencyMode = "full_prefill", sender_path: str | None = None,
                    dtype: str = "float32", group: tuple[int, int] = (0, 2), pool_tokens: int = 0) -> dict[str, Any]:
    """The closed-loop sweep (module docstring): {"rows": one per (max_batch, concurrency),
    "compare": `concurrency_compare`'s, "loadavg_start"/"loadavg_end": os.getloadavg() around it}.
    `mode` "full_prefill": the receiver alone computes every prompt; "reuse": a sender of
    `sender_path` (same host, shm) holds every context first and requests go in auto mode, so each
    prefill is a reuse (a full reuse where the sender has the receiver's weights) and decoding is
    most of the work, as when DroidMesh serves; a sender of other weights is reused on `group`
    (the receiver's default group, its start's E kept by the sender). `pool_tokens`: the batched
    receivers (max_batch > 1) decode in a decode pool of that many tokens per slot (0: none)."""
    n_prompts = max(concurrencies) * rounds
    tokenizer = receiver_tokenizer(receiver_path) if source == "real" else None
    prompts = concurrency_prompts(source, tokens, n_prompts + WARM_REQUESTS, tokenizer)
    warm, prompts = prompts[n_prompts:], prompts[:n_prompts]
    ask_mode: Mode = "full_prefill" if mode == "full_prefill" else "auto"
    loadavg_start = list(os.getloadavg())  # the machine's load says how far to trust a CPU run's numbers
    rows = []
    for b in batches:
        senders = ["load-sender"] if mode == "reuse" else []
        with mesh(Roster.local(senders, ["load-receiver"])) as (access, procs):
            transport = {"transport": "shm"}
            if mode == "reuse":  # full prefill looks nothing up and pulls from no one: then the receiver alone
                procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **access.env_for("broker")}))
                procs.append(start_service("sender", {"model_path": sender_path or receiver_path,
                                                      "model_id": "load-sender", "sender_id": "load-sender",
                                                      "readers": ["load-receiver"], "dtype": dtype,
                                                      "e_layers": [group[0]], **transport},
                                           access.url, env={**launched_env(device),
                                                            **access.env_for(sender_user("load-sender"))}))
            reuse = {"default_group": list(group), **transport} if mode == "reuse" else {}
            procs.append(start_service("receiver", {"model_path": receiver_path, "model_id": "load-receiver",
                                                    "dtype": dtype, "max_batch": b, "hold": False, **reuse,
                                                    "decode_pool_tokens": pool_tokens if b > 1 else 0},
                                       access.url,
                                       env={**launched_env(device), **access.env_for(receiver_user("load-receiver"))}))
            asyncio.run(_warm_up(access, mode == "reuse", warm, prompts, new_tokens, ask_mode, timeout_s))
            for c in tqdm(concurrencies, desc=f"max_batch {b}", unit="level"):
                samples, wall, errors, paths = asyncio.run(_concurrency_level(
                    access, "load-receiver", prompts, c, rounds, new_tokens, timeout_s, ask_mode))
                rows.append({**concurrency_row(b, c, samples, wall, errors), "paths": paths})
    return {"rows": rows, "compare": concurrency_compare(rows), "loadavg_start": loadavg_start,
            "loadavg_end": list(os.getloadavg()), "mode": mode, "dtype": dtype, "pool_tokens": pool_tokens}


async def _warm_up(access: MeshAccess, reuse: bool, warm: list[tuple[str, str]], prompts: list[tuple[str, str]],
                   new_tokens: int, ask_mode: Mode, timeout_s: float) -> None:
    """Before a max_batch's levels: with `reuse`, the sender holds every context first (as an
    operator); then the warm-up requests, untimed."""
    from droidmesh.shared.mesh.client import MeshClient

    client = await MeshClient.connect(access.url, **access.options("client"))
    ops = await MeshClient.connect(access.url, **access.options("admin")) if reuse else None
    try:
        if ops is not None:  # every context held before any timed request
            for context, _ in tqdm([*warm, *prompts], desc="prefilling the sender", unit="context"):
                await ops.prefill("load-sender", context, timeout=timeout_s)
        for context, question in warm:
            await client.ask("load-receiver", context, question, max_new_tokens=new_tokens,
                             mode=ask_mode, timeout=timeout_s)
    finally:
        await client.close()
        if ops is not None:
            await ops.close()


def plot_concurrency(rows: list[dict], path: str) -> None:
    plt = report.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mb in sorted({r["max_batch"] for r in rows}):
        rs = sorted((r for r in rows if r["max_batch"] == mb), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        label = "one at a time" if mb == 1 else f"batched (max_batch {mb})"
        for ax, key in ((a, "decode_tokens_per_s"), (b, "ttft_p50")):
            ys = [r[key] for r in rs]
            ax.plot(xs, ys, "o-" if mb > 1 else "s--", label=label)
            report.label_points(ax, xs, ys)
    levels = sorted({r["concurrency"] for r in rows})
    for ax, ylabel in ((a, "decode tokens/s (aggregate)"), (b, "TTFT p50 (s)")):
        ax.set_xlabel("concurrent requests")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_load(rows: list[dict], path: str, slo: float) -> None:
    plt = report.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n in sorted({r["receivers"] for r in rows}):
        for mode, style in (("auto", "o-"), ("full_prefill", "s--")):
            rs = [r for r in rows if r["receivers"] == n and r["mode"] == mode]
            label = f"{'DroidMesh' if mode == 'auto' else 'full prefill'} x{n}"
            a.plot([r["rate"] for r in rs], [r["ttft_p99"] for r in rs], style, label=label)
            b.plot([r["rate"] for r in rs], [r["goodput"] for r in rs], style, label=label)
            report.label_points(a, [r["rate"] for r in rs], [r["ttft_p99"] for r in rs])
            report.label_points(b, [r["rate"] for r in rs], [r["goodput"] for r in rs])
    a.axhline(slo, c="k", ls=":", label="SLO")
    a.set_xlabel("arrival rate (req/s)")
    a.set_ylabel("TTFT p99 (s)")
    a.set_yscale("log")
    b.set_xlabel("arrival rate (req/s)")
    b.set_ylabel("goodput (req/s within SLO)")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
