"""Task specs: the metric, the answer budget and the stop strings of each task.

Tasks the zoo generates (name -> metric):
  multihop_qa     f1        single-word answers (an entity's attribute): one generated token
  summarization   rouge_l   the documents' titles in order, closed by " end"
  code_completion edit_sim  the line after the context; no stop string: the metric takes the
                            first comment-free line (LongBench)
  fact_lookup     f1        `ask <key>` -> the key's value in the context: what every pretrained
                            zoo model does (the family tier's translated pairs are scored on it)
Tasks of the real tier (real text, `shared.tasks.realtext`):
  doc_qa          f1        which function a quoted docstring sentence documents; one line
  doc_summary     rouge_l   a manual page's NAME description (what `whatis` prints); one line
A shift "<task>/<shift>" is the same task on data of another shape (`SHIFTS`: the fields of the
zoo's `SuiteShape` it overrides); it scores like its task. Any other name (a user's JSONL) gets
the generic spec, whose fields the command line may override.
"""

from __future__ import annotations

import dataclasses
from typing import Any

METRIC_NAMES = ("f1", "rouge_l", "edit_sim")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    metric: str
    max_new_tokens: int
    stop: tuple[str, ...]  # the answer text is cut at the first occurrence of any of these
    joiner: str            # text between prompt and answer when the answer is tokenized in place


TASKS: dict[str, TaskSpec] = {
    "multihop_qa": TaskSpec("multihop_qa", "f1", 1, (" .",), " "),
    "summarization": TaskSpec("summarization", "rouge_l", 8, (" end",), " "),
    "code_completion": TaskSpec("code_completion", "edit_sim", 24, (), ""),
    "fact_lookup": TaskSpec("fact_lookup", "f1", 1, (" .",), " "),
    "doc_qa": TaskSpec("doc_qa", "f1", 12, ("\n",), " "),
    "doc_summary": TaskSpec("doc_summary", "rouge_l", 20, ("\n",), " "),
}
GENERIC = TaskSpec("custom", "f1", 16, ("\n",), " ")

# Shifted suites of a task, named "<task>/<shift>": data the task's profile was not made on, to
# check that a config chosen on the train split transfers (a pair is profiled on one
# dataset and applies the result to others). Each entry overrides fields of the zoo's
# `SuiteShape`; fields a task does not use (coded_frac outside multihop_qa, the context shape
# for code) leave that task unchanged, so only listed ones apply.
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
    "code_completion": {"short": {"code_tokens": 300}, "long": {"code_tokens": 2000},
                        "real": {}},  # the real tier's rows (`shared.tasks.realtext`), contexts sized in characters
}


def task_spec(name: str, *, metric: str | None = None, max_new_tokens: int | None = None,
              stop: tuple[str, ...] | None = None) -> TaskSpec:
    """The spec of a zoo task or of one of its shifts, else the generic one named `name`; a
    given metric / answer budget / stop strings replace the spec's."""
    spec = TASKS.get(name.split("/", 1)[0], dataclasses.replace(GENERIC, name=name))
    if metric is not None and metric not in METRIC_NAMES:
        raise ValueError(f"unknown metric {metric!r}; expected one of {list(METRIC_NAMES)}")
    changes: dict[str, Any] = {"metric": metric, "max_new_tokens": max_new_tokens, "stop": stop}
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})


def known_tasks() -> list[str]:
    """Zoo tasks and their shifts, in a stable order."""
    return [*TASKS, *(f"{t}/{s}" for t, shifts in SHIFTS.items() for s in shifts)]


def shifts_of(task: str) -> list[str]:
    return [f"{task}/{s}" for s in SHIFTS.get(task, {})]
