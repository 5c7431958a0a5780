"""`infra/gpu/carry.py`: the archive keeps what a channel loads and drops the rest.

Built from wheels made here of real ELF files (this interpreter's own extension modules and
libraries), so the NEEDED-closure is the real one, not a stand-in."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[3]
CARRY = ROOT / "infra" / "gpu" / "carry.py"


def _carry():
    spec = importlib.util.spec_from_file_location("carry", CARRY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def test_the_archive_keeps_what_is_loaded_and_drops_the_rest(tmp_path):
    carry = _carry()
    ext = next(Path(msgspec.__file__).parent.glob("_core*.so")).read_bytes()  # an extension module: a root
    other = ext  # an ELF file no root NEEDs under the names it gets below
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels / "pkg-1-py3-none-any.whl", {
        "pkg/__init__.py": b"", "pkg/_core.cpython-311-x86_64-linux-gnu.so": ext,
        "pkg.libs/libunused-1a2b.so.1": other, "pkg/lib/libstatic.a": b"!<arch>\n", "pkg/bin/tool": b"#!/bin/sh\n",
        "pkg/include/x.h": b"", "pkg-1.dist-info/METADATA": b"Name: pkg\n"})
    _wheel(wheels / "tool-1-py3-none-any.whl", {  # a program among a wheel's scripts, and its pure-Python part
        "tool-1.data/scripts/nats-server": b"#!/bin/sh\n", "tool-1.data/scripts/example": b"#!/bin/sh\n",
        "tool-1.data/purelib/toolmod.py": b"", "tool-1.data/headers/x.h": b""})
    _wheel(wheels / "libucx-1-py3-none-any.whl", {  # UCX's core libraries: loaded by name, kept with their aliases
        "libucx/__init__.py": b"", "libucx/lib/libucs.so": other, "libucx/lib/libucs.so.0": other,
        "libucx/lib/libucs.so.0.0.0": other, "libucx/lib/ucx/libucx_perftest_cuda.so.0": other})
    out = tmp_path / "carry.tar.xz"
    assert carry.main([str(wheels), str(out)]) == 0
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert "pkg/_core.cpython-311-x86_64-linux-gnu.so" in members and "pkg-1.dist-info/METADATA" in members
    assert not any(n.startswith(("pkg.libs/libunused", "pkg/lib/libstatic", "pkg/bin", "pkg/include")) or
                   "perftest" in n for n in members), sorted(members)
    assert members["bin/nats-server"].isfile() and members["bin/nats-server"].mode & 0o111 and "toolmod.py" in members
    assert not any(n.startswith("tool-1.data") or n == "bin/example" for n in members)  # only the programs a check runs
    assert members["libucx/lib/libucs.so.0.0.0"].isfile()
    assert [members[f"libucx/lib/libucs.so{v}"].linkname for v in ("", ".0")] == ["libucs.so.0.0.0"] * 2


def test_no_wheels_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(CARRY), str(tmp_path), str(tmp_path / "x.tar.xz")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stderr.strip() == f"carry: no wheels in {tmp_path}"


@pytest.mark.parametrize("plugins", ["UCX", "UCX,POSIX"])
def test_only_the_named_nixl_plugins_are_roots(tmp_path, plugins):
    carry = _carry()
    for rel in ("nixl_cu13.libs/nixl/libplugin_UCX.so", "nixl_cu13.libs/nixl/libplugin_POSIX.so",
                "nixl_cu13.libs/nixl/libplugin_GDS.so"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"\x7fELF")
    found = {p.name for p in carry.roots(tmp_path, tuple(plugins.split(",")))}
    assert found == {f"libplugin_{p}.so" for p in plugins.split(",")}


def test_the_tree_leaves_a_device_call_room_for_the_largest_archive():
    """What travels to a GPU machine is the tree plus a check's archive, 64 MiB in all: a tree that
    grew past `CALL_BYTES - ARCHIVE_ROOM` would make a session call impossible to send."""
    carry = _carry()
    tree = carry.tree_bytes(ROOT)
    assert tree + carry.ARCHIVE_ROOM <= carry.CALL_BYTES, (
        f"the tree is {tree / carry.MIB:.1f} MiB: with the mesh archive it no longer fits one "
        f"{carry.CALL_BYTES / carry.MIB:.0f} MiB device call (make it lighter: docs/bench, zoo/)")


def test_what_travels_is_tracked_and_untracked_files_git_does_not_ignore(tmp_path):
    carry = _carry()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 100)
    (tmp_path / "gone").write_bytes(b"x" * 1000)
    subprocess.run(["git", "add", "tracked", "gone", ".gitignore"], cwd=tmp_path, check=True)
    (tmp_path / "gone").unlink()  # tracked, deleted here: does not travel
    (tmp_path / "new").write_bytes(b"x" * 10)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"x" * 10_000)
    assert carry.tree_bytes(tmp_path) == 100 + 10 + len("ignored/\n")


def test_an_archive_that_does_not_fit_a_call_with_the_tree_fails(tmp_path, capsys):
    carry = _carry()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_bytes(b"x" * 4096)
    assert carry.fits(tmp_path, carry.CALL_BYTES - 4096) == 0
    assert carry.fits(tmp_path, carry.CALL_BYTES - 4095) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("carry: over a call's 64 MiB")


def test_every_bundled_ucxs_transport_modules_are_roots_but_perftest(tmp_path):
    """libucx's modules and those of the UCX the NIXL wheel bundles (beside its own libuct): without
    them UCX has TCP and shared memory only, so NIXL would never see device memory."""
    carry = _carry()
    for rel in ("libucx/lib/ucx/libuct_cuda.so.0.0.0", "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0",
                "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0", "nixl_cu13.libs/ucx/libucx_perftest_cuda.so.0.0.0",
                "nixl_cu13.libs/libuct-1141f529.so.0.0.0"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"\x7fELF")
    found = {p.relative_to(tmp_path).as_posix() for p in carry.roots(tmp_path, ("UCX",))}
    assert found == {"libucx/lib/ucx/libuct_cuda.so.0.0.0", "nixl_cu13.libs/ucx/libuct_cuda.so.0.0.0",
                     "nixl_cu13.libs/ucx/libuct_cma.so.0.0.0"}
