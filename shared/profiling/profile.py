"""Profile one sender -> receiver pair: sensitivity, both searches, frontier, choice, test check,
then (optionally) how the chosen plan's tensors should travel.

Input: two quality oracles over the same pair (the task's train split, where the choice is
made, and its test split, where it is checked), optionally more oracles for other data (shifted
suites, other tasks, a user's other files: the chosen config is applied to them unchanged,
the transfer check), plus the receiver for the latency fit, and for the transfer search
(`transfer.py`) the sender and the train contexts. Output: the profile JSON (schema in `run`'s
docstring) and the SCD maps files it names; `published.recompute_config` turns the JSON
into the published `RecomputeConfig`.

`profile_checkpoints` is called by `droidmesh profile` (`job.py`, on the CLI's thread) and by the
profiler service (in its torch worker thread); it blocks for the whole profile, as `run` does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.model.device import DEFAULT_DEVICE
from droidmesh.shared.model.names import ModelRef, Pair
from droidmesh.shared.profiling import cost, datasets, evidence, fidelity, latency, search, transfer
from droidmesh.shared.profiling.published import recompute_config
from droidmesh.shared.profiling.search import Evaluate, Memo
from droidmesh.shared.wire import schemas

SEARCHES = ("guided", "coarse", "fidelity")


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    granularity: int = 2
    tolerance: float = 0.05
    critical_threshold: float = 0.05
    # "guided" (sensitivity + one window per group size: O(L) plans, the default), "coarse"
    # (coarse grid, then binary search on the group's ends: O(log L), for a tight budget) or
    # "fidelity" (plans ranked by divergence from full prefill, the short list raced on the task
    # metric with intervals: fidelity.py; needs a scorer with per-row scores)
    search: str = "guided"
    exhaustive: bool = False  # also run the O((L/g)^2) search to compare (120 more plans at L=30, g=2)
    # Rows on which the receiver's full prefill scores near zero, or every path alike, are an
    # error before the search (evidence.py) rather than a profile whose choice means nothing.
    require_signal: bool = True
    budget_s: float | None = None  # `profile_checkpoints` cuts the work to fit (cost.fit), or refuses
    latency_tokens: tuple[int, ...] = (256, 512, 1024)
    transfer_settings: transfer.Settings = transfer.Settings()  # used when `run` gets transfer inputs
    fidelity: fidelity.Settings = fidelity.Settings()  # the fidelity search's probe rows, short list and race


def check_max_layers(settings: ProfileSettings) -> None:
    """A cap on the group's layers is the fidelity search's, on the search's grid: refused
    elsewhere rather than ignored."""
    cap = settings.fidelity.max_layers
    if cap is None:
        return
    if settings.search != "fidelity":
        raise BadRequestError(f"a cap on the group's layers ({cap}) needs the fidelity search "
                              f"(the {settings.search} search has none)")
    if cap < settings.granularity:
        raise BadRequestError(f"a cap of {cap} layers is below the granularity {settings.granularity}: no group fits")


def _progress(evaluate: Evaluate, bar: tqdm) -> Evaluate:
    def run(plan: ReusePlan) -> float:
        bar.set_postfix_str(plan.label())
        q = evaluate(plan)
        bar.update(1)
        return q

    return run


@dataclasses.dataclass(frozen=True)
class _Found:
    """What `run`'s searches found on the train split, before the test split checks it."""
    full_prefill: float
    full_reuse: float
    sensitivity: list[float]
    critical: list[int]
    evaluated: list[search.Point]  # the exhaustive search's points, else the search's own
    frontier: list[search.Point]
    chosen: search.Point
    search_choice: search.Point  # the guided or coarse search's choice alone
    search_cost: int  # plans the search added (beyond the shared sensitivity pass)
    exhaustive_cost: int
    fidelity: dict[str, Any] | None = None  # the fidelity search's ranking and race


