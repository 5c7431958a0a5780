"""Every exact comparison of tensors in the tests says why it is exact.

Two computations of the same values agree to the bit only when they run the same kernels on the
same shapes; padded, batched or otherwise reshaped work rounds differently on another CPU or GPU
(`tests/numeric.py`). So an exact comparison in a test is either of copied bytes or of a
computation that is the same by design, and the statement making it carries a mark saying which,
on one of its lines or on a comment line right above it:

    assert torch.equal(got, sent)  # bitwise: the channel copies the bytes

Exact here: `torch.equal` / `Tensor.equal`, `allclose` / `isclose` / `assert_close` with
`atol=0, rtol=0`, and `(a == b).all()` / `torch.all(a == b)`. `not torch.equal(...)` needs no
mark (rounding cannot make it fail). Everything else compares within a stated tolerance.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]
MARK = re.compile(r"#\s*bitwise:\s*\w")  # a reason must follow
CLOSE = {"allclose", "isclose", "assert_close", "assert_allclose"}


def _zero(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 0


def _exact(call: ast.Call) -> bool:
    """Whether `call` compares tensors for exact equality."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name == "equal":
        return True
    if name in CLOSE:
        kw = {k.arg: k.value for k in call.keywords}
        return _zero(kw.get("atol")) and _zero(kw.get("rtol"))
    if name == "all":  # (a == b).all() or torch.all(a == b)
        operands = [*([f.value] if isinstance(f, ast.Attribute) else []), *call.args]
        return any(isinstance(o, ast.Compare) and all(isinstance(op, ast.Eq) for op in o.ops) for o in operands)
    return False


def _marks(source: str) -> tuple[set[int], set[int]]:
    """(lines with a `# bitwise: <why>` comment, those of them that hold nothing else)."""
    marked, alone = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and MARK.match(tok.string):
            marked.add(tok.start[0])
            if tok.line.lstrip().startswith("#"):
                alone.add(tok.start[0])
    return marked, alone


def unmarked(source: str) -> list[int]:
    """The lines of `source`'s exact comparisons whose statement carries no `# bitwise: <why>`:
    on any line of a simple statement (of a compound one's header: of the call), or alone on the
    line above it."""
    tree = ast.parse(source)
    marked, alone = _marks(source)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _exact(node):
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
            continue
        while parent is not None and not isinstance(parent, ast.stmt):
            parent = parents.get(id(parent))
        span = node if parent is None or hasattr(parent, "body") else parent
        lines = set(range(span.lineno, (span.end_lineno or span.lineno) + 1))
        if not marked & lines and span.lineno - 1 not in alone:
            found.append(node.lineno)
    return sorted(found)


def scan(root: Path) -> list[str]:
    """`path:line` of every unmarked exact comparison in the Python files under `root`."""
    return [f"{path.relative_to(root)}:{line}" for path in sorted(root.rglob("*.py"))
            for line in unmarked(path.read_text())]


def test_every_exact_comparison_in_the_tests_says_why_it_is_exact():
    assert scan(TESTS) == []


@pytest.mark.parametrize("snippet", [
    "assert torch.equal(a, b)\n",
    "assert a.equal(b)\n",
    "assert torch.equal(a, b)  # bitwise:\n",  # a mark without a reason
    "assert torch.equal(a, b)  # copied bytes\n",  # a reason without the mark
    "torch.testing.assert_close(a, b, atol=0, rtol=0)\n",
    "assert torch.allclose(a, b, rtol=0.0, atol=0)\n",
    "assert bool((a == b).all())\n",
    "assert torch.all(a == b)\n",
    "assert not torch.equal(a, c) and torch.equal(a, b)\n",
    "x = 1  # bitwise: another statement's mark\nassert torch.equal(a, b)\n",
    "if torch.equal(a, b):\n    pass  # bitwise: the body's mark is not the header's\n",
    "# bitwise: copied bytes\n\nassert torch.equal(a, b)\n",  # not right above
], ids=["torch.equal", "method", "no reason", "no mark", "assert_close zero", "allclose zero", "eq all",
        "torch.all eq", "one of two", "another line", "compound body", "gap"])
def test_an_unmarked_exact_comparison_is_found(snippet):
    assert len(unmarked(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "assert torch.equal(a, b)  # bitwise: copied bytes\n",
    "assert all(torch.equal(x, y)  # bitwise: copied bytes\n           for x, y in pairs)\n",
    "assert all(torch.equal(x, y)\n           for x, y in pairs)  # bitwise: copied bytes\n",
    "def f(a, b):\n    # bitwise: copied bytes\n    assert torch.equal(a, b)\n",
    "assert not torch.equal(a, b)\n",
    "assert torch.allclose(a, b, atol=1e-5)\n",
    "torch.testing.assert_close(a, b, atol=0, rtol=1e-6)\n",
    "assert (a <= b).all()\n",
    "assert a.tolist() == [1, 2]\n",
], ids=["marked", "marked first line", "marked last line", "above", "negated", "allclose", "rtol", "le all", "lists"])
def test_a_marked_or_tolerant_comparison_passes(snippet):
    assert unmarked(snippet) == []


def test_a_planted_file_fails_the_scan(tmp_path):
    """The scan finds an unmarked comparison in a file of a tree and passes the marked one."""
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_planted.py").write_text("import torch\n\n\ndef test_x(a, b):\n    assert torch.equal(a, b)\n")
    (tmp_path / "test_fine.py").write_text("def test_y(a, b):\n    assert torch.equal(a, b)  # bitwise: one tensor\n")
    assert scan(tmp_path) == ["unit/test_planted.py:5"]
