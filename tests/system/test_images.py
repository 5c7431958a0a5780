"""The container images install DroidMesh and run it, from exactly what their Dockerfile copies.

No container engine is needed: the Dockerfile's stages are parsed, each image's chain of stages
(its target, the stage it is built FROM, and so on, for every VARIANT) gives the files its COPY
lines take from the build context (the repository root, less what the Dockerfile's
`.dockerignore` excludes), and those files alone are laid out as the image's WORKDIR in a
temporary directory. The `pip install` of the RUN line then installs from there into a fresh
venv (`tests/system/venvs.py`: the dependencies are the dev venv's, offline), and each image's
ENTRYPOINT answers `--help` and `droidmesh demo --rows 1` runs from that venv outside the checkout.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import shlex
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.system import venvs

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "infra" / "docker" / "Dockerfile"
CONTEXT = ROOT  # compose: `context: ..` from infra/; `docker build -f infra/docker/Dockerfile .` from the root
IMAGES = ("sender", "receiver", "cache_broker", "profiler", "gateway")
VARIANTS = ("cpu", "cuda")  # ARG VARIANT
pytestmark = pytest.mark.system


@dataclasses.dataclass
class Stage:
    name: str
    base: str  # the FROM image or stage, build args substituted
    workdir: str = "/"
    copies: list[tuple[list[str], str, str]] = dataclasses.field(default_factory=list)  # (sources, dest, workdir)
    runs: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (command, workdir)
    entrypoint: list[str] = dataclasses.field(default_factory=list)


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: comments dropped, `\\` continuations joined."""
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if logical and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        word, _, rest = logical.partition(" ")
        yield word.upper(), rest.strip()
        logical = ""
    assert not logical, f"unterminated instruction: {logical!r}"


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], ""), value)


def _words(rest: str) -> list[str]:
    """An instruction's arguments in exec (JSON) or shell form, flags (--chown=...) kept."""
    return json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def parse(text: str, build_args: dict[str, str]) -> dict[str, Stage]:
    """The Dockerfile's stages by name, with `build_args` overriding ARG defaults."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for op, rest in instructions(text):
        if op == "ARG":
            name, _, default = rest.partition("=")
            if stage is None:  # before the first FROM: usable in FROM lines
                global_args[name] = build_args.get(name, default)
        elif op == "FROM":
            words = rest.split()
            image = _substitute(words[0], global_args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
            parent = stages.get(image)
            stage = Stage(name=name, base=image, workdir=parent.workdir if parent else "/",
                          entrypoint=list(parent.entrypoint) if parent else [])
            stages[name] = stage
        elif stage is None:
            raise AssertionError(f"{op} before the first FROM")
        elif op == "WORKDIR":
            stage.workdir = str(Path(stage.workdir) / rest)
        elif op in ("COPY", "ADD"):
            words = _words(rest)
            flags = [w for w in words if w.startswith("--")]
            assert op == "COPY" and not any(f.startswith("--from") for f in flags), \
                f"{op} {rest}: only COPY from the build context is modelled here"
            paths = [w for w in words if not w.startswith("--")]
            stage.copies.append((paths[:-1], paths[-1], stage.workdir))
        elif op == "RUN":
            stage.runs.append((rest, stage.workdir))
        elif op == "ENTRYPOINT":
            stage.entrypoint = _words(rest)
    return stages


def chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """`target` and the stages it is built FROM, the first built first."""
    out = [stages[target]]
    while out[0].base in stages:
        out.insert(0, stages[out[0].base])
    return out


# -- the build context: the Dockerfile's .dockerignore ----------------------------------------
def ignore_file(dockerfile: Path, context: Path) -> Path | None:
    """BuildKit's: `<Dockerfile>.dockerignore` beside the Dockerfile, else the context's own."""
    for path in (dockerfile.with_name(dockerfile.name + ".dockerignore"), context / ".dockerignore"):
        if path.is_file():
            return path
    return None


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match, plus `**` for any number of folders) as a regex."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[":  # a character class: [abc], [a-z], [^abc]
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out, i = out + "[" + ("^" + body[1:] if body.startswith(("^", "!")) else body) + "]", end + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(out)


def excluder(path: Path | None):
    """`excluded(relative path)`: the last pattern matching the path or a folder above it decides."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for line in (path.read_text().splitlines() if path else []):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        pat = line[1:].strip() if keep else line
        pat = re.sub(r"/+$", "", pat.lstrip("/"))
        assert "\\" not in pat, f"{line!r}: escapes are not modelled here"
        rules.append((keep, _pattern(pat)))

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        verdict = False
        for keep, rx in rules:
            if any(rx.fullmatch(p) for p in prefixes):
                verdict = not keep
        return verdict

    return excluded