def run(train: Evaluate, test: Evaluate, num_layers: int, settings: ProfileSettings, *,
        receiver: Any = None, pair: Pair | None = None, others: Mapping[str, Evaluate] | None = None,
        transfer_inputs: transfer.Inputs | None = None, maps_out: dict[str, bytes] | None = None,
        ) -> dict[str, Any]:
    """Profile a pair. JSON keys: sender, receiver, task, total_layers, search (guided or
    coarse), full_prefill / full_reuse / chosen (with quality_train, quality_test; chosen also
    passes_test: the rule on the test split), sensitivity (empty after a coarse search),
    critical_layers, frontier, evaluations {exhaustive, guided, coarse, sensitivity},
    <search>_choice, searches_agree, scattered_critical (None after a coarse search) and
    chosen_split (train/test), robustness (the chosen config on the test split and on each of
    `others`' data), latency_fit (when `receiver` is given), transfer (with `receiver` and
    `transfer_inputs`: `transfer.search`'s section; its maps files go into `maps_out`, by sha256).
    With `settings.require_signal`, rows that cannot support any choice raise `NoSignalError`
    after the first plans, before the search (evidence.py)."""
    pair = pair or Pair("", "")
    if settings.search not in SEARCHES:
        raise BadRequestError(f"search {settings.search!r}: one of {', '.join(SEARCHES)}")
    if settings.search == "fidelity" and not isinstance(train, fidelity.RowOracle):
        raise BadRequestError("the fidelity search needs per-row task scores and divergences (a PairScorer)")
    check_max_layers(settings)
    plans = cost.train_evaluations(cost.Work(settings.search, settings.exhaustive, 0, 0), num_layers,
                                   settings.granularity)
    with tqdm(total=plans, desc=f"profile {pair.id}", unit="config") as bar:  # closed on an error too
        memo, test_memo = Memo(train), Memo(test)
        ev = _progress(memo, bar)
        found = _search(ev, memo, train, test_memo, num_layers, settings)
        for scorer in (train, test):  # the rest of the plans are known now: one capture per row, not kept
            if hasattr(scorer, "fill"):
                scorer.fill(_test_plans(found, settings))
        result = _result(found, ev, test_memo, pair, num_layers, settings)
        result["chosen"].update(_test_check(test, found.chosen.plan(), result, settings.tolerance))
        # full reuse's own interval on the same test rows: what recomputing the group buys
        result["full_reuse"]["test_interval"] = evidence.test_interval(test, ReusePlan.full_reuse(), settings.tolerance)
    chosen = found.chosen.plan()
    result["robustness"] = robustness(result, chosen, test, dict(others or {}))
    if receiver is not None:
        ks = sorted({0, max(1, num_layers // 4), num_layers // 2, num_layers})
        fit = latency.fit(latency.measure(receiver, settings.latency_tokens, ks), receiver)
        result["latency_fit"] = msgspec.structs.asdict(fit)
        if transfer_inputs is not None:
            result["transfer"], files = transfer.profile_transfer(transfer_inputs, receiver, chosen, found.full_prefill,
                                                                  settings.tolerance, fit, settings.transfer_settings)
            if maps_out is not None:
                maps_out.update(files)
    return result


def _search(ev: Evaluate, memo: Memo, train: Evaluate, test_memo: Memo, num_layers: int,
            settings: ProfileSettings) -> _Found:
    """The first plans (with `settings.require_signal`, the evidence checks on them), then the
    sensitivity pass and the search, the frontier and the choice, all scored through `ev`."""
    L, g = num_layers, settings.granularity
    full_prefill = ev(ReusePlan.full_prefill())
    if settings.require_signal:  # the cheapest plans first: can these rows support any choice?
        evidence.require_scores("train", full_prefill)
        evidence.require_scores("test", test_memo(ReusePlan.full_prefill()))
    full_reuse = ev(ReusePlan.full_reuse())
    if settings.require_signal:
        evidence.require_paths_differ("train", train)
    if settings.search == "fidelity":
        return _fidelity(ev, train, full_prefill, full_reuse, L, settings)
    sens: list[float] = []
    critical: list[int] = []
    if settings.search == "guided":
        sens = search.sensitivity(ev, L)
        critical = search.critical_layers(sens, full_prefill, settings.critical_threshold)
        before = memo.seen
        searched = search.guided(ev, sens, full_prefill, L, g)
    else:
        before = memo.seen
        searched = search.coarse(ev, L, g, full_prefill, settings.tolerance)
    search_cost = memo.seen - before
    search_choice = search.choose(search.frontier(searched, full_reuse), full_prefill, settings.tolerance)
    # The exhaustive search is charged every grid group it covers (memo hits included), as if run alone.
    points = search.exhaustive(ev, L, g) if settings.exhaustive else searched
    front = search.frontier(points + searched, full_reuse)
    return _Found(full_prefill, full_reuse, sens, critical, points, front,
                  search.choose(front, full_prefill, settings.tolerance), search_choice, search_cost,
                  len(points) if settings.exhaustive else 0)


def _fidelity(ev: Evaluate, train: Any, full_prefill: float, full_reuse: float, num_layers: int,
              settings: ProfileSettings) -> _Found:
    """The fidelity search (fidelity.py) on the train scorer: divergence ranks, the race chooses.
    The frontier holds each raced plan at its mean over the rows it was scored on."""
    ranked, raced = fidelity.search_train(train, num_layers, settings.granularity, settings.tolerance,
                                          settings.fidelity)
    pick = raced.chosen or fidelity.fallback(raced)

    def point(plan: ReusePlan, quality: float) -> search.Point:
        (s, e), = plan.groups or ((0, 0),)  # full reuse: no group
        return search.Point(s, e, quality)

    raced_points = [point(e.plan, sum(train.scores(e.plan, rows=e.rows)) / max(1, e.rows))
                    for e in raced.entries if e.rows]
    chosen = point(pick.plan, ev(pick.plan)) if pick is not None else search.Point(0, num_layers, full_prefill)
    front = search.frontier([*raced_points, chosen], full_reuse)
    return _Found(full_prefill, full_reuse, [], [], raced_points, front, chosen, chosen, len(ranked.windows) + len(
        ranked.sensitivity) + 1, 0, fidelity.section(ranked, raced, settings.fidelity, len(train.rows)))


def _test_plans(found: _Found, settings: ProfileSettings) -> list[ReusePlan]:
    """The plans `_result` and the test check score on the test split."""
    plans = [ReusePlan.full_prefill(), ReusePlan.full_reuse(), found.chosen.plan(),
             search.split(found.chosen.start, found.chosen.end)]
    if settings.search == "guided":
        plans.append(search.scattered(found.critical))
    return list(dict.fromkeys(plans))


def _result(found: _Found, ev: Evaluate, test_memo: Memo, pair: Pair, num_layers: int,
            settings: ProfileSettings) -> dict[str, Any]:
    """`run`'s JSON up to robustness: what the search found, with the test split's scores of the
    headline plans and of the chosen layers recomputed apart (critical alone, one group each)."""
    chosen, sens, critical, search_choice = found.chosen, found.sensitivity, found.critical, found.search_choice
    split = search.split(chosen.start, chosen.end)
    scattered = search.scattered(critical) if settings.search == "guided" else None
    full_prefill_test, chosen_test = test_memo(ReusePlan.full_prefill()), test_memo(chosen.plan())
    return {
        "sender": pair.sender, "receiver": pair.receiver, "task": pair.task, "total_layers": num_layers,
        "granularity": settings.granularity, "tolerance": settings.tolerance, "search": settings.search,
        "full_prefill": {"quality_train": found.full_prefill, "quality_test": full_prefill_test},
        "full_reuse": {"quality_train": found.full_reuse, "quality_test": test_memo(ReusePlan.full_reuse())},
        "chosen": {"start": chosen.start, "end": chosen.end, "recomputed_layers": chosen.layers,
                   "quality_train": chosen.quality, "quality_test": chosen_test,
                   "passes_test": evidence.passes_test(chosen_test, full_prefill_test, settings.tolerance)},
        "sensitivity": [{"layer": l, "quality": q} for l, q in enumerate(sens)],
        "sensitivity_probe": "only layer l's KV from the sender, every other layer the receiver's own (no E)",
        "evaluated": [{"start": p.start, "end": p.end, "recomputed_layers": p.layers, "quality": p.quality}
                      for p in found.evaluated],
        "critical_layers": critical,
        "frontier": [{"start": p.start, "end": p.end, "recomputed_layers": p.layers, "quality": p.quality}
                     for p in found.frontier],
        "evaluations": {"exhaustive": found.exhaustive_cost,
                        **{k: found.search_cost if settings.search == k else 0 for k in SEARCHES},
                        "sensitivity": len(sens)},
        f"{settings.search}_choice": {"start": search_choice.start, "end": search_choice.end,
                                      "quality": search_choice.quality},
        "searches_agree": (search_choice.start, search_choice.end) == (chosen.start, chosen.end),
        "fidelity": found.fidelity,
        "scattered_critical": None if scattered is None else {
            "groups": [list(gr) for gr in scattered.groups], "recomputed_layers": len(critical),
            "quality_train": ev(scattered), "quality_test": test_memo(scattered),
            "e_transitions": len(scattered.e_layers),
        },
        # The same layers as the chosen group, but one transition (own sender E) per layer.
        "chosen_split": {
            "groups": [list(gr) for gr in split.groups], "recomputed_layers": chosen.layers,
            "quality_train": ev(split), "quality_test": test_memo(split), "e_transitions": len(split.e_layers),
        },
    }


def _test_check(test: Evaluate, plan: ReusePlan, result: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """The chosen plan's check on the test split: the rule on the paired interval where the test
    oracle has per-row scores (`evidence.test_interval`), else on the means."""
    interval = evidence.test_interval(test, plan, tolerance)
    if interval is None:
        return {"test_interval": None}
    return {"test_interval": interval, "passes_test": evidence.PASSES[interval["verdict"]]}


def robustness(result: dict[str, Any], plan: ReusePlan, test: Evaluate,
               others: dict[str, Evaluate]) -> list[dict[str, Any]]:
    """The transfer check: the config chosen on one task's train split, applied unchanged to its test
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


def profile_checkpoints(sender: ModelRef, receiver: ModelRef, task: str, settings: ProfileSettings, *,
                        n_train: int = 50, n_test: int = 50, data: str | None = None,
                        data_train: str | None = None, data_test: str | None = None, metric: str | None = None,
                        max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None,
                        version: int | None = None, device: str = DEFAULT_DEVICE, dtype: str | None = None,
                        other_tasks: Sequence[str] | None = None, transfer_search: bool = False,
                        maps_out: dict[str, bytes] | None = None, say: Callable[[str], None] = lambda line: None,
                        ) -> tuple[dict[str, Any], schemas.RecomputeConfig]:
    """Load both checkpoints on `device`, score plans on the train split, check on the test split
    and on `other_tasks` (zoo tasks / shifts, or JSONL files). Rows: the zoo's generated `task`,
    or a user's JSONL (`data`, split in two; or `data_train` and `data_test`), scored with the
    task's spec as `metric` / `max_new_tokens` / `stop` override it. `other_tasks` None: the
    task's shifts and every other zoo task when profiling a zoo task's own rows, else none.
    `transfer_search`: also run the transfer search (SCD maps calibrated on the train contexts);
    its maps files go into `maps_out` (sha256 -> bytes), which the published config names.
    Before the profile starts, `say` gets its estimated cost (cost.py) and, with
    `settings.budget_s`, what was cut to fit it; a budget nothing fits is a BadRequestError then."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.fingerprint import require_compatible
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec

    check_max_layers(settings)  # before the models load
    if data and (data_train or data_test):
        raise BadRequestError("give either --data (one file, split in two) or --data-train / --data-test")
    other_tasks = datasets.robustness_tasks(task, other_tasks, user_data=bool(data or data_train or data_test))
    overrides: dict[str, Any] = {"metric": metric, "max_new_tokens": max_new_tokens, "stop": stop}
    spec = task_spec(task, **overrides)
    train_rows = datasets.load_rows(task, "train", n_train, data or data_train, split_data=bool(data))
    test_rows = datasets.load_rows(task, "test", n_test, data or data_test, split_data=bool(data))
    if not (train_rows and test_rows):
        raise BadRequestError(f"no rows to profile on ({len(train_rows)} train, {len(test_rows)} test)")
    other_rows = datasets.robustness_rows(other_tasks, n_test, overrides)
    s_model = load_model(sender.path, device=device, dtype=dtype, name=sender.name)
    r_model = load_model(receiver.path, device=device, dtype=dtype, name=receiver.name)
    require_compatible(s_model.fingerprint, r_model.fingerprint)
    L = r_model.num_layers
    work = cost.Work(settings.search, settings.exhaustive, len(train_rows), len(test_rows),
                     tuple(len(rows) for rows, _ in other_rows.values()), transfer_search, settings.fidelity.max_layers)
    work, timing, cut = _fit_budget(work, s_model, r_model, train_rows, spec, L, settings, say)
    settings = dataclasses.replace(settings, search=work.search, exhaustive=work.exhaustive)
    keep = cost.captures_kept(s_model, train_rows, spec, at_least=fidelity.Settings().batch)
    train = PairScorer(s_model, r_model, train_rows[:work.n_train], spec, max_captures=keep)
    test = PairScorer(s_model, r_model, test_rows[:work.n_test], spec)
    others = {t: PairScorer(s_model, r_model, rows, t_spec) for t, (rows, t_spec) in other_rows.items()} if work.others else {}
    probe = fidelity.Settings().probe_rows
    xfer = transfer.Inputs(s_model, [r.context for r in train.rows], train.quality, test.quality,
                           {"sender_sha256": sender.sha256, "receiver_sha256": receiver.sha256},
                           lambda plan, wire: train.divergences(plan, probe, wire)) if work.transfer else None
    t0 = time.perf_counter()
    result = run(train, test, L, settings, receiver=r_model, pair=Pair(sender.name, receiver.name, task), others=others,
                 transfer_inputs=xfer, maps_out=maps_out)
    result["sender_alone"] = {"quality_train": train.sender_alone(), "quality_test": test.sender_alone()}
    result["rows"] = {"train": len(train.rows), "test": len(test.rows)}
    result["cost"] = {"measured_s": dataclasses.asdict(timing),
                      "row_evaluations": cost.row_evaluations(work, L, settings.granularity)[1],
                      "estimated_s": cost.seconds(work, L, settings.granularity, timing),
                      "elapsed_s": time.perf_counter() - t0, "budget_s": settings.budget_s, "cut": cut}
    cfg = recompute_config(result, sender, receiver, version if version is not None else int(time.time()))
    return result, cfg


def _fit_budget(work: cost.Work, s_model: Any, r_model: Any, train_rows: list[dict[str, Any]], spec: Any,
                num_layers: int, settings: ProfileSettings, say: Callable[[str], None],
                ) -> tuple[cost.Work, cost.Timing, list[str]]:
    """The cost, measured on a typical train row and said before anything long runs; with
    `settings.budget_s`, the work cut to fit it (said too), or a BadRequestError when nothing fits."""
    from droidmesh.shared.tasks.rows import encode_row

    g = settings.granularity
    row, scale = cost.typical_row(train_rows, lambda r: sum(map(len, encode_row(r_model.tokenizer, r, spec)[:2])))
    timing = cost.measure(s_model, r_model, row, spec).scaled(scale)
    cut: list[str] = []
    if settings.budget_s is not None:
        work, cut = cost.fit(work, num_layers, g, timing, settings.budget_s)
    say(cost.announce(work, num_layers, g, timing))
    if cut:
        say(f"profile: cut to fit --budget {(settings.budget_s or 0) / 60:g} min (--budget 0: no limit): "
            f"{'; '.join(cut)}")
    return work, timing, cut
