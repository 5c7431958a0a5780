"""`droidmesh bench held`: reuse without ceremony, measured. No sender and no `prefill` command:
one receiver serves a base and its adapters from one copy of the weights and holds what its own
prefills computed, and the second request over a document reuses it.

By default on the real tier (SmolLM2-135M-Instruct `base` and its LoRAs `docqa`, `summ`, `code`,
the pair's saved profile published), a mesh started here: nats-server (a user per role), a
broker, ONE receiver process serving all four (`adapters`, `hold`, a holder id in the roster),
nothing else.
Each document (a test-split `doc_qa` row, real Python documentation, none seen by a profile or a
fine-tune) is asked twice, with two different questions:
  - `same_model`: both of one model: the first a full prefill (then held), the second full reuse
    of its own KV, in process;
  - `paired_adapter`: the first of adapter `summ`, the second of adapter `docqa`, whose pair config
    (summ -> docqa) plans a recompute group (a pair without a saved profile: the receiver's
    default group): the second reads summ's held KV in process.
TTFT is the receiver's (from taking the request up to its first token). The second request's
TTFT is also compared with the same plan over the same KV already in this process (the engine on
the same views, after the mesh stopped, nothing else running): `vs_local` (target: within 10 %).
With `--model`, one more mesh serves that model alone (Gemma 3 270M, the largest model here) for
`same_model` rows.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.kv import policy
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.mesh.nats_auth import MeshAccess, Roster, receiver_user
from droidmesh.shared.model import text
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling.published import recompute_config
from droidmesh.shared.service.launch import start_service
from droidmesh.shared.service.localmesh import THREADS, connect_as, mesh, publish_configs
from droidmesh.shared.wire import schemas

COLUMNS = ["model", "kind", "first", "second", "tokens", "first_ttft_ms", "second_ttft_ms", "speedup", "second_path",
           "second_plan", "local_ttft_ms", "vs_local"]
HOLDER = "bench-holder"
SPEEDUP_TARGET, LOCAL_TARGET = 3.0, 0.10
QUESTIONS = (" In one sentence, what does this document describe?", " Name one function or option it documents.")


def documents(n: int, chars: tuple[int, int]) -> list[str]:
    """`n` distinct test-split doc_qa contexts of about `chars` characters (~2K SmolLM2 tokens at 8K)."""
    from droidmesh.shared.tasks.realtext import make_real_rows

    for extra in (2, 4, 8):  # rows may share a context (another question about it): keep distinct ones
        rows = make_real_rows("doc_qa", "test", extra * n, chars=chars, seed=7)
        # distinct openings too: two windows of one source can start alike (a prefix another document reuses)
        by_opening = {r["context"][:200]: r["context"] for r in rows if len(r["context"]) >= 0.9 * chars[0]}
        docs = list(by_opening.values())  # the budget is a cap: shorter windows are left out
        if len(docs) >= n:
            return docs[:n]
    raise RuntimeError(f"fewer than {n} distinct test-split documents of {chars[0]}-{chars[1]} characters")


async def _ask(access: MeshAccess, asks: list[tuple[str, str, str]]) -> list[schemas.GenerateReply]:
    """Each (model, context, question) in order, one at a time (the second must find the first held)."""
    (client,) = await connect_as(access, "client")
    replies = []
    try:
        for model, ctx, q in asks:
            replies.append(await client.ask(model, ctx, q, max_new_tokens=1, timeout=600))
            await asyncio.sleep(0.5)  # the hold runs after the answer; the broker indexes its event
    finally:
        await client.close()
    return replies


def _serve(access: MeshAccess, procs: list, base: ModelRef, adapters: dict[str, ModelRef], log_dir: Path, dtype: str,
           default_group: tuple[int, int] | None = None) -> None:
    """A broker and one receiver of `base` (and `adapters`), holding under `HOLDER`."""
    procs.append(start_service("cache_broker", {}, access.url, env={**THREADS, **access.env_for("broker")}, log_dir=log_dir))
    args: dict[str, Any] = {"model_path": base.path, "model_id": base.name, "holder_id": HOLDER, "transport": "shm",
                            "dtype": dtype}
    if adapters:
        args["adapters"] = [f"{n}={m.path}" for n, m in adapters.items()]
    if default_group is not None:
        args["default_group"] = list(default_group)
    procs.append(start_service("receiver", args, access.url, name=f"receiver-{base.name}",
                               env={**THREADS, **access.env_for(receiver_user(base.name))}, log_dir=log_dir, timeout=600))


def run_adapters(base: ModelRef, adapters: list[ModelRef], pairs: list[Pair], n_docs: int, log_dir: Path, *,
                 chars: tuple[int, int], group: tuple[int, int] | None = None, dtype: str = "float32"
                 ) -> dict[str, Any]:
    """One receiver serving `base` and `adapters`: `same_model` rows on the base, then per pair
    `paired_adapter` rows from its sender to its receiver (its saved profile's plan when the tier
    has a servable one, else the receiver's default `group`), each pair on documents of its own;
    then the local reference of each paired row."""
    models = {base.name: base, **{m.name: m for m in adapters}}
    plans, configs = {}, []
    for pair in pairs:
        if pair.sender not in models or pair.receiver not in models:
            raise ValueError(f"pair {pair.id}: both models must be served ({', '.join(models)})")
        config = _config(base, models, pair)
        if config is not None:
            configs.append(config)
            plans[pair.id] = policy.plan_of(config.chosen.plan)
        elif group is not None:
            plans[pair.id] = ReusePlan.recompute(*group)
        else:
            raise ValueError(f"pair {pair.id} has no servable saved profile: give a default group")
    docs = documents((1 + len(pairs)) * n_docs, chars)
    asks = [(base.name, d, q) for d in docs[:n_docs] for q in QUESTIONS]
    for i, pair in enumerate(pairs, start=1):
        asks += [(m, d, q) for d in docs[i * n_docs:(i + 1) * n_docs]
                 for m, q in zip((pair.sender, pair.receiver), QUESTIONS, strict=True)]
    roster = Roster.local((), [base.name], hosted={base.name: [m.name for m in adapters]}, holders={base.name: HOLDER})
    log_dir.mkdir(parents=True, exist_ok=True)
    with mesh(roster) as (access, procs):
        asyncio.run(publish_configs(configs, access))
        _serve(access, procs, base, {m.name: m for m in adapters}, log_dir, dtype,
               default_group=group if len(configs) < len(pairs) else None)
        replies = asyncio.run(_ask(access, asks))
    rows = _rows(asks, replies)
    _local(rows, base, adapters, plans, dtype)
    return {"rows": rows, "plans": {k: p.label() for k, p in plans.items()}, "summary": _summary(rows),
            "holding": holding_cost(log_dir / f"receiver-{base.name}.log", rows)}


def _config(base: ModelRef, models: dict[str, ModelRef], pair: Pair) -> schemas.RecomputeConfig | None:
    """The pair's config from its tier's servable saved profile (None: no tier, or none servable)."""
    from droidmesh.shared.zoo.manifest import servable_profiles, zoo_dir

    profile = servable_profiles(zoo_dir(base.tier), [pair]).get(pair.id) if base.tier else None
    return recompute_config(profile, models[pair.sender], models[pair.receiver], 1) if profile is not None else None


def run_single(model: ModelRef, n_docs: int, log_dir: Path, *, chars: tuple[int, int], dtype: str = "float32"
               ) -> dict[str, Any]:
    """`same_model` rows on `model` served alone (held, no adapters)."""
    docs = documents(n_docs, chars)
    asks = [(model.name, d, q) for d in docs for q in QUESTIONS]
    roster = Roster.local((), [model.name], holders={model.name: HOLDER})
    log_dir.mkdir(parents=True, exist_ok=True)
    with mesh(roster) as (access, procs):
        _serve(access, procs, model, {}, log_dir, dtype)
        replies = asyncio.run(_ask(access, asks))
    rows = _rows(asks, replies)
    return {"rows": rows, "summary": _summary(rows), "holding": holding_cost(log_dir / f"receiver-{model.name}.log", rows)}


def _rows(asks: list[tuple[str, str, str]], replies: list[schemas.GenerateReply]) -> list[dict[str, Any]]:
    """One row per document: its two requests, in order."""
    rows = []
    for i in range(0, len(asks), 2):
        (m1, ctx, _), (m2, _, _) = asks[i], asks[i + 1]
        r1, r2 = replies[i], replies[i + 1]
        rows.append({"model": m2, "kind": "same_model" if m1 == m2 else "paired_adapter", "first": m1, "second": m2,
                     "tokens": r2.prompt_tokens, "first_ttft_ms": round(r1.ttft_ms, 1), "first_path": r1.path,
                     "second_ttft_ms": round(r2.ttft_ms, 1), "speedup": round(r1.ttft_ms / max(r2.ttft_ms, 1e-6), 2),
                     "second_path": r2.path, "second_plan": r2.plan, "reused_tokens": r2.reused_tokens,
                     "bytes_pulled": r2.bytes_pulled, "_context": ctx})
    return rows


def _local(rows: list[dict[str, Any]], base: ModelRef, adapters: list[ModelRef], plans: dict[str, ReusePlan],
           dtype: str) -> None:
    """For each paired row: the same plan over the first model's KV already in this process, on
    views of the same weights (nothing else running: the mesh has stopped)."""
    from droidmesh.shared.model.lora import AdapterSet

    torch.set_num_threads(1)  # as the receiver (THREADS)
    views = AdapterSet.load(base.path, {m.name: m.path for m in adapters}, base_name=base.name, dtype=dtype).views()
    for row in rows:
        if row["kind"] != "paired_adapter":
            continue
        a, b, plan = views[row["first"]], views[row["second"]], plans[Pair(row["first"], row["second"]).id]
        first = text.request_ids(a.tokenizer, row["_context"], QUESTIONS[0])
        second = text.request_ids(b.tokenizer, row["_context"], QUESTIONS[1])
        captured = capture_prefill(a, first, plan.e_layers)
        ttfts = [generate(b, second, plan, CapturedSource(captured), max_new_tokens=1).ttft_s for _ in range(3)]
        local = statistics.median(ttfts) * 1e3
        row["local_plan"] = plan.label()
        row["local_ttft_ms"] = round(local, 1)
        row["vs_local"] = round(row["second_ttft_ms"] / local - 1, 3)


def holding_cost(log: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What holding cost the serving path, from the receiver's `held` log lines: the copy of each
    served prompt's KV (and E) into the store before its reply, its bytes, and that time against
    the first requests' TTFT (the prefill it follows)."""
    held = [json.loads(line) for line in log.read_text().splitlines()
            if line.startswith("{") and '"event": "held"' in line] if log.is_file() else []
    if not held:
        return {"held": 0}
    ms = statistics.median(h["ms"] for h in held)
    first = statistics.median(r["first_ttft_ms"] for r in rows)
    return {"held": len(held), "hold_ms_median": ms, "bytes_median": statistics.median(h["nbytes"] for h in held),
            "tokens_median": statistics.median(h["tokens"] for h in held),
            "hold_over_first_ttft": round(ms / first, 4) if first else None}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(r["kind"] if r["kind"] == "same_model" else f"{r['first']}-to-{r['second']}" for r in rows):
        mine = [r for r in rows if (r["kind"] if r["kind"] == "same_model" else f"{r['first']}-to-{r['second']}") == kind]
        if not mine:
            continue
        out[kind] = {"speedup_median": statistics.median(r["speedup"] for r in mine),
                     "speedup_min": min(r["speedup"] for r in mine), "meets_3x": all(r["speedup"] >= SPEEDUP_TARGET for r in mine)}
        local = [r["vs_local"] for r in mine if "vs_local" in r]
        if local:
            out[kind] |= {"vs_local_median": statistics.median(local), "meets_10pct": all(abs(v) <= LOCAL_TARGET for v in local)}
    return out


def strip(result: dict[str, Any]) -> dict[str, Any]:
    """`result` without the documents' text (kept only to reproduce the local reference)."""
    return {**result, "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in result["rows"]]}


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