def lay_out(stages: list[Stage], context: Path, ignore: Path | None, fs: Path) -> list[str]:
    """Copy what the stages' COPY lines take from `context` into the image filesystem at `fs`;
    the files copied, as image paths."""
    excluded = excluder(ignore)
    copied: list[str] = []
    for stage in stages:
        for sources, dest, workdir in stage.copies:
            target = fs / (Path(workdir) / dest).relative_to("/")
            into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            for source in sources:
                matches = sorted(glob.glob(source, root_dir=context))
                matches = [m for m in matches if not excluded(Path(m).as_posix())]
                assert matches, f"COPY {source}: nothing in the build context (missing, or excluded by {ignore})"
                for rel in matches:
                    src = context / rel
                    if src.is_dir():  # a folder's contents go to the destination
                        files = [p for p in sorted(src.rglob("*")) if p.is_file()]
                        for f in files:
                            r = f.relative_to(context).as_posix()
                            if not excluded(r):
                                out = target / f.relative_to(src)
                                out.parent.mkdir(parents=True, exist_ok=True)
                                shutil.copy2(f, out)
                                copied.append("/" + out.relative_to(fs).as_posix())
                    else:
                        out = target / src.name if into_dir else target
                        out.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, out)
                        copied.append("/" + out.relative_to(fs).as_posix())
    return copied


def install_dir(stages: list[Stage]) -> str:
    """The image path of the project the RUN lines `pip install` (`pip install ".[extra]"` in WORKDIR)."""
    found = []
    for stage in stages:
        for command, workdir in stage.runs:
            for part in re.split(r"&&|;", command):
                words = shlex.split(part)
                if "pip" in words and "install" in words:
                    for w in words[words.index("install") + 1:]:
                        local = re.fullmatch(r"(\.{1,2}(?:/[^\[]*)?|/[^\[]*)(\[.*\])?", w)
                        if local:
                            found.append(str(Path(workdir) / local[1]))
    assert len(found) == 1, f"expected one `pip install` of a local project, found {found}"
    return found[0]


@dataclasses.dataclass(frozen=True)
class Image:
    target: str
    stages: list[Stage]


def images(dockerfile: Path = DOCKERFILE) -> list[Image]:
    text = dockerfile.read_text()
    return [Image(t, chain(parse(text, {"VARIANT": v}), t)) for t in IMAGES for v in VARIANTS]


def _key(image: Image) -> str:
    """Images whose COPY and RUN lines agree install the same thing: one venv serves them all."""
    return json.dumps([(s.copies, s.runs) for s in image.stages])


