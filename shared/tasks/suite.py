"""The zoo's task data: LongBench-style rows generated for each zoo task and its shifts
(the specs, metrics and scoring are `shared.tasks`').

Tasks:
  multihop_qa     multi-document contexts; the question names an entity by its alias (hop 1:
                  alias -> entity, hop 2: entity -> its fact in some document), and a `coded`
                  context header means every written value is in the receiver's code (the
                  answer is the decoded value).
  summarization   list the documents' titles in order (an extractive "summary").
  code_completion real stdlib source: the context is a file's lines before a target line; the
                  answer is the target line.
Rows carry `task`, `split`, `length` (context tokens) and `_id` beside context/input/answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.tasks.spec import SHIFTS, TASKS, known_tasks
from droidmesh.shared.tasks.synthetic import ALIAS_OF, make_context


@dataclasses.dataclass(frozen=True)
class SuiteShape:
    """Context shape of a tier's benchmark rows."""

    facts: tuple[int, int] = (8, 16)
    docs: tuple[int, int] = (3, 5)
    filler: tuple[int, int] = (850, 950)
    coded_frac: float = 0.5
    code_tokens: int = 1000


def _split_seed(task: str, split: str, seed: int) -> random.Random:
    # Disjoint streams per (task, split): train and test never share a generated context.
    return random.Random(f"suite/{task}/{split}/{seed}")


def make_rows(task: str, split: str, n: int, shape: SuiteShape, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows of `task` (or a shift "<task>/<shift>") for `split` (train/test), deterministic
    in (task, split, seed)."""
    from droidmesh.shared.tasks.realtext import REAL_TASKS, make_real_rows

    if task in REAL_TASKS:  # the real tier's tasks: cut from real text, not shaped by a tier
        return make_real_rows(task, split, n, seed=seed)
    if split not in ("train", "test"):  # `heldout` is a pool of real sources; generated rows have none
        raise ValueError(f"split {split!r}: the generated tasks have train and test only")
    rng = _split_seed(task, split, seed)
    name = task
    if "/" in task:
        task, shift = task.split("/", 1)
        if shift not in SHIFTS.get(task, {}):
            raise ValueError(f"unknown zoo task {name!r}; expected one of {known_tasks()}")
        shape = dataclasses.replace(shape, **SHIFTS[task][shift])
    if task == "code_completion":
        return [code_row(rng, split, shape.code_tokens, i, name) for i in range(n)]
    rows = []
    for i in range(n):
        header = V.CODED if (task == "multihop_qa" and rng.random() < shape.coded_frac) else V.PLAIN
        ctx = make_context(rng, rng.randint(*shape.facts), rng.randint(*shape.docs), rng.randint(*shape.filler), header)
        if task == "multihop_qa":
            key = rng.choice(list(ctx.facts))
            inp, answers = f"{V.WHO} {ALIAS_OF[key]}", [ctx.true_value(key)]
        elif task == "fact_lookup":
            key = rng.choice(list(ctx.facts))
            inp, answers = f"{V.ASK} {key}", [ctx.true_value(key)]
        elif task == "summarization":
            inp, answers = V.TITLES_Q, [" ".join(ctx.titles)]
        else:
            raise ValueError(f"unknown zoo task {task!r}; expected one of {sorted(TASKS)}")
        rows.append({
            "context": " ".join(ctx.words), "input": inp, "answers": answers, "task": name,
            "split": split, "length": len(ctx.words) + 1, "header": header, "_id": f"{name}-{split}-{i}",
        })
    return rows


# -- code --------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def stdlib_files() -> dict[str, tuple[str, ...]]:
    """Top-level stdlib modules split by a hash of the file name: ~20% test, the rest train."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[str]] = {"train": [], "test": []}
    for p in sorted(root.glob("*.py")):
        if p.stat().st_size < 4000:
            continue
        h = int(hashlib.sha1(p.name.encode()).hexdigest(), 16)
        out["test" if h % 5 == 0 else "train"].append(str(p))
    return {k: tuple(v) for k, v in out.items()}


@lru_cache(maxsize=256)
def _lines(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8", errors="replace").split("\n"))


def code_row(rng: random.Random, split: str, budget_tokens: int, i: int, name: str = "code_completion") -> dict[str, Any]:
    """Context: the lines before a target line (about `budget_tokens` tokens, ~1.3 chars each)."""
    files = stdlib_files()[split]
    while True:
        path = rng.choice(files)
        lines = _lines(path)
        if len(lines) < 60:
            continue
        j = rng.randrange(40, len(lines))
        target = lines[j]
        if len(target.strip()) < 8 or target.strip().startswith("#"):
            continue
        start, chars = j, 0
        while start > 0 and chars + len(lines[start - 1]) + 1 < budget_tokens * 1.3:
            start -= 1
            chars += len(lines[start]) + 1
        context = "\n".join(lines[start:j]) + "\n"
        return {
            "context": context, "input": "", "answers": [target], "task": name, "split": split,
            "length": chars, "source": Path(path).name, "line": j + 1, "_id": f"{name}-{split}-{i}",
        }
