"""`droidmesh bench vllm`: vLLM alone against vLLM with the DroidMesh connector, in one run.

One local mesh (nats-server under per-role users, a broker, a DroidMesh sender of the real
tier's base holding each context over the shm channel, the pair's plan on the config board), and
two offline vLLM engines in the vLLM environment, alive together, on the same checkpoint,
prompts, dtype and threads: vLLM alone, then vLLM with the connector, serving `docqa` merged into
its base (one full checkpoint: vLLM at its fastest) or, with `lora`, as a LoRA adapter of base
(vLLM's CPU LoRA kernels prefill far slower than its dense ones). Per context length, TTFT (a one-token generate, median of `repeats`):
  - vLLM alone, the whole prompt prefilled;
  - with the connector and no holder (a context nobody holds: the lookup, then vLLM's prefill);
  - partial: the pair's plan (layers [6, 9) recomputed from the sender's E, the rest pulled);
  - full reuse: every layer pulled (forced with the request's mode);
and, with both engines alive, a round of each in turn (`decode_ab`), the miss's TTFT and the
decode tokens/s alone and with the connector (`_rate`: one `new_tokens` generate's own token
times): what drifts on a shared host over minutes falls on both alike, and each round's pair
gives a paired difference (the miss's ratio and interval come from these rounds). What the
turns cannot cancel is the start order: on a 2-core host the engine started second prefilled a
miss ~9 % faster than the first with the same spec, so `connector_first` starts them the other
way round, and a run of each order brackets the miss's ratio.
Each reuse row says whether the connector's path was the one asked for. A third engine holds what
it prefills (`hold`, vLLM as a sender, E kept at the plan's layer as a sender of a pair would):
its TTFT of a fresh prompt it prefills itself, the copy out of its cache inside the step
(`saved` ms) and the holding beside it (`held` ms: E, the store, the announcement), its decode rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from droidmesh.shared.engines.vllm.client import Engine, OfflineEngine, cpu_env
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.mesh.nats_auth import Roster, receiver_user
from droidmesh.shared.model import text
from droidmesh.shared.model.names import ModelRef
from droidmesh.shared.profiling.published import recompute_config
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import NO_HEALTH_PORT, THREADS, connect_as, mesh, publish_configs, start_sender
from droidmesh.shared.tasks import intervals
from droidmesh.shared.wire import schemas

PLAN = ReusePlan.recompute(6, 9)  # base -> docqa, 3 of 30 layers: the plan the TTFT figures are measured with
HOLDER = "vllm-docqa"  # the holding engine's holder id (its roster entry)
QUESTION = "\nQuestion: What does the text above describe?\nAnswer:"
READY_S = 900.0
AB_ROUNDS = 8  # rounds of each engine in turn (miss TTFT and decode rate), the default
# vLLM's processes poll their shared-memory queues in a `sched_yield` loop for 1 s after each
# message (`shm_broadcast.SpinCondition`, busy_loop_s): an engine's turn that starts right after
# the other's shares the cores with that spin. A pause longer than it starts each turn quiet.
SETTLE_S = 1.5


def documents(tokenizer: Any, tokens: int, offset: int) -> str:
    """About `tokens` tokens of real prose (the standard library's module docs), from the
    `offset`-th module on: the same text for the same arguments."""
    import importlib

    names = ["json", "csv", "argparse", "logging", "asyncio", "pathlib", "subprocess", "threading", "socket",
             "collections", "itertools", "functools", "datetime", "decimal", "fractions", "statistics", "random",
             "sqlite3", "email", "http", "urllib", "xml", "zipfile", "tarfile", "shutil", "tempfile", "textwrap",
             "string", "re", "difflib", "unittest", "doctest", "pickle", "copy", "heapq", "bisect", "array", "struct"]
    out: list[str] = []
    i = offset
    while len(tokenizer.encode("".join(out))) < tokens:
        doc = importlib.import_module(names[i % len(names)]).__doc__ or ""
        out.append(doc)
        i += 1
    ids = tokenizer.encode("".join(out), add_special_tokens=False)[:tokens]
    return str(tokenizer.decode(ids))


def _median_ttft(engine: Engine, key: str, prompt: list[int], repeats: int, **kw: Any) -> tuple[float, list[dict]]:
    runs = [engine.ask(f"{key}-{r}", prompt, max_tokens=1, **kw) for r in range(repeats + 1)]  # the first: warm-up
    return statistics.median(r["seconds"] for r in runs[1:]), runs[1:]


def _rate(engine: Engine, key: str, prompt: list[int], new_tokens: int, **kw: Any) -> float:
    """Tokens a second after the first: from one `new_tokens` generate's own token times
    (`decode_s`, vLLM's request stats: no prefill in it), else that generate minus a one-token one
    over the same prompt (two prefills' jitter in it)."""
    many = engine.ask(f"{key}-n", prompt, max_tokens=new_tokens, **kw)
    if many.get("decode_s"):
        return (new_tokens - 1) / many["decode_s"]
    one = engine.ask(f"{key}-1", prompt, max_tokens=1, **kw)["seconds"]
    return (new_tokens - 1) / max(many["seconds"] - one, 1e-9)


def _decode_rate(engine: Engine, key: str, prompt: list[int], new_tokens: int, repeats: int,
                 **kw: Any) -> float:
    """The median over `repeats` of `_rate`, a warm-up first."""
    rates = [_rate(engine, f"{key}-{r}", prompt, new_tokens, **kw) for r in range(repeats + 1)]
    return statistics.median(rates[1:])


def decode_ab(a: Engine, b: Engine, key: str, prompt: list[int], new_tokens: int, rounds: int,
              ttft: bool = False, settle_s: float = 0.0, sleep: Callable[[float], None] = time.sleep,
              **kw: Any) -> dict[str, Any]:
    """Decode tokens/s of two live engines, a round of each in turn (the order swapped every
    round, a warm-up round first): per round and engine, `_rate` over `prompt`. `ratio`: b over
    a, the mean of b's rates over the mean of a's, with the paired bootstrap 95 % interval over
    rounds; `alone` / `connector`: each one's median. With `ttft`, each engine's turn first
    times a one-token answer to `prompt` too (a miss when nobody holds it): `ttft` holds the same
    figures for those seconds, b over a. `settle_s`: a pause before each turn, so that no turn
    starts while the engine before it still spins (`SETTLE_S`)."""
    rates: dict[str, list[float]] = {"a": [], "b": []}
    seconds: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(rounds + 1):
        for name, engine in (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a)):
            if settle_s > 0:
                sleep(settle_s)
            first = engine.ask(f"{key}-{name}-{r}-ttft", prompt, max_tokens=1, **kw)["seconds"] if ttft else 0.0
            rate = _rate(engine, f"{key}-{name}-{r}", prompt, new_tokens, **kw)
            if r:
                rates[name].append(rate)
                seconds[name].append(first)
    out = {**_ab_ratio(rates), "rounds": rounds, "rates": rates}
    if ttft:
        out["ttft"] = {**_ab_ratio(seconds), "seconds": seconds}
    return out


def _ab_ratio(values: dict[str, list[float]]) -> dict[str, float]:
    """b's mean over a's with its paired bootstrap 95 % interval over rounds; each one's median."""
    p = intervals.paired(values["a"], values["b"])
    assert p.rel is not None and p.rel_lo is not None and p.rel_hi is not None  # rates and seconds are positive
    return {"alone": statistics.median(values["a"]), "connector": statistics.median(values["b"]),
            "ratio": 1.0 + p.rel, "ratio_lo": 1.0 + p.rel_lo, "ratio_hi": 1.0 + p.rel_hi}


def merged(adapter: Path, out: Path) -> Path:
    """The adapter merged into its base, saved as a full checkpoint at `out` (what vLLM serves
    without LoRA); its weights' hash is the receiver's in the pair's config."""
    from droidmesh.shared.model.adapter import load_model

    if not (out / "config.json").is_file():
        model = load_model(adapter, device="cpu", dtype="float32")
        assert model.tokenizer is not None  # the zoo's adapters carry their base's tokenizer
        model.model.save_pretrained(out)
        model.tokenizer.save_pretrained(out)
    return out


def base_tokenizer(base: ModelRef, plan: ReusePlan) -> Any:
    """`base`'s tokenizer, once `plan` is known to fit its layers (ConfigError, one line, if not):
    checked before a merge or a mesh starts."""
    from droidmesh.shared.model.adapter import load_model

    model = load_model(base.path, device="cpu", dtype="float32")
    if plan.groups[-1][1] > model.num_layers:
        raise ConfigError(f"the plan {plan.label()} is out of range: real/{base.name} has {model.num_layers} layers")
    return model.tokenizer


def run(python: str, tier: Path, contexts: list[int], repeats: int, new_tokens: int, dtype: str, work: Path,
        say: Callable[[str], None], lora: bool = False, rounds: int = AB_ROUNDS,
        connector_first: bool = False, plan: ReusePlan = PLAN) -> dict[str, Any]:
    """vLLM alone and with the connector: TTFT (a miss, `plan`, full reuse), decode, holding."""
    base = ModelRef(tier / "base", "base")
    tok = base_tokenizer(base, plan)
    docqa = ModelRef(tier / "docqa" if lora else merged(tier / "docqa", work / "docqa-merged"), "docqa")
    held = {n: text.prompt_ids(tok, documents(tok, n, 0), QUESTION) for n in contexts}
    fresh = {n: text.prompt_ids(tok, documents(tok, n, 7), QUESTION) for n in contexts}
    env = {**THREADS, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
    served = {"model": str(base.path), "loras": {"docqa": str(docqa.path)}} if lora else {"model": str(docqa.path)}
    spec = {**served, "dtype": dtype, "max_model_len": max(contexts) + 128}
    out: dict[str, Any] = {"plan": plan.label(), "dtype": dtype, "repeats": repeats, "docqa": "lora" if lora else "merged",
                           "started_first": "connector" if connector_first else "alone", "rows": []}
    adapter = "docqa" if lora else None
    measured: dict[str, dict[int, dict[str, Any]]] = {}
    with pair_mesh(tier, base, docqa, work, dtype, [documents(tok, n, 0) for n in contexts], lora,
                   plan=plan) as connector:
        # started in this order: on this host the engine started second prefills a miss ~9 % faster
        # (two engines without the connector, `docs/performance.md`), so a run of each order is needed
        order = (("connector", connector), ("alone", None)) if connector_first else (("alone", None), ("connector", connector))
        started = {name: OfflineEngine(python, {**spec, "connector": conn}, work, env) for name, conn in order}
        engines = {"alone": started["alone"], "connector": started["connector"]}
        out |= {"engine_env": {name: cpu_env({"connector": conn}, env) for name, conn in order}, "settle_s": SETTLE_S}
        try:
            for name, engine in engines.items():
                engine.ready(READY_S)
                measured[name] = measure(engine, name, contexts, held, fresh, repeats, say, adapter)
            decode = {n: decode_ab(engines["alone"], engines["connector"], f"ab-{n}", fresh[n][0] + fresh[n][1],
                                   new_tokens, rounds, ttft=True, settle_s=SETTLE_S, lora=adapter) for n in contexts}
        finally:
            for engine in engines.values():
                engine.stop()
        holding = {**connector, "hold": True, "holder_id": HOLDER, "hold_e_layers": list(plan.e_layers)}
        engine = OfflineEngine(python, {**spec, "connector": holding}, work, env)
        try:
            engine.ready(READY_S)
            measured["holding"] = measure_hold(engine, contexts, fresh, repeats, new_tokens, say, adapter)
        finally:
            engine.stop()
    alone, mine, holds = measured["alone"], measured["connector"], measured["holding"]
    for n in contexts:
        a, c, h, d = alone[n], mine[n], holds[n], decode[n]
        m = d["ttft"]
        say(f"{n} tokens, connector / alone over {d['rounds']} rounds: decode {d['ratio']:.3f} "
            f"[{d['ratio_lo']:.3f}, {d['ratio_hi']:.3f}], miss TTFT {m['ratio']:.3f} [{m['ratio_lo']:.3f}, {m['ratio_hi']:.3f}]")
        out["rows"].append({"context_tokens": n, "alone_ttft_s": a["full"], "miss_ttft_s": c["full"],
                            # the miss from the rounds in turn (both engines alive), not the medians above
                            "miss_over_alone": m["ratio"], "miss_over_alone_interval": [m["ratio_lo"], m["ratio_hi"]],
                            "miss_ttft_rounds": {"alone": m["seconds"]["a"], "connector": m["seconds"]["b"]},
                            "partial_ttft_s": c["partial"], "alone_over_partial": a["full"] / c["partial"],
                            "full_reuse_ttft_s": c["full_reuse"],
                            "alone_over_full_reuse": a["full"] / c["full_reuse"], "paths": c["paths"],
                            "decode_tok_s_alone": d["alone"], "decode_tok_s_connector": d["connector"],
                            "decode_ratio": d["ratio"], "decode_ratio_interval": [d["ratio_lo"], d["ratio_hi"]],
                            "decode_rounds": d["rounds"], "decode_rates": {"alone": d["rates"]["a"],
                                                                           "connector": d["rates"]["b"]},
                            "hold_ttft_s": h["full"], "hold_over_alone": h["full"] / a["full"], "save_copy_ms": h["saved_ms"],
                            "hold_ms": h["held_ms"], "decode_ratio_holding": h["decode"] / d["alone"]})
    return out


def plan_config(tier: Path, base: ModelRef, docqa: ModelRef, plan: ReusePlan = PLAN) -> schemas.RecomputeConfig:
    """The real tier's base -> docqa config with `plan` as its one point (no latency fit: the
    engine is vLLM, not DroidMesh's), for these checkpoints' weights."""
    profile = json.loads((tier / "profiles" / "base-to-docqa.json").read_text())
    cfg = recompute_config(profile, base, docqa, 1)
    # The profile's quality stands in for `plan`'s: the connector reads the plan, not the figure.
    point = schemas.FrontierPoint(plan=policy.spec_of(plan), recomputed_layers=plan.groups[0][1] - plan.groups[0][0],
                                  quality=cfg.chosen.quality)
    return msgspec.structs.replace(cfg, chosen=point, frontier=[point], latency=None)


@contextlib.contextmanager
def pair_mesh(tier: Path, base: ModelRef, docqa: ModelRef, work: Path, dtype: str, contexts: list[str],
              lora: bool, store_bytes: int = 2 << 30, plan: ReusePlan = PLAN) -> Iterator[dict[str, Any]]:
    """A local mesh for base -> docqa: nats-server under per-role users, the pair's plan on the
    config board, a broker, a DroidMesh sender of base (shm, `dtype`, a store of `store_bytes`:
    what it cannot hold it evicts, oldest first) holding `contexts`; yields
    the connector's settings for an engine serving docqa (merged: its base model; `lora`: an
    adapter of base), logged in as docqa's receiver."""
    with mesh(Roster.local(senders=["base"], receivers=["docqa"], holders={"docqa": HOLDER})) as (access, procs):
        asyncio.run(publish_configs([plan_config(tier, base, docqa, plan)], access))
        procs.append(start_service("cache_broker", {}, access.url, log_dir=work,
                                   env={**THREADS, **NO_HEALTH_PORT, **access.env_for("broker")}))
        procs.append(start_sender(access, base, "base", plan.e_layers, work, {**THREADS, **NO_HEALTH_PORT},
                                  paired=["docqa"], transport="shm", heartbeat_s=30.0, dtype=dtype,
                                  store_bytes=store_bytes))
        asyncio.run(_hold(access, contexts))
        password = work / "receiver.password"
        password.write_text(access.password(receiver_user("docqa")))
        yield {"nats_url": access.url, "nats_user": receiver_user("docqa"), "nats_password_file": str(password),
               "models": {"base": str(base.path), "docqa": str(docqa.path)},
               "base_model": "base" if lora else "docqa", "transport": "shm", "reuse_timeout_s": 60.0,
               "dtype": dtype}  # the holder's, and the connector's own layers


async def _hold(access: Any, contexts: list[str]) -> None:
    (ops,) = await connect_as(access, "admin")
    try:
        for ctx in contexts:
            await ops.prefill("base", ctx, timeout=600.0)
    finally:
        await ops.close()


def measure(engine: Engine, name: str, contexts: list[int], held: dict, fresh: dict, repeats: int,
            say: Callable[[str], None], adapter: str | None) -> dict[int, dict[str, Any]]:
    """Per context length on a ready `engine`: TTFT of a fresh prompt ("full"), and, on the
    connector's engine ("connector"), of the held one with the plan ("partial") and with full
    reuse, with the connector's paths for them (the decode rates: `decode_ab`). `held` / `fresh`: length ->
    (context ids, question ids)."""
    rows: dict[int, dict[str, Any]] = {}
    for n in contexts:
        h, f = held[n][0] + held[n][1], fresh[n][0] + fresh[n][1]
        row: dict[str, Any] = {"full": _median_ttft(engine, f"{name}-{n}-full", f, repeats, lora=adapter)[0]}
        if name == "connector":
            paths = {}
            for mode, key in (("auto", "partial"), ("full_reuse", "full_reuse")):
                row[key], runs = _median_ttft(engine, f"{name}-{n}-{key}", h, repeats, lora=adapter, mode=mode)
                paths[key] = sorted({e["path"] for r in runs for e in engine.events("request", r["request_id"])}
                                    | {"fallback" for r in runs if engine.events("reuse_fallback", r["request_id"])})
            row["paths"] = paths
        say(f"{name} {n} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)))
        rows[n] = row
    return rows


def measure_hold(engine: OfflineEngine, contexts: list[int], fresh: dict, repeats: int, new_tokens: int,
                 say: Callable[[str], None], adapter: str | None) -> dict[int, dict[str, Any]]:
    """Per context length on the holding engine: TTFT of the fresh prompt prefilled by vLLM itself
    (mode full_prefill, so a repeat does not reuse what the first held), the median `saved` ms of
    those runs (the copy out of vLLM's cache, inside its step) and `held` ms (beside it), and the
    decode rate."""
    rows: dict[int, dict[str, Any]] = {}
    for n in contexts:
        f = fresh[n][0] + fresh[n][1]
        # a warm-up prompt of the same length held first: the first hold loads DroidMesh's weights
        before = len(_held_ms(engine, len(f)))
        engine.ask(f"holding-{n}-warm", f[::-1], max_tokens=1, lora=adapter, mode="full_prefill")
        engine.wait(lambda: len(_held_ms(engine, len(f))) > before, 300, "the holder's `held` line")  # noqa: B023
        ttft, runs = _median_ttft(engine, f"holding-{n}-full", f, repeats, lora=adapter, mode="full_prefill")
        saved = [e["ms"] for r in runs for e in engine.events("saved", r["request_id"])]
        engine.wait(lambda: len(_held_ms(engine, len(f))) > before + 1, 120, "the holder's `held` line")  # noqa: B023
        held = _held_ms(engine, len(f))[before + 1:]
        row = {"full": ttft, "saved_ms": statistics.median(saved) if saved else float("nan"),
               "held_ms": statistics.median(held) if held else float("nan"),
               "decode": _decode_rate(engine, f"holding-{n}-decode", f, new_tokens, repeats, lora=adapter,
                                      mode="full_prefill")}
        say(f"holding {n} tokens: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        rows[n] = row
    return rows


def _held_ms(engine: OfflineEngine, tokens: int) -> list[float]:
    """The `ms` of the holder's `held` lines for prompts of `tokens` tokens."""
    events = [json.loads(line[line.index("{"):]) for line in list(engine.lines) if '"event": "held"' in line]
    return [float(e["ms"]) for e in events if e.get("tokens") == tokens]