class Installs:
    """One venv per distinct image install (all images share the base stage: usually one)."""

    def __init__(self, root: Path, dockerfile: Path = DOCKERFILE, context: Path = CONTEXT):
        self.root, self.dockerfile, self.context = root, dockerfile, context
        self._made: dict[str, venvs.Venv] = {}
        self.elsewhere = root / "elsewhere"
        self.elsewhere.mkdir(parents=True, exist_ok=True)

    def venv(self, image: Image) -> venvs.Venv:
        key = _key(image)
        if key not in self._made:
            n = len(self._made)
            fs = self.root / f"fs{n}"
            copied = lay_out(image.stages, self.context, ignore_file(self.dockerfile, self.context), fs)
            assert copied, "the image copies nothing"
            venv = venvs.isolated_venv(self.root / f"venv{n}")
            venvs.install(venv, fs / install_dir(image.stages).lstrip("/"), cwd=self.elsewhere)
            self._made[key] = venv
        return self._made[key]


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> Installs:
    return Installs(tmp_path_factory.mktemp("images"))


def test_every_image_is_a_known_target():
    """Every stage with an ENTRYPOINT is an image this test runs, for every VARIANT, and every
    image runs a DroidMesh service module; besides them the `vllm` image runs vLLM's CLI with the
    connector (not installed here: vLLM pins its own torch; `infra/vllm/install.sh` installs the
    same packages, and tests/system/test_vllm_compose.py runs compose's command for it)."""
    for variant in VARIANTS:
        stages = parse(DOCKERFILE.read_text(), {"VARIANT": variant})
        assert {s.name for s in stages.values() if s.entrypoint} == {*IMAGES, "vllm"}
        assert stages["vllm"].entrypoint == ["python", "-m", "droidmesh.shared.engines.vllm.cli"]
        for t in IMAGES:
            assert stages[t].entrypoint == ["python", "-m", f"droidmesh.services.{t}"], stages[t].entrypoint


def test_the_context_holds_only_what_the_copies_name(tmp_path: Path):
    """The Dockerfile's .dockerignore keeps the checkout's venv, git, tests and caches out, and
    everything a COPY line names in."""
    excluded = excluder(ignore_file(DOCKERFILE, CONTEXT))
    for rel in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "zoo/family/manifest.json", "docs/x.md",
                "shared/__pycache__/x.pyc", "services/receiver/__pycache__/x.pyc", "droidmesh.egg-info/PKG-INFO",
                "zoo/demo/.work/x"):
        assert excluded(rel), rel
    for image in images():
        for stage in image.stages:
            for sources, _, _ in stage.copies:
                for source in sources:
                    assert not excluded(source), source
    copied = lay_out(images()[0].stages, CONTEXT, ignore_file(DOCKERFILE, CONTEXT), tmp_path)
    assert "/app/shared/__init__.py" in copied and not any("__pycache__" in p for p in copied)


@pytest.mark.parametrize("image", IMAGES)
def test_image_installs_and_its_entrypoint_runs(image: str, installs: Installs):
    """From only the files the image's COPY lines take, `pip install` installs DroidMesh (its
    code, both data packages and the license), and the image's ENTRYPOINT answers --help."""
    ran: set[tuple[str, ...]] = set()
    for img in (i for i in images() if i.target == image):  # each VARIANT
        venv = installs.venv(img)
        argv = img.stages[-1].entrypoint
        if (str(venv.root), *argv) in ran:
            continue
        ran.add((str(venv.root), *argv))
        venvs.assert_installed_here(venv, installs.elsewhere)
        (dist,) = venv.site.glob("droidmesh-*.dist-info")
        assert (dist / "licenses" / "LICENSE").is_file(), sorted(p.name for p in dist.rglob("*"))
        res = venv.run([*argv, "--help"], cwd=installs.elsewhere, timeout=300)
        assert res.returncode == 0 and "usage:" in res.stdout, f"{argv}: {res.stdout[-1000:]}{res.stderr[-2000:]}"


def test_demo_runs_from_an_image_install(installs: Installs):
    """`droidmesh demo --rows 1` from an image's install, outside the checkout."""
    venv = installs.venv(images()[0])
    demo = venvs.run_demo(venv, installs.elsewhere)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "base-to-qa" in demo.stdout and "partial" in demo.stdout, demo.stdout
