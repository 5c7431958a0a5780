"""The task suite: LongBench-style rows for each zoo task, plus how a row becomes token ids.

Tasks (name -> metric):
  multihop_qa    f1        multi-document contexts; the question names an entity by its alias
                           (hop 1: alias -> entity, hop 2: entity -> its fact in some document),
                           and a `coded` context header means every written value is in the
                           receiver's code (the answer is the decoded value).
  summarization  rouge_l   list the documents' titles in order (an extractive "summary").
  code_completion edit_sim real stdlib source: the context is a file's lines before a target
                           line; the answer is the target line.
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

from shared.zoo import vocab as V
from shared.zoo.tasks import ALIAS_OF, make_context
from shared.zoo.tokenizer import WordIds


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    metric: str
    max_new_tokens: int
    stop: str | None      # generation text is cut at the first occurrence
    joiner: str           # text between prompt and answer when the answer is tokenized in place


TASKS: dict[str, TaskSpec] = {
    # single-word answers (an entity's attribute): one generated token
    "multihop_qa": TaskSpec("multihop_qa", "f1", 1, " .", " "),
    "summarization": TaskSpec("summarization", "rouge_l", 8, " end", " "),
    # no stop string: the metric takes the first comment-free line (LongBench)
    "code_completion": TaskSpec("code_completion", "edit_sim", 24, None, ""),
}
GENERIC = TaskSpec("custom", "f1", 16, "\n", " ")


def task_spec(name: str) -> TaskSpec:
    """The spec of a zoo task or of one of its shifts ("<task>/<shift>"), else a generic one."""
    return TASKS.get(name.split("/", 1)[0], dataclasses.replace(GENERIC, name=name))


@dataclasses.dataclass(frozen=True)
class SuiteShape:
    """Context shape of a tier's benchmark rows."""

    facts: tuple[int, int] = (8, 16)
    docs: tuple[int, int] = (3, 5)
    filler: tuple[int, int] = (850, 950)
    coded_frac: float = 0.5
    code_tokens: int = 1000


# Shifted suites of a task, named "<task>/<shift>": data the task's profile was not made on, to
# check that a config chosen on the train split transfers (DroidSpeak §5.4 profiles on one
# dataset and applies the result to others). Fields not used by a task (coded_frac outside
# multihop_qa, the context shape for code) leave that task unchanged, so only listed ones apply.
_SHORT = {"facts": (2, 6), "docs": (1, 3), "filler": (150, 250)}  # ~0.3K tokens
_LONG = {"facts": (12, 16), "docs": (4, 6), "filler": (1800, 1900)}  # ~2K: twice the profiled length
SHIFTS: dict[str, dict[str, dict[str, Any]]] = {
    "multihop_qa": {
        "plain": {"coded_frac": 0.0},  # no coded document: what the sender's KV lacks is never needed
        "coded": {"coded_frac": 1.0},  # every document coded: the receiver's change always matters
        "short": _SHORT,
        "long": _LONG,
    },
    "summarization": {"short": _SHORT, "long": _LONG},
    "code_completion": {"short": {"code_tokens": 300}, "long": {"code_tokens": 2000}},
}


def known_tasks() -> list[str]:
    """Zoo tasks and their shifts, in a stable order."""
    return [*TASKS, *(f"{t}/{s}" for t, shifts in SHIFTS.items() for s in shifts)]


def shifts_of(task: str) -> list[str]:
    return [f"{task}/{s}" for s in SHIFTS.get(task, {})]


def _split_seed(task: str, split: str, seed: int) -> random.Random:
    # Disjoint streams per (task, split): train and test never share a generated context.
    return random.Random(f"suite/{task}/{split}/{seed}")


def make_rows(task: str, split: str, n: int, shape: SuiteShape, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows of `task` (or a shift "<task>/<shift>") for `split` (train/test), deterministic
    in (task, split, seed)."""
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


# -- rows -> ids -------------------------------------------------------------------------------
def encode_row(ids: WordIds | Any, row: dict[str, Any], spec: TaskSpec) -> tuple[list[int], list[int], list[int]]:
    """(context ids with <bos>, question ids, gold answer ids) for a row.

    The answer is tokenized in place (prompt text + joiner + answer, minus the prompt's ids)
    so that e.g. a code line keeps its exact indentation tokens."""
    tok = _Tok(ids)
    ctx = [tok.bos] + tok.encode(row["context"])
    q = tok.encode(row["input"]) if row["input"].strip() else []
    prompt_text = row["context"] + (" " + row["input"] if q else "")
    base = tok.encode(prompt_text)
    full = tok.encode(prompt_text + spec.joiner + row["answers"][0])
    ans = full[len(base):] if full[: len(base)] == base else tok.encode(row["answers"][0])
    return ctx, q, ans


class _Tok:
    """Uniform view over a zoo `WordIds` or any HF tokenizer (user checkpoints)."""

    def __init__(self, t: Any) -> None:
        self.t = t
        if isinstance(t, WordIds):
            self.bos = t.bos
            self.encode = t.encode_text
        else:
            self.bos = t.bos_token_id if t.bos_token_id is not None else t.eos_token_id
            self.encode = lambda s: t(s, add_special_tokens=False)["input_ids"]


def decode_answer(tokenizer: Any, token_ids: list[int], spec: TaskSpec) -> str:
    """Generated ids -> answer text, cut at the task's stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if spec.stop and spec.stop in text:
        text = text[: text.index(spec.stop)]
    return text.strip() if spec.name != "code_completion" else text.lstrip("\n")
