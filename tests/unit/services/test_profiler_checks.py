"""The profiler's request checks by requester (services/profiler/checks.py) and its queue
(services/profiler/admission.py): pure, no models, no bus; and a receiver's re-profile refused
through its handler, on an in-memory board."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.services.profiler import checks
from droidmesh.services.profiler.admission import Admission
from droidmesh.services.profiler.config import ProfilerConfig
from droidmesh.shared.errors import BadRequestError, ConfigError, OverloadedError, UnauthorizedError
from droidmesh.shared.wire import schemas

NOW = 1_800_000_000.0
ROWS = [schemas.ProfileRow(context=f"context {i}", input="q", answers=["a"]) for i in range(4)]
MODELS = {"summ", "qa"}


def reprofile(**changes) -> schemas.ProfileRequest:
    """What a receiver of `qa` sends after drift (services/receiver/relay_watch.py), changed."""
    fields = dict(request_id="reprofile-1", sender_path="summ", receiver_path="qa", task="multihop_qa",
                  sender_model="summ", receiver_model="qa", n_train=4, n_test=4, exhaustive=False, other_tasks=[],
                  rows=ROWS, sender_sha256="a" * 64, receiver_sha256="b" * 64)
    return schemas.ProfileRequest(**{**fields, **changes})


def _in_use() -> schemas.RecomputeConfig:
    """The config of summ -> qa in use when a receiver of qa re-profiles."""
    point = schemas.FrontierPoint(schemas.PlanSpec(groups=[(2, 4)]), 2, 0.9)
    return schemas.RecomputeConfig(sender_model="summ", receiver_model="qa", sender_sha256="a" * 64,
                                   receiver_sha256="b" * 64, profile_version=7, task="multihop_qa", tolerance=0.05,
                                   chosen=point, frontier=[point], full_prefill_quality=1.0, full_reuse_quality=0.5,
                                   total_layers=6)


def check_receiver(req: schemas.ProfileRequest, max_rows: int = 64, max_bytes: int = 1 << 16) -> None:
    checks.check_receiver(req, "qa", MODELS, max_rows, max_bytes)


def test_a_receivers_drift_reprofile_passes():
    check_receiver(reprofile())
    check_receiver(reprofile(receiver_model="", sender_model="", other_tasks=None))


@pytest.mark.parametrize("field,value", [
    ("data_train", "/etc/passwd"), ("data_test", "rows.jsonl"), ("data_train", ""), ("other_tasks", ["/dev/zero"]),
    ("version", int(NOW) + 86_000), ("version", 1), ("relay", [schemas.RelayBucket(0.0, 1.0, False)]),
    ("transfer", True), ("exhaustive", True),
])
def test_a_receiver_may_not_name_files_versions_relay_buckets_or_costly_searches(field, value):
    with pytest.raises(BadRequestError, match=f"calibration rows only: {field} is for operators"):
        check_receiver(reprofile(**{field: value}))


def test_the_search_is_one_the_profiler_runs_whoever_asks():
    """Any of the searches may be asked (the fidelity one reads the rows' divergence and races the
    short list); another name is refused before any model loads, for operators too."""
    for search in ("guided", "coarse", "fidelity"):
        check_receiver(reprofile(search=search))
        checks.check_operator(reprofile(search=search), 64, 1 << 16, NOW)
    for ask in (lambda r: check_receiver(r), lambda r: checks.check_operator(r, 64, 1 << 16, NOW)):
        with pytest.raises(BadRequestError, match="search 'exhaustive': one of guided, coarse, fidelity"):
            ask(reprofile(search="exhaustive"))


def test_a_cap_on_the_groups_layers_is_the_fidelity_searchs_and_on_its_grid_whoever_asks():
    """`max_layers` narrows the fidelity search for either requester; with another search, below the
    granularity or outside 1..MAX_LAYERS it is refused before any model loads, not ignored."""
    for ask in (lambda r: check_receiver(r), lambda r: checks.check_operator(r, 64, 1 << 16, NOW)):
        ask(reprofile(search="fidelity", max_layers=6))
        ask(reprofile(search="fidelity", max_layers=2, granularity=2))
        for changes, match in [(dict(search="guided", max_layers=6), "needs the fidelity search"),
                               (dict(search="fidelity", max_layers=2, granularity=4), "below the granularity 4"),
                               (dict(search="fidelity", max_layers=0), r"max_layers=0 outside 1\.\.1024"),
                               (dict(search="fidelity", max_layers=10**9), "outside 1..1024")]:
            with pytest.raises(BadRequestError, match=match):
                ask(reprofile(**changes))


def test_the_profile_a_request_runs_carries_its_cap():
    settings = checks.settings(reprofile(search="fidelity", max_layers=6))
    assert (settings.search, settings.fidelity.max_layers, settings.require_signal) == ("fidelity", 6, False)
    assert checks.settings(reprofile()).fidelity.max_layers is None


@pytest.mark.parametrize("changes,match", [
    (dict(receiver_path="code"), "re-profile their own pairs"),
    (dict(receiver_model="code"), "re-profile their own pairs"),
    (dict(sender_path="/models/summ"), "sender_path must be a model id"),
    (dict(sender_path="other"), "sender_path must be a model id"),
    (dict(sender_model="evil"), "sender_model empty or that id"),
    (dict(rows=[]), "at least 2 calibration rows"),
    (dict(rows=ROWS[:1]), "rows outside 2..64"),
])
def test_a_receiver_reprofiles_only_its_own_pairs_of_mapped_ids_with_rows(changes, match):
    with pytest.raises(BadRequestError, match=match):
        check_receiver(reprofile(**changes))


def test_rows_are_bounded_in_count_and_bytes():
    with pytest.raises(BadRequestError, match="rows outside 2..3"):
        check_receiver(reprofile(n_train=3, n_test=3), max_rows=3)
    big = [schemas.ProfileRow(context="x" * 1000, input="q", answers=["a"]) for _ in range(4)]
    assert checks.rows_bytes(big) == 4 * 1002
    with pytest.raises(BadRequestError, match="4008 bytes of text, over the cap of 4000"):
        check_receiver(reprofile(rows=big), max_bytes=4000)
    with pytest.raises(BadRequestError, match="at least one reference answer"):
        check_receiver(reprofile(rows=[*ROWS[:2], schemas.ProfileRow(context="c", input="q", answers=[])]))


@pytest.mark.parametrize("changes,match", [
    (dict(version=int(NOW) + 3600), "ahead of this profiler's clock"),
    (dict(version=-1), "negative"),
    (dict(data_train="a.jsonl"), "either rows or data files"),
    (dict(other_tasks=["t"] * 17), "17 robustness tasks"),
    (dict(relay=[schemas.RelayBucket(0.0, 1.0)] * 17), "17 relay buckets"),
    (dict(granularity=65), "granularity"),
    (dict(tolerance=float("nan")), "tolerance"),
    (dict(task=""), "task must be"),
    (dict(n_train=0), "n_train=0"),
])
def test_an_operators_request_keeps_its_bounds(changes, match):
    with pytest.raises(BadRequestError, match=match):
        checks.check_operator(reprofile(**changes), 500, 1 << 16, NOW)


def test_an_operator_may_name_files_relay_buckets_and_a_current_version():
    checks.check_operator(reprofile(rows=[], data_train="train.jsonl", data_test="test.jsonl", exhaustive=True,
                                    relay=[schemas.RelayBucket(0.0, 1.0, False)], version=int(NOW), transfer=True),
                          500, 1 << 16, NOW)


def test_the_profiler_picks_versions_above_the_newest_and_never_far_ahead():
    assert checks.next_version(None, NOW) == int(NOW)
    assert checks.next_version(int(NOW) - 50, NOW) == int(NOW)
    assert checks.next_version(int(NOW), NOW) == int(NOW) + 1  # two profiles in one second still rank
    assert checks.next_version(int(NOW) + 10, NOW) == int(NOW) + 11
    with pytest.raises(BadRequestError, match="ahead of this profiler's clock"):
        checks.next_version(int(NOW) + 86_000, NOW)  # a hostile version is not outranked by another one


def test_the_config_refuses_ids_sharing_a_subject_and_a_missing_data_root(tmp_path):
    with pytest.raises(ConfigError, match="distinct subject tokens"):
        ProfilerConfig(models=("a.b=/m/1", "a_b=/m/2"))
    with pytest.raises(ConfigError, match="not a directory"):
        ProfilerConfig(data_root=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="queue_size"):
        ProfilerConfig(queue_size=1)


# -- the queue ------------------------------------------------------------------------------
QA, CODE = checks.receiver("qa"), checks.receiver("code")


def test_a_receiver_past_its_limit_or_a_full_queue_is_refused_at_once_and_the_last_place_is_operators():
    q = Admission(size=3, per_receiver=1)
    q.admit(QA)
    with pytest.raises(OverloadedError, match="receivers of qa already hold 1"):
        q.admit(QA)
    q.admit(CODE)
    with pytest.raises(OverloadedError, match="2 requests held, its queue holds 3"):
        q.admit(checks.receiver("summ"))  # the last place is kept for an operator
    q.admit(checks.OPERATOR)
    with pytest.raises(OverloadedError, match="3 requests held"):
        q.admit(checks.OPERATOR)
    assert q.held == {QA.name: 1, CODE.name: 1, checks.OPERATOR.name: 1}


async def _held(q: Admission, n: int) -> None:
    """Return once `n` requests hold places (the tasks taking them run on this loop)."""
    while sum(q.held.values()) < n:
        await asyncio.sleep(0)


def test_one_runs_at_a_time_operators_first_and_places_are_given_back():
    async def run() -> tuple[list[str], dict]:
        q = Admission(size=4, per_receiver=1)
        order: list[str] = []
        first_runs, release = asyncio.Event(), asyncio.Event()

        async def job(who: checks.Requester, tag: str, hold: bool = False) -> None:
            async with q.slot(who):
                order.append(tag)
                if hold:
                    first_runs.set()
                    await release.wait()

        tasks = [asyncio.create_task(job(QA, "receiver qa", hold=True))]
        await asyncio.wait_for(first_runs.wait(), 10)
        tasks.append(asyncio.create_task(job(CODE, "receiver code")))
        tasks.append(asyncio.create_task(job(checks.OPERATOR, "operator")))
        await asyncio.wait_for(_held(q, 3), 10)  # both waiting
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return order, dict(q.held)

    order, held = asyncio.run(run())
    assert order == ["receiver qa", "operator", "receiver code"]
    assert held == {}


def test_a_cancelled_waiter_gives_its_place_back_and_the_next_one_runs():
    async def run() -> list[str]:
        q = Admission(size=4, per_receiver=1)
        order: list[str] = []
        started, release = asyncio.Event(), asyncio.Event()

        async def job(who: checks.Requester, tag: str, hold: bool = False) -> None:
            async with q.slot(who):
                order.append(tag)
                if hold:
                    started.set()
                    await release.wait()

        running = asyncio.create_task(job(checks.OPERATOR, "first", hold=True))
        await asyncio.wait_for(started.wait(), 10)
        gone = asyncio.create_task(job(QA, "cancelled"))
        later = asyncio.create_task(job(CODE, "later"))
        await asyncio.wait_for(_held(q, 3), 10)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert QA.name not in q.held
        release.set()
        await asyncio.wait_for(asyncio.gather(running, later), 10)
        return order

    assert asyncio.run(run()) == ["first", "later"]


def test_a_receiver_reprofiles_only_a_pair_that_has_a_config():
    """Otherwise its re-profile would publish a config for a new pair, and the pair's sender would
    then grant this receiver's model pulls of its cache."""
    with pytest.raises(BadRequestError, match="receivers re-profile only pairs an operator profiled"):
        checks.check_paired(None, "summ", "qa")
    checks.check_paired(object(), "summ", "qa")  # type: ignore[arg-type]  # any config on the board


