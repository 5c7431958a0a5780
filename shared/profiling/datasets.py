"""A profile's rows: the zoo's generated splits or a user's JSONL (one file split in two, or one
per split), and the robustness data sets the chosen config is checked on besides the test split.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import BadRequestError


def split_rows(rows: list[dict[str, Any]], split: str, test_fraction: float = 0.5) -> list[dict[str, Any]]:
    """One dataset as train and test: a fixed shuffle of the row indices (seeded by the row
    count, so a file always splits the same way) puts `test_fraction` of them (at least one,
    never all) in test; each split keeps the file's order."""
    if len(rows) < 2:
        raise BadRequestError(f"--data needs at least 2 rows to split into train and test, got {len(rows)}")
    order = list(range(len(rows)))
    random.Random(f"droidmesh-split/{len(rows)}").shuffle(order)
    n_test = min(len(rows) - 1, max(1, round(test_fraction * len(rows))))
    test = set(order[:n_test])
    return [r for i, r in enumerate(rows) if (i in test) == (split == "test")]


def load_rows(task: str, split: str, n: int, data: str | None = None, shape: Any = None, *,
              split_data: bool = False) -> list[dict[str, Any]]:
    """The first `n` rows (all when `n` is 0) of a user JSONL file (`data`; with `split_data`,
    its `split` half, see `split_rows`), or of the zoo's generated `task` split."""
    from droidmesh.shared.tasks.jsonl import read_jsonl
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    if data:
        rows = read_jsonl(data)
        rows = split_rows(rows, split) if split_data else rows
        return rows[:n] if n else rows
    return make_rows(task, split, n, shape or SuiteShape())


def is_jsonl_path(name: str) -> bool:
    """A robustness data set given as a file rather than as a zoo task name."""
    return name.endswith(".jsonl") or Path(name).is_file()


def robustness_tasks(task: str, other_tasks: Sequence[str] | None, *, user_data: bool) -> list[str]:
    """The data sets the chosen config is checked on besides the task's test split: `other_tasks`
    as given (None: the zoo task's shifts and every other zoo task, none for a user's rows), each a
    zoo task or an existing JSONL file, else a BadRequestError before any model loads."""
    from droidmesh.shared.tasks.spec import TASKS, known_tasks, shifts_of

    if other_tasks is None:
        other_tasks = [*shifts_of(task), *(t for t in TASKS if t != task)] if task in TASKS and not user_data else []
    other_tasks = [t for t in other_tasks if t != task]
    unknown = [t for t in other_tasks if t not in known_tasks() and not is_jsonl_path(t)]
    if unknown:
        raise BadRequestError(f"robustness tasks {unknown} are neither zoo tasks ({known_tasks()}) nor JSONL files")
    missing = [t for t in other_tasks if t not in known_tasks() and not Path(t).is_file()]
    if missing:
        raise BadRequestError(f"robustness data {missing}: no such file")
    return other_tasks


def robustness_rows(other_tasks: list[str], n: int, overrides: dict[str, Any]) -> dict[str, tuple[list[dict[str, Any]], Any]]:
    """Each robustness data set's test rows and spec: a zoo task's own, a user's file scored like
    the profiled data (`overrides`)."""
    from droidmesh.shared.tasks.spec import known_tasks, task_spec

    return {t: (load_rows(t, "test", n), task_spec(t)) if t in known_tasks()
            else (load_rows(t, "test", n, t), task_spec(Path(t).stem, **overrides)) for t in other_tasks}
