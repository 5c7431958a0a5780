"""Profile one sender -> receiver pair: sensitivity, both searches, frontier, choice, test check.

Input: two quality oracles over the same pair (the task's train split, where the choice is
made, and its test split, where it is checked), optionally more oracles for other data (shifted
suites, other tasks: the chosen config is applied to them unchanged, DroidSpeak §5.4), plus the
receiver for the latency fit. Output: the profile JSON (schema in `run`'s docstring) and a
`RecomputeConfig`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from shared.errors import BadRequestError
from shared.kv.plan import ReusePlan
from shared.profiling import latency, search
from shared.profiling.search import Evaluate, Memo, Point
from shared.wire import schemas


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    granularity: int = 2
    tolerance: float = 0.05
    critical_threshold: float = 0.05
    exhaustive: bool = True  # also run the O((L/g)^2) search to compare with the guided one
    latency_tokens: tuple[int, ...] = (256, 512, 1024)


def _progress(evaluate: Evaluate, bar: tqdm) -> Evaluate:
    def run(plan: ReusePlan) -> float:
        bar.set_postfix_str(plan.label())
        q = evaluate(plan)
        bar.update(1)
        return q

    return run


def run(train: Evaluate, test: Evaluate, num_layers: int, settings: ProfileSettings, *,
        receiver: Any = None, sender_model: str = "", receiver_model: str = "", task: str = "",
        version: int | None = None, others: Mapping[str, Evaluate] | None = None,
        ) -> tuple[dict[str, Any], schemas.RecomputeConfig]:
    """Profile a pair. JSON keys: total_layers, full_prefill / full_reuse / chosen (with
    quality_train, quality_test), sensitivity, critical_layers, frontier, evaluations
    {exhaustive, guided}, searches_agree, scattered_critical and chosen_split (train/test),
    robustness (the chosen config on the test split and on each of `others`' tasks), latency_fit."""
    L, g = num_layers, settings.granularity
    cuts = len(search.grid(L, g))
    budget = 2 + L + (cuts - 1) + ((cuts - 1) * cuts // 2 if settings.exhaustive else 0)
    bar = tqdm(total=budget, desc=f"profile {sender_model}->{receiver_model}", unit="config")
    memo = Memo(train)
    ev = _progress(memo, bar)
    full_prefill = ev(ReusePlan.full_prefill())
    full_reuse = ev(ReusePlan.full_reuse())
    sens = search.sensitivity(ev, L)
    critical = search.critical_layers(sens, full_prefill, settings.critical_threshold)
    before = memo.seen
    guided_pts = search.guided(ev, sens, full_prefill, L, g)
    guided_cost = memo.seen - before  # plans the guided search added beyond the shared sensitivity pass
    guided_choice = search.choose(search.frontier(guided_pts, full_reuse), full_prefill, settings.tolerance)
    # The exhaustive search is charged every grid group it covers (memo hits included), as if run alone.
    points = search.exhaustive(ev, L, g) if settings.exhaustive else guided_pts
    exhaustive_cost = len(points) if settings.exhaustive else 0
    bar.close()
    front = search.frontier(points + guided_pts, full_reuse)
    chosen = search.choose(front, full_prefill, settings.tolerance)
    scattered = search.scattered(critical)
    split = search.split(chosen.start, chosen.end)
    test_memo = Memo(test)
    result: dict[str, Any] = {
        "sender": sender_model, "receiver": receiver_model, "task": task, "total_layers": L,
        "granularity": g, "tolerance": settings.tolerance,
        "full_prefill": {"quality_train": full_prefill, "quality_test": test_memo(ReusePlan.full_prefill())},
        "full_reuse": {"quality_train": full_reuse, "quality_test": test_memo(ReusePlan.full_reuse())},
        "chosen": {"start": chosen.start, "end": chosen.end, "recomputed_layers": chosen.layers,
                   "quality_train": chosen.quality, "quality_test": test_memo(chosen.plan())},
        "sensitivity": [{"layer": l, "quality": q} for l, q in enumerate(sens)],
        "sensitivity_probe": "only layer l's KV from the sender, every other layer the receiver's own (no E)",
        "evaluated": [{"start": p.start, "end": p.end, "recomputed_layers": p.layers, "quality": p.quality}
                      for p in points],
        "critical_layers": critical,
        "frontier": [{"start": p.start, "end": p.end, "recomputed_layers": p.layers, "quality": p.quality}
                     for p in front],
        "evaluations": {"exhaustive": exhaustive_cost, "guided": guided_cost, "sensitivity": L},
        "guided_choice": {"start": guided_choice.start, "end": guided_choice.end, "quality": guided_choice.quality},
        "searches_agree": (guided_choice.start, guided_choice.end) == (chosen.start, chosen.end),
        "scattered_critical": {
            "groups": [list(gr) for gr in scattered.groups], "recomputed_layers": len(critical),
            "quality_train": memo(scattered), "quality_test": test_memo(scattered),
            "e_transitions": len(scattered.e_layers),
        },
        # The same layers as the chosen group, but one transition (own sender E) per layer.
        "chosen_split": {
            "groups": [list(gr) for gr in split.groups], "recomputed_layers": chosen.layers,
            "quality_train": memo(split), "quality_test": test_memo(split), "e_transitions": len(split.e_layers),
        },
    }
    result["robustness"] = robustness(result, chosen.plan(), test, dict(others or {}))
    fit = None
    if receiver is not None:
        ks = sorted({0, max(1, L // 4), L // 2, L})
        fit = latency.fit(latency.measure(receiver, settings.latency_tokens, ks), receiver)
        result["latency_fit"] = msgspec.structs.asdict(fit)
    cfg = schemas.RecomputeConfig(
        sender_model=sender_model, receiver_model=receiver_model,
        profile_version=version if version is not None else int(time.time()), task=task,
        tolerance=settings.tolerance, chosen=_fp(chosen), frontier=[_fp(p) for p in front],
        full_prefill_quality=full_prefill, full_reuse_quality=full_reuse, total_layers=L, latency=fit,
        created_at=time.time(),
    )
    return result, cfg


def robustness(result: dict[str, Any], plan: ReusePlan, test: Evaluate,
               others: dict[str, Evaluate]) -> list[dict[str, Any]]:
    """DroidSpeak §5.4: the config chosen on one task's train split, applied unchanged to its test
    split and to other tasks. `difference` = chosen - receiver's full prefill on that data (0: the
    profile transfers; negative: it loses quality there), `relative` = difference / full prefill
    (None where full prefill scores 0: the receiver cannot do that task at all)."""
    ch = result["chosen"]
    rows = [(result.get("task") or "profiled task", test, result["full_prefill"]["quality_test"],
             result["full_reuse"]["quality_test"], ch["quality_test"])]
    for name, ev in tqdm(others.items(), desc="robustness", unit="task", disable=not others):
        rows.append((name, ev, ev(ReusePlan.full_prefill()), ev(ReusePlan.full_reuse()), ev(plan)))
    return [{"task": t, "split": "test", "metric": getattr(getattr(ev, "spec", None), "metric", None),
             "full_prefill": fp, "full_reuse": fr, "chosen": q, "difference": q - fp,
             "relative": (q - fp) / fp if fp > 0 else None, "within_tolerance": q >= (1 - result["tolerance"]) * fp}
            for t, ev, fp, fr, q in rows]


def _fp(p: Point) -> schemas.FrontierPoint:
    return schemas.FrontierPoint(start=p.start, end=p.end, recomputed_layers=p.layers, quality=p.quality)


def load_rows(task: str, split: str, n: int, data: str | None = None, shape: Any = None) -> list[dict[str, Any]]:
    """`n` rows of a user JSONL file (`data`), or of the zoo's generated `task` split."""
    from shared.zoo.jsonl import read_jsonl
    from shared.zoo.suite import SuiteShape, make_rows

    if data:
        rows = read_jsonl(data)
        return rows[:n] if n else rows
    return make_rows(task, split, n, shape or SuiteShape())


def profile_checkpoints(sender_path: str, receiver_path: str, task: str, settings: ProfileSettings, *,
                        n_train: int = 50, n_test: int = 50, data_train: str | None = None,
                        data_test: str | None = None, sender_model: str = "", receiver_model: str = "",
                        version: int | None = None, dtype: str = "float32", other_tasks: Sequence[str] | None = None,
                        ) -> tuple[dict[str, Any], schemas.RecomputeConfig]:
    """Load both checkpoints, score plans on the train split, check on the test split and on
    `other_tasks`' test splits (None, when profiling a zoo task's own splits: the task's shifts,
    e.g. longer contexts, then every other zoo task)."""
    from shared.model.adapter import load_model
    from shared.model.fingerprint import require_compatible
    from shared.profiling.evaluate import PairEvaluator
    from shared.zoo.suite import TASKS, known_tasks, shifts_of, task_spec

    if other_tasks is None:
        zoo = task in TASKS and not (data_train or data_test)
        other_tasks = [*shifts_of(task), *(t for t in TASKS if t != task)] if zoo else []
    other_tasks = [t for t in other_tasks if t != task]
    unknown = [t for t in other_tasks if t not in known_tasks()]
    if unknown:
        raise BadRequestError(f"robustness tasks {unknown} are not zoo tasks; known: {known_tasks()}")
    sender = load_model(sender_path, dtype=dtype, name=sender_model or None)
    receiver = load_model(receiver_path, dtype=dtype, name=receiver_model or None)
    require_compatible(sender.fingerprint, receiver.fingerprint)
    spec = task_spec(task)
    train = PairEvaluator(sender, receiver, load_rows(task, "train", n_train, data_train), spec)
    test = PairEvaluator(sender, receiver, load_rows(task, "test", n_test, data_test), spec)
    others = {t: PairEvaluator(sender, receiver, load_rows(t, "test", n_test), task_spec(t)) for t in other_tasks}
    result, cfg = run(train, test, receiver.num_layers, settings, receiver=receiver, sender_model=sender.name,
                      receiver_model=receiver.name, task=task, version=version, others=others)
    result["sender_alone"] = {"quality_train": train.sender_alone(), "quality_test": test.sender_alone()}
    return result, cfg
