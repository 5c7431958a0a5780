"""Modules and functions stay small enough to read: no module of `shared/` or `services/` over
400 lines, no function or method over 60 (its `def` to its last line, decorators aside). A part
that outgrows them is split along its seams, not waived here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(p for top in ("shared", "services") for p in (ROOT / top).rglob("*.py"))


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function in `source` over the limit."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_module_over_the_limit() -> None:
    over = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert over == {}


def test_no_function_over_the_limit() -> None:
    over = {f"{p.relative_to(ROOT)}:{name}": n for p in _modules() for name, n in long_functions(p.read_text())}
    assert over == {}


def test_the_function_check_counts_what_it_should() -> None:
    def body(n: int) -> str:
        return "\n".join(f"    x{i} = {i}" for i in range(n))

    at_limit = f"def ok():\n{body(MAX_FUNCTION_LINES - 1)}\n"  # the def line and 59 more: 60
    over = f"class C:\n    async def long(self):\n    {body(MAX_FUNCTION_LINES).replace(chr(10), chr(10) + '    ')}\n"
    assert long_functions(at_limit) == []
    assert long_functions(at_limit + over) == [("long", MAX_FUNCTION_LINES + 1)]
