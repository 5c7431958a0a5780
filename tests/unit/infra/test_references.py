"""Every module the code and the docs name exists: a path (`shared/kv/pool.py`, `services/receiver/`)
or a dotted name (`droidmesh.shared.kv.pool`, or `shared.kv.pool.KVPool` in backticks: a module,
then attributes). A move that leaves a docstring or a page pointing at the old place fails here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its planted names are meant to be stale
SUFFIXES = (".py", ".md", ".sh", ".yml", ".yaml", ".toml")
PATH = re.compile(r"(?<![\w./-])((?:shared|services)/[\w/]*\w(?:\.py)?/?)")
DOTTED = re.compile(r"(?:droidmesh\.|(?<=`))((?:shared|services)\.[a-z_][\w.]*\w)")


def _texts() -> list[tuple[str, str]]:
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [(n, (ROOT / n).read_text()) for n in names
            if n.endswith(SUFFIXES) and not n.startswith("zoo/") and (ROOT / n).is_file() and n != THIS]


def _path_exists(ref: str) -> bool:
    p = ROOT / ref.rstrip("/")
    return p.exists() or p.with_suffix(".py").exists()


def _dotted_exists(ref: str) -> bool:
    """The longest prefix that is a folder or module: a module may be followed by attributes, a
    package by a name its `__init__.py` defines or exports (else the name is a module not there)."""
    parts = ref.split(".")
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        if base.with_suffix(".py").is_file():
            return True
        if base.is_dir():
            if k == len(parts) or parts[k].startswith("__"):
                return True
            init = base / "__init__.py"
            return init.is_file() and re.search(rf"\b{re.escape(parts[k])}\b", init.read_text()) is not None
    return False


def stale(texts: list[tuple[str, str]]) -> list[str]:
    found = []
    for name, text in texts:
        for rx, exists in ((PATH, _path_exists), (DOTTED, _dotted_exists)):
            for m in rx.finditer(text):
                if not exists(m.group(1)) and "__pycache__" not in m.group(1):
                    found.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}")
    return found


def test_every_named_module_exists() -> None:
    assert stale(_texts()) == []


def test_a_stale_name_is_found() -> None:
    planted = [("a.py", '"""See `shared/kv/nowhere.py` and `shared.kv.pool.KVPool`, `shared.kv.gone.X`."""'),
               ("b.md", "droidmesh.shared.bench.output and shared/kv/pool.py and services/receiver/")]
    assert stale(planted) == ["a.py:1: shared/kv/nowhere.py", "a.py:1: shared.kv.gone.X",
                              "b.md:1: shared.bench.output"]
