"""The README and the documentation site: the README stays short and starts with the two
commands (CI and people rely on that top), its links resolve, and every page under docs/ is
reachable from mkdocs.yml's nav. `infra/test.sh` builds the site with `mkdocs build --strict`,
which checks the links and anchors between pages; these checks need no mkdocs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"  # benchmark outputs the pages link to: data, not pages
MAX_README_LINES = 300

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _code_blocks(text: str) -> list[list[str]]:
    """The fenced code blocks of a Markdown text, each as its lines (fences excluded)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (where a link is a link)."""
    lines, inside = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            inside = not inside
        elif not inside:
            lines.append(_CODE_SPAN.sub("", line))
    return "\n".join(lines)


def _relative_links(text: str) -> list[str]:
    """Link and image targets that point into the repository (no scheme, not a bare anchor),
    without their #fragment."""
    out = []
    for target in _LINK.findall(_prose(text)):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def _nav_pages(nav: object) -> list[str]:
    """Every page path in a mkdocs nav (nested lists of {title: page or list})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _doc_pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if BENCH not in p.parents)


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into docs/"


def test_readme_starts_with_the_two_commands() -> None:
    blocks = _code_blocks(README.read_text())
    assert blocks, "README.md has no fenced code block"
    first = [line.strip() for line in blocks[0]]
    for command in ("bash infra/demo.sh", "bash infra/test.sh"):
        assert any(line.startswith(command) for line in first), f"the README's first code block lacks `{command}`"


def test_readme_links_resolve() -> None:
    links = _relative_links(README.read_text())
    assert any(link.startswith("docs/") for link in links), "the README links into the docs"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_docs_links_resolve() -> None:
    """Relative links between pages, and to the images and data under docs/bench, resolve."""
    missing = []
    for page in _doc_pages():
        for link in _relative_links((DOCS / page).read_text()):
            target = (DOCS / page).parent / link
            if not target.exists() or DOCS.resolve() not in target.resolve().parents:
                missing.append(f"{page} -> {link}")
    assert not missing, f"links that do not resolve inside docs/: {missing}"


def test_every_page_is_in_the_nav() -> None:
    config = _mkdocs()
    assert config["docs_dir"] == "docs" and config["strict"] is True
    assert config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    pages = _doc_pages()
    assert "index.md" in pages and "references.md" in pages
    assert not sorted(set(pages) - set(nav)), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not sorted(set(nav) - set(pages)), f"nav entries with no page: {sorted(set(nav) - set(pages))}"
    assert len(nav) == len(set(nav)), "a page is listed twice in the nav"


def test_references_name_every_paper() -> None:
    """The code cites the papers as "paper 000" .. "paper 004"; the references page has an anchor
    for each, so a reader can map a number to its title."""
    text = (DOCS / "references.md").read_text()
    for n in range(5):
        assert re.search(rf"\{{ *#paper-00{n} *\}}", text), f"references.md has no anchor #paper-00{n}"
