"""What a profile request may ask, by who asks: pure checks the handlers run before any work.

Two requesters, told apart by the subject a request came in on (NATS permissions let only users
receiver-<model> and admin publish on `profiler_reprofile(model)`, only admin on `PROFILER_PROFILE`):

* a drift re-profile: calibration rows only (bounded in count and bytes; any of the searches, with
  or without a cap on the group's layers) for one of the model's own pairs, its models named by
  the ids this profiler maps, at the tolerance of the pair's current config (`check_same_rule`).
  No data files, robustness files, version, relay buckets, transfer search or exhaustive search:
  the profiler picks the version (`next_version`) and keeps the relay buckets of the pair's
  current config. It is run and published only when an
  operator sent it (`check_reprofiler`); the receivers' own (their quality watch) is refused and
  recorded for operators, so a receiver identity cannot switch a pair's plan.
* an operator's profile: may also name data files (read under the data root only, see
  `datafiles`), relay buckets and a version, but never one far ahead of this profiler's clock.
"""

from __future__ import annotations

import dataclasses

from droidmesh.shared.errors import BadRequestError, UnauthorizedError
from droidmesh.shared.mesh.config_board import MAX_RELAY_BUCKETS
from droidmesh.shared.profiling import fidelity
from droidmesh.shared.profiling.profile import SEARCHES, ProfileSettings, check_max_layers
from droidmesh.shared.wire import schemas

# Versions are unix seconds: one further ahead than this would outrank every config published
# until the clock catches up. A few seconds of skew between profilers' clocks are normal.
MAX_VERSION_AHEAD_S = 300.0
MAX_GRANULARITY = 64
MAX_LAYERS = 1024  # a cap on the group's layers above any model's depth caps nothing
MAX_OTHER_TASKS = 16
MAX_NAME_CHARS = 256  # a task name, a request id: logged and published, never long
OPERATORS = frozenset({"admin"})  # the roster's operator login (`shared/mesh/nats_auth.py`)


@dataclasses.dataclass(frozen=True)
class Requester:
    """Who holds a place in the profiler's queue: operators (one requester), or the receivers of
    one model. `name` is what per-requester limits count and logs show."""

    name: str
    operator: bool


OPERATOR = Requester("operator", operator=True)


def receiver(model_id: str) -> Requester:
    return Requester(f"receivers of {model_id}", operator=False)


def settings(req: schemas.ProfileRequest) -> ProfileSettings:
    """The profile a checked request runs. require_signal off: the drift bench and this service's
    system tests profile the ci tier's untrained models (full prefill scores 0 there); a request
    cannot ask for the check (it would be a field)."""
    return ProfileSettings(granularity=req.granularity, tolerance=req.tolerance, exhaustive=req.exhaustive,
                           search=req.search, require_signal=False,
                           fidelity=fidelity.Settings(max_layers=req.max_layers))


def rows_bytes(rows: list[schemas.ProfileRow]) -> int:
    """The UTF-8 bytes of the rows' text (what the profiler writes out and scores)."""
    return sum(len(r.context.encode()) + len(r.input.encode()) + sum(len(a.encode()) for a in r.answers) for r in rows)


def check_common(req: schemas.ProfileRequest, max_rows: int, max_rows_bytes: int) -> None:
    """Bounds every request keeps, whoever asks."""
    for name in ("n_train", "n_test"):
        n = getattr(req, name)
        if not 1 <= n <= max_rows:
            raise BadRequestError(f"{name}={n} outside 1..{max_rows}")
    if not 1 <= req.granularity <= MAX_GRANULARITY or not 0 <= req.tolerance < 1:
        raise BadRequestError(f"granularity must be in 1..{MAX_GRANULARITY} and tolerance in [0, 1)")
    if req.search not in SEARCHES:
        raise BadRequestError(f"search {req.search[:MAX_NAME_CHARS]!r}: one of {', '.join(SEARCHES)}")
    if req.max_layers is not None and not 1 <= req.max_layers <= MAX_LAYERS:
        raise BadRequestError(f"max_layers={req.max_layers} outside 1..{MAX_LAYERS}")
    check_max_layers(settings(req))
    if not 0 < len(req.task) <= MAX_NAME_CHARS or len(req.request_id) > MAX_NAME_CHARS:
        raise BadRequestError(f"task must be 1..{MAX_NAME_CHARS} characters, request_id at most {MAX_NAME_CHARS}")
    if req.rows and not 2 <= len(req.rows) <= max_rows:
        raise BadRequestError(f"{len(req.rows)} rows outside 2..{max_rows} (split in two: train and test)")
    if any(not r.answers for r in req.rows):
        raise BadRequestError("every row needs at least one reference answer")
    size = rows_bytes(req.rows)
    if size > max_rows_bytes:
        raise BadRequestError(f"rows hold {size} bytes of text, over the cap of {max_rows_bytes}")