def test_a_reprofile_keeps_the_rule_of_the_config_in_use():
    """The test split's rule is the config in use's tolerance: a re-profile asking another (a
    looser one would let any plan pass) is refused; the same one passes."""
    in_use = _in_use()
    with pytest.raises(BadRequestError, match=r"tolerance 0.99: a re-profile keeps the tolerance of the pair's config "
                                              r"in use \(0.05\)"):
        checks.check_same_rule(in_use, reprofile(tolerance=0.99))
    checks.check_same_rule(in_use, reprofile(tolerance=0.05))


@pytest.mark.parametrize("caller", ["receiver-qa", "receiver-summ", "client", "gateway", "profiler"])
def test_only_an_operators_reprofile_is_run_and_published(caller):
    """A receiver's login (or any other but admin's) is refused: its rows would choose its pair's
    plan. On a server without users nobody can be told apart (caller ""): served as before."""
    with pytest.raises(UnauthorizedError, match=f"NATS user {caller} may ask for a re-profile of summ-to-qa, not have "
                                                "one published.*reprofile_wanted"):
        checks.check_reprofiler(caller, "summ-to-qa")
    checks.check_reprofiler("admin", "summ-to-qa")
    checks.check_reprofiler("", "summ-to-qa")


def test_a_receivers_reprofile_is_refused_before_any_work_and_recorded_for_operators():
    """As `NatsBus.serve` runs it for user receiver-qa: refused (unauthorized) without a place in
    the queue or a model load, the board untouched, counted in dm_control_rejected."""
    from droidmesh.services.profiler import handlers
    from droidmesh.services.profiler.state import ProfilerState
    from droidmesh.shared.alarms import alarms
    from droidmesh.shared.mesh.caller import CALLER
    from droidmesh.shared.mesh.config_board import InMemoryConfigBoard
    from droidmesh.shared.mesh.maps_store import InMemoryMapsStore

    async def no_torch(fn, *args):
        raise AssertionError("a refused re-profile ran torch work")

    in_use = _in_use()
    cfg = ProfilerConfig(models=("summ=/no/such/summ", "qa=/no/such/qa"))
    state = ProfilerState(cfg, InMemoryConfigBoard(), InMemoryMapsStore(), no_torch)
    state.keep(in_use)
    before = alarms().get(("profiler.reprofile", "not_an_operator"), 0)

    async def run() -> None:
        CALLER.set("receiver-qa")
        await handlers.reprofile(state, "qa", reprofile())

    with pytest.raises(UnauthorizedError, match="receiver-qa may ask for a re-profile of summ-to-qa"):
        asyncio.run(run())
    assert alarms()[("profiler.reprofile", "not_an_operator")] == before + 1
    assert not state.admission.held and state.newest("summ", "qa") == in_use
