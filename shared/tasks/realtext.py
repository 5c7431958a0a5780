"""The real tier's tasks: rows cut from real text that ships with Python and the OS, nothing generated.

Sources (all read from this machine; nothing downloaded):
  doc_qa       Python's standard library source (PSF License): a module's functions and methods
               rendered as `name(signature)` + docstring, pydoc-style. The question quotes one
               docstring's first sentence; the answer is the name it documents.
  doc_summary  the OS packages' manual pages in /usr/share/man/man1 (each under its package's
               license, see /usr/share/doc/<package>/copyright), roff turned into plain text.
               The context is the page without its NAME section; the reference summary is the
               NAME line's description (what `whatis` prints).
  code_completion/real  Python's standard library source: the lines before a target line, the
               answer is the target line (the zoo's code task, with contexts sized in characters).
Splits are by source, never by row: a module or a manual page lands in test when a hash of its
file name says so (~20 %), so no test context is ever trained on. Rows are deterministic in
(task, split, seed); `length` is the context's length in characters (tokenizers differ).
A third split, `heldout`, draws the Python tasks' rows from the standard library's packages
(`email/`, `asyncio/`, ...: ~80 usable modules), which neither train nor test reads: a verdict that
needs more rows and more independent sources than the ~20 test modules hold is judged there, on
text no fine-tune, profile or plan has seen. Its `source_file` is the path under the library.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import random
import re
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

REAL_TASKS = ("doc_qa", "doc_summary", "code_completion/real")
SPLITS = ("train", "test", "heldout")
HELDOUT_TASKS = ("doc_qa", "code_completion/real")  # the manual pages are all in train or test
MAN_DIR = Path("/usr/share/man/man1")
QA_INPUT = '\n\nQuestion: Which function or method is documented as "{sentence}"?\nAnswer:'
SUMMARY_INPUT = "\n\nQuestion: In a few words, what does the program documented above do?\nAnswer:"
SOURCES = {
    "doc_qa": "Python standard library source, docstrings (PSF License)",
    "doc_summary": "manual pages in /usr/share/man/man1 (each package's license, /usr/share/doc/<pkg>/copyright)",
    "code_completion": "Python standard library source (PSF License)",
}


def split_of(name: str) -> str:
    """'test' for ~20 % of source names (a stable hash), 'train' for the rest."""
    return "test" if int(hashlib.sha1(name.encode()).hexdigest(), 16) % 5 == 0 else "train"


def make_real_rows(task: str, split: str, n: int, *, chars: tuple[int, int] = (3500, 6000), seed: int = 0
                   ) -> list[dict[str, Any]]:
    """`n` rows of a real-text task for `split`, contexts of `chars` characters (~1-1.6K SmolLM2 tokens)."""
    if task not in REAL_TASKS:
        raise ValueError(f"unknown real-text task {task!r}; expected one of {list(REAL_TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    if split == "heldout" and task not in HELDOUT_TASKS:
        raise ValueError(f"{task} has no heldout sources; the tasks that do: {list(HELDOUT_TASKS)}")
    rng = random.Random(f"real/{task}/{split}/{seed}")
    make = {"doc_qa": _qa_row, "doc_summary": _summary_row, "code_completion/real": _code_row}[task]
    rows: list[dict[str, Any]] = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 100:
            raise RuntimeError(f"{task}/{split}: too few usable sources for {n} rows")
        row = make(rng, split, rng.randint(*chars))
        if row is not None and all(row["context"] != r["context"] or row["input"] != r["input"] for r in rows):
            row.update(task=task, split=split, length=len(row["context"]), _id=f"{task}-{split}-{len(rows)}",
                       source=SOURCES[task.split("/")[0]])
            rows.append(row)
    return rows


# -- Python docstrings --------------------------------------------------------------------------
@lru_cache(maxsize=1)
def stdlib_modules() -> dict[str, tuple[str, ...]]:
    """The zoo's split of the stdlib's top-level modules (`suite.stdlib_files`: the same hash rule
    as `split_of`), and as `heldout` every module of its packages (no tests, no site-packages)."""
    from droidmesh.shared.tasks.suite import stdlib_files

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    heldout = [str(p) for p in sorted(root.glob("*/**/*.py"))
               if not skip & set(p.relative_to(root).parts) and not p.relative_to(root).parts[0].startswith("config-")
               and p.stat().st_size >= 4000]
    return {**stdlib_files(), "heldout": tuple(heldout)}


def _source_name(path: str, split: str) -> str:
    """A row's `source_file`: the file name (top-level modules are unique by it), or under
    `heldout` the path below the library (`email/utils.py` and `urllib/parse.py`, not `utils.py`)."""
    if split != "heldout":
        return Path(path).name
    return Path(path).relative_to(sysconfig.get_paths()["stdlib"]).as_posix()


@lru_cache(maxsize=256)
def _doc_entries(path: str) -> tuple[tuple[str, str, str], ...]:
    """(qualified name, rendered entry, first sentence) for each documented public def, in file order."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return ()
    out = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and not prefix:
                visit(node.body, node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                first = " ".join(doc.strip().split("\n\n")[0].split())
                first = first.split(". ")[0].rstrip(".")
                if len(first.split()) < 4 or '"' in first or len(first) > 160:
                    continue
                body_text = "\n".join("    " + line for line in doc.strip().splitlines())
                out.append((prefix + node.name, f"{prefix}{node.name}({ast.unparse(node.args)})\n{body_text}\n", first))

    visit(tree.body, "")
    return tuple(out)


def _qa_row(rng: random.Random, split: str, budget: int) -> dict[str, Any] | None:
    path = rng.choice(stdlib_modules()[split])
    entries = _doc_entries(path)
    firsts = [e[2] for e in entries]
    usable = [i for i, e in enumerate(entries) if firsts.count(e[2]) == 1]
    if len(entries) < 6 or not usable:
        return None
    target = rng.choice(usable)
    # a window of consecutive entries holding the target, grown until the budget is spent
    lo = hi = target
    size = len(entries[target][1])
    while size < budget and (lo > 0 or hi < len(entries) - 1):
        if hi < len(entries) - 1 and (lo == 0 or rng.random() < 0.5):
            hi += 1
            size += len(entries[hi][1]) + 1
        else:
            lo -= 1
            size += len(entries[lo][1]) + 1
    if size < budget // 2:
        return None
    module = _source_name(path, split).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    header = f"Help on module {module}:\n\n"
    context = header + "\n".join(e[1] for e in entries[lo : hi + 1])
    name, _, sentence = entries[target]
    return {"context": context, "input": QA_INPUT.format(sentence=sentence), "answers": [name],
            "source_file": _source_name(path, split)}


# -- manual pages -------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def man_pages() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {"train": [], "test": []}
    if MAN_DIR.is_dir():
        for p in sorted(MAN_DIR.glob("*.1.gz")):
            if 2500 <= p.stat().st_size <= 40000:
                out[split_of(p.name)].append(str(p))
    return {k: tuple(v) for k, v in out.items()}


_FONT = re.compile(r"\\f(\(..|\[[^]]*\]|.)")
_NAMED = {r"\-": "-", r"\(em": "--", r"\(en": "-", r"\(aq": "'", r"\(dq": '"', r"\(bu": "*", r"\e": "\\",
          r"\&": "", r"\ ": " ", r"\|": "", r"\^": "", r"\(lq": '"', r"\(rq": '"', r"\(oq": "'", r"\(cq": "'"}
_ESCAPE = re.compile(r"\\(\(..|\[[^]]*\]|\*\(..|\*.|[a-zA-Z])")


def _inline(text: str) -> str:
    text = _FONT.sub("", text)
    for k, v in _NAMED.items():
        text = text.replace(k, v)
    return _ESCAPE.sub("", text).replace('"', "") if text.startswith(".") else _ESCAPE.sub("", text)


@lru_cache(maxsize=512)
def _man_text(path: str) -> tuple[str, str] | None:
    """(plain text without the NAME section, the NAME line's description), or None when the
    page is not classic man(7) roff with a `name \\- description` NAME line."""
    try:
        raw = gzip.decompress(Path(path).read_bytes()).decode("utf-8", errors="replace")
    except (OSError, EOFError):
        return None
    if ".TH" not in raw or ".SH NAME" not in raw.upper():
        return None
    out: list[str] = []
    section, name_lines = "", []
    for line in raw.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\\\"')):
            continue
        if line.startswith(".SH"):
            section = _inline(line[3:].strip().strip('"')).upper()
            if section != "NAME":
                out.append("\n" + section)
            continue
        if line.startswith("."):
            macro, _, rest = line[1:].partition(" ")
            if macro in ("B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB"):
                text = " ".join(w.strip('"') for w in rest.split()) if macro in ("B", "I", "SM", "SB") else "".join(
                    w.strip('"') for w in rest.split())
            elif macro in ("PP", "P", "LP", "TP", "IP", "sp", "br", "SS"):
                text = "\n" + (_inline(rest.strip('"')) if macro in ("SS", "IP") and rest else "")
            else:
                continue
            line = text
        text = _inline(line)
        if section == "NAME":
            name_lines.append(text)
        elif section:
            out.append(text)
    name = " ".join(" ".join(name_lines).split())
    if " - " not in name:
        return None
    desc = name.split(" - ", 1)[1].strip().rstrip(".")
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()
    if len(desc.split()) < 2 or len(body) < 1500:
        return None
    return body, desc


def _summary_row(rng: random.Random, split: str, budget: int) -> dict[str, Any] | None:
    pages = man_pages()[split]
    if not pages:
        return None
    path = rng.choice(pages)
    got = _man_text(path)
    if got is None:
        return None
    body, desc = got
    context = body[:budget].rsplit("\n", 1)[0] if len(body) > budget else body
    return {"context": context, "input": SUMMARY_INPUT, "answers": [desc], "source_file": Path(path).name}


# -- code ----------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def _code_files(split: str) -> tuple[str, ...]:
    """The modules code rows are cut from: under `heldout`, not the generated tables (`encodings/`'s
    ~80 near-identical codec maps, `pydoc_data/`), which would be most of its rows and count as
    independent sources. (doc_qa draws from every module: those hold no documented functions.)"""
    pool = stdlib_modules()[split]
    if split != "heldout":
        return pool
    return tuple(p for p in pool if not {"encodings", "pydoc_data"} & set(Path(p).parts))


def _code_row(rng: random.Random, split: str, budget: int) -> dict[str, Any] | None:
    path = rng.choice(_code_files(split))
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    if len(lines) < 80:
        return None
    j = rng.randrange(60, len(lines))
    target = lines[j]
    if len(target.strip()) < 8 or target.strip().startswith("#"):
        return None
    ctx_lines: list[str] = []
    size = 0
    for line in reversed(lines[:j]):
        if size + len(line) + 1 > budget:
            break
        ctx_lines.append(line)
        size += len(line) + 1
    if size < budget // 2:
        return None
    return {"context": "\n".join(reversed(ctx_lines)) + "\n", "input": "", "answers": [target],
            "source_file": _source_name(path, split)}