def check_operator(req: schemas.ProfileRequest, max_rows: int, max_rows_bytes: int, now: float) -> None:
    """An operator's request: the common bounds, rows or data files (not both), a bounded list of
    robustness tasks, relay buckets the board would take, no version far ahead of `now`."""
    check_common(req, max_rows, max_rows_bytes)
    if req.rows and (req.data_train or req.data_test):
        raise BadRequestError("give either rows or data files")
    if req.other_tasks is not None and len(req.other_tasks) > MAX_OTHER_TASKS:
        raise BadRequestError(f"{len(req.other_tasks)} robustness tasks, over the cap of {MAX_OTHER_TASKS}")
    if len(req.relay) > MAX_RELAY_BUCKETS:
        raise BadRequestError(f"{len(req.relay)} relay buckets, over the cap of {MAX_RELAY_BUCKETS}")
    if req.version < 0 or req.version > now + MAX_VERSION_AHEAD_S:
        raise BadRequestError(f"version {req.version} is negative or more than {MAX_VERSION_AHEAD_S:.0f} s ahead of this "
                              "profiler's clock (versions are unix seconds; 0: the profiler picks one)")


def check_receiver(req: schemas.ProfileRequest, model_id: str, model_ids: set[str], max_rows: int,
                   max_rows_bytes: int) -> None:
    """A re-profile from the receivers of `model_id`: the common bounds within `max_rows` rows,
    rows and nothing a receiver could use to make the profiler read, rank or publish for it."""
    check_common(req, max_rows, max_rows_bytes)
    operators_only = [name for name, asked in (
        ("data_train", req.data_train is not None), ("data_test", req.data_test is not None),
        ("other_tasks", bool(req.other_tasks)), ("version", req.version != 0), ("relay", bool(req.relay)),
        ("transfer", req.transfer), ("exhaustive", req.exhaustive)) if asked]
    if operators_only:
        raise BadRequestError(f"a receiver's re-profile carries calibration rows only: {', '.join(operators_only)} "
                              "is for operators")
    if len(req.rows) < 2:
        raise BadRequestError("a receiver's re-profile carries at least 2 calibration rows")
    if req.receiver_path != model_id or req.receiver_model not in ("", model_id):
        raise BadRequestError(f"the receivers of {model_id} re-profile their own pairs: receiver_path and "
                              f"receiver_model must be {model_id!r}")
    if req.sender_path not in model_ids or req.sender_model not in ("", req.sender_path):
        raise BadRequestError("sender_path must be a model id this profiler maps (its models setting), and "
                              "sender_model empty or that id")


def check_paired(newest: schemas.RecomputeConfig | None, sender_model: str, receiver_model: str
                 ) -> schemas.RecomputeConfig:
    """A receiver re-profiles only a pair that already has a config: publishing one for a new pair
    would make it a reader of that sender's cache (a config names the pair), which only an
    operator's profile may do."""
    if newest is None:
        raise BadRequestError(f"no config for {sender_model} -> {receiver_model}: receivers re-profile only pairs an "
                              "operator profiled")
    return newest


def check_same_rule(newest: schemas.RecomputeConfig, req: schemas.ProfileRequest) -> None:
    """A re-profile is judged by the rule the pair's config in use was published under: its
    tolerance (what the receiver's quality watch sends). Another would move the test split's
    check itself (at 0.99 every plan passes); an operator sets one on `PROFILER_PROFILE`."""
    if req.tolerance != newest.tolerance:
        raise BadRequestError(f"tolerance {req.tolerance:g}: a re-profile keeps the tolerance of the pair's config in "
                              f"use ({newest.tolerance:g})")


def check_reprofiler(caller: str, pair: str) -> None:
    """A re-profile is published only when an operator asked: `caller`, the NATS user behind the
    request (`shared/mesh/caller.py`), must be one of `OPERATORS`. A receiver's login may ask (its
    quality watch), and is told no, so that its rows cannot choose the plan its own pair runs. On
    a server without users the caller is "" for everyone: nobody can be told apart, and the
    request is served as every request there is."""
    if caller and caller not in OPERATORS:
        raise UnauthorizedError(f"NATS user {caller} may ask for a re-profile of {pair}, not have one published: the "
                                "request is recorded for operators (profiler log reprofile_wanted); the pair keeps its "
                                "config until an operator publishes another")


def next_version(newest: int | None, now: float) -> int:
    """The version of a config the profiler publishes for a pair whose newest one is `newest`:
    unix seconds, above `newest` (so it outranks it), never far ahead of `now`."""
    version = max(int(now), (newest or 0) + 1)
    if version > now + MAX_VERSION_AHEAD_S:
        raise BadRequestError(f"the pair's newest config (version {newest}) is ahead of this profiler's clock; a newer "
                              "one would be too: an operator must retire it first")
    return version
