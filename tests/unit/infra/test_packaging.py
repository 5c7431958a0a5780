"""The package mapping in pyproject.toml: every package folder installed, no links in the tree."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str) -> Path:
    """Where a listed package lives in the checkout, by the longest mapped prefix."""
    mapping = SETUPTOOLS["package-dir"]
    prefix = max((p for p in mapping if package == p or package.startswith(p + ".")), key=len)
    return ROOT / mapping[prefix] / Path(*package[len(prefix):].split(".")[1:])


def test_every_python_package_folder_is_listed_and_every_listed_package_exists():
    """A package folder missing from `packages` would be left out of the wheel (and the images)."""
    found = {"droidmesh." + ".".join(p.parent.relative_to(ROOT).parts)
             for top in ("shared", "services") for p in (ROOT / top).rglob("__init__.py")}
    listed = set(SETUPTOOLS["packages"])
    assert found - listed == set(), "add these to [tool.setuptools] packages"
    for package in listed:
        assert _folder(package).is_dir(), package


def test_the_data_packages_hold_what_the_launcher_and_the_demo_read():
    assert (_folder("droidmesh.nats_config") / "nats.conf").is_file()
    assert (_folder("droidmesh.nats_config") / "nats-auth.conf").is_file()
    assert (_folder("droidmesh.zoo") / "demo" / "manifest.json").is_file()


def test_the_tracked_tree_has_no_symbolic_links():
    """Links made every module reachable under two paths and broke tools that follow imports."""
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000")]
    assert links == []


def test_the_installed_names_resolve_to_this_checkout():
    import droidmesh.services.receiver
    import droidmesh.shared

    assert Path(droidmesh.shared.__file__).resolve() == ROOT / "shared" / "__init__.py"
    assert Path(droidmesh.services.receiver.__file__).resolve().parent == ROOT / "services" / "receiver"
    assert droidmesh.shared.NATS_CONFIG_DIR.resolve() == ROOT / "infra" / "nats"
