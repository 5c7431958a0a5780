"""Can NIXL serve memory that its own process holds only as an import? The nixl channel's device
path turns on it: a sender's device context reaches the connection's sandbox process only as a
CUDA IPC import, and the receiver's READ runs at device speed only if UCX's cuda_ipc can export
that import again. `probe` answers it in one verdict line (run by `gpu_transfer`'s nixl step;
alone: `python -m droidmesh.shared.tools.bench.nixl_reexport [--device D] [--json FILE]`); on the
CPU the same processes share host memory (a memfd), so CI runs its plumbing.

Sequence (the processes and what each does: `nixl_reexport_roles`):
  1. start the owner, the sandbox and the reader at once, each a child process;
  2. give the sandbox the owner's answer (its export), the reader the sandbox's (each buffer's
     NIXL metadata: its own allocation's, the import's or where the import failed);
  3. collect the reader's READs (GB/s, bytes checked) and, from the UCX_PROTO_INFO tables it
     printed, each READ's transport; then end the children (the reader and the sandbox before
     the owner: an import never outlives its export);
  4. the verdict: "reexport: works at X GB/s (Y of own allocation's Z GB/s, via T)", "reexport:
     fails: STAGE: ERROR [the first error line UCX or NIXL logged]", or "reexport: untested: ..."
     where the probe's own set-up failed (the owner's export, the sandbox's agent or import, a
     READ of the sandbox's own allocation).
Every wait has a deadline (DEADLINE_S for the whole probe), after which a child is terminated,
then killed: a hung NIXL call costs the step DEADLINE_S and the children's stops (a few STOP_S),
and no failure here is raised to the caller. The children die with the probe's process (a parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.service.launch import Proc
from droidmesh.shared.tools.bench.bulk_transfer import MIB
from droidmesh.shared.tools.bench.nixl_reexport_roles import MARK, PREFIX, TARGETS
from droidmesh.shared.tools.bench.tensor_server import one_line
from droidmesh.shared.tools.bench.ucx_proto import ucx_protocol_for, ucx_tables

ROLES_MODULE = "droidmesh.shared.tools.bench.nixl_reexport_roles"
GPU_BYTES, CPU_BYTES = 64 * MIB, 1 * MIB
DEADLINE_S = 60.0  # the whole probe: three processes' start (torch, CUDA, NIXL) and a few READs
STOP_S = 5.0  # a child's own exit once its stdin closes, before it is killed
UCX_READ = "remote memory read by ucp_get"  # a READ's table title (UCX 1.21: "...*(multi) into host memory from host")
_ERROR = re.compile(r"UCX\s+ERROR|NIXL\s+ERROR|^E\d{4}\s")  # UCX's error lines, NIXL's (Python's, glog's)
_FAILURE = re.compile(r"\b(error|failed)\b", re.IGNORECASE)


class _Child:
    """One role in a child process (`launch.Proc`: forked by the launcher's own thread, so it dies
    with this process, and every line it prints kept): its input written to its stdin, then held
    open (its life)."""

    def __init__(self, role: str, args: list[str], env: dict[str, str] | None = None):
        self.role = role
        self.proc = Proc(role, [sys.executable, "-m", ROLES_MODULE, role, *args], env=env, stdin=True)

    @property
    def lines(self) -> list[str]:
        return self.proc.lines

    def give(self, line: str) -> None:
        """Its input: the answer of the role before it (if it died already, that is said when its
        answer is awaited)."""
        assert self.proc.popen.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.popen.stdin.write(line + "\n")
            self.proc.popen.stdin.flush()

    def answers(self, count: int, end: float) -> list[dict[str, Any]]:
        """Its first `count` answers, or as many as it printed before it ended or `end` (monotonic) passed."""
        seen = 0

        def enough(line: str) -> bool:
            nonlocal seen
            seen += PREFIX in line
            return seen >= count

        with contextlib.suppress(RuntimeError, TimeoutError):  # it ended, or time ran out: what it said
            self.proc.wait_for(enough, max(0.0, end - time.monotonic()), f"{count} answers")
        found = [json.loads(x[x.index(PREFIX) + len(PREFIX):]) for x in list(self.lines) if PREFIX in x]
        return found[:count]

    def why(self, deadline_s: float) -> str:
        """Why an answer is missing: it ended (its first error line), or it was still running."""
        status = self.proc.popen.poll()
        if status is None:
            return f"no answer within {deadline_s:g}s"
        lines = list(self.lines)
        last = next((x for x in reversed(lines) if x.strip()), "no output")
        return f"exited ({status}): {first_error(lines) or last.strip()}"

    def close(self) -> None:
        """Close its stdin: an owner or sandbox then ends on its own."""
        assert self.proc.popen.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.popen.stdin.close()

    def answered(self) -> bool:
        return any(PREFIX in x for x in list(self.lines))

    def end(self, grace: float) -> None:
        """Wait `grace` seconds for its own exit, then terminate it, then kill it; its last lines read."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.popen.wait(grace)
        self.proc.stop(STOP_S)


def _stop(children: list[_Child]) -> None:
    """End the reader and the sandbox, then the owner: the sandbox drops its import before the
    owner its export. One that answered gets STOP_S (shared) to exit on its own; one that did not
    is still starting or hung, and is terminated at once."""
    for group in (children[1:], children[:1]):
        for child in group:
            child.close()
        until = time.monotonic() + STOP_S
        for child in group:
            child.end(max(0.0, until - time.monotonic()) if child.answered() else 0.0)


def first_error(lines: list[str]) -> str | None:
    """The first line UCX or NIXL logged as an error, else the first saying error or failed."""
    ours = [x.strip() for x in lines if PREFIX not in x and MARK not in x]
    return next((x for x in ours if _ERROR.search(x)), None) or next((x for x in ours if _FAILURE.search(x)), None)


def transports(lines: list[str], nbytes: int) -> dict[str, str | None]:
    """Per target, the transport and protocol UCX chose for its READ (UCX_PROTO_INFO tables after
    its mark); a target after which UCX printed no table used the configuration of the one before."""
    marks = [i for i, x in enumerate(lines) if MARK in x] + [len(lines)]
    out: dict[str, str | None] = {}
    last: str | None = None
    for i, j in zip(marks, marks[1:], strict=False):
        tables = ucx_tables(lines[i + 1:j], UCX_READ)
        found = ucx_protocol_for(nbytes, list(tables.values())[-1]) if tables else None
        last = out[lines[i][lines[i].index(MARK) + len(MARK):].strip()] = found or last
    return out


class _Untested(Exception):
    """The probe's own set-up failed: the question was not asked."""


def probe(device: torch.device, nbytes: int | None = None, repeats: int | None = None,
          deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """Steps 1-4 within `deadline_s`: the report (verdict, outcome, each READ, the import's
    metadata for the receiver's screen; on anything but "works", each child's last lines)."""
    cuda = device.type == "cuda"
    nbytes, repeats = nbytes or (GPU_BYTES if cuda else CPU_BYTES), repeats or (5 if cuda else 2)
    report: dict[str, Any] = {"outcome": "untested", "verdict": "", "device": str(device), "bytes": nbytes,
                              "memory": "VRAM" if cuda else "DRAM", "repeats": repeats, "untested": None,
                              "own": None, "import": None, "metadata_b64": None, "logs": {}}
    args = ["--device", str(device), "--bytes", str(nbytes), "--repeats", str(repeats)]
    children: list[_Child] = []
    try:
        _run(report, args, time.monotonic() + deadline_s, deadline_s, children)
    except _Untested as e:
        report["untested"] = str(e)
    except Exception as e:  # the probe's own bug must not fail the step it runs in
        report["untested"] = f"probe: {one_line(e)}"
    finally:
        _stop(children)
    _details(report, children)
    report["outcome"], report["verdict"] = verdict(report)
    if report["outcome"] != "works":  # what each said last, without UCX's protocol tables
        report["logs"] = {c.role: [x for x in c.lines if "|" not in x and not x.endswith("+")][-15:] for c in children}
    return report


def _run(report: dict[str, Any], args: list[str], end: float, deadline_s: float, children: list[_Child]) -> None:
    for role, env in (("owner", None), ("sandbox", None), ("reader", {"UCX_PROTO_INFO": "y"})):
        children.append(_Child(role, args, env))  # each as it starts: a failed start stops those before it
    reader = children[2]
    for child, after in zip(children, children[1:], strict=False):  # each given the answer of the one before
        answer = child.answers(1, end)
        if not answer or "error" in answer[0]:
            raise _Untested(f"{child.role}: {answer[0]['error'] if answer else child.why(deadline_s)}")
        after.give(json.dumps(answer[0]))
    served = answer[0]
    if served["import"].get("stage") == "import":
        raise _Untested(f"sandbox: opening the owner's export: {served['import']['error']}")
    report["metadata_b64"] = served["import"].get("grant")  # the import's keys, as a first grant would carry them
    if "error" in served["import"]:
        report["import"] = served["import"]  # failed in the sandbox: `register` or `metadata`
    wanted = [t for t in TARGETS if "metadata" in served[t]]
    answers = reader.answers(len(wanted), end)
    if answers and "target" not in answers[0]:  # it failed before any READ: its agent, say
        raise _Untested(f"reader: {answers[0].get('error')}")
    reads = {a["target"]: a for a in answers}
    missing = reader.why(deadline_s) if len(reads) < len(wanted) else ""
    reader.end(0.0 if missing else STOP_S)  # it ends after its READs: its output complete, UCX's tables
    carried = transports(reader.lines, report["bytes"])
    for target in wanted:
        got = reads.get(target) or {"target": target, "error": missing}
        report[target] = {**got, "stage": "read", "transport": carried.get(target)}


def _details(report: dict[str, Any], children: list[_Child]) -> None:
    """Beside each failed step, the first error line UCX or NIXL logged where it failed (read once
    the children have ended: everything they wrote)."""
    lines = {c.role: c.lines for c in children}
    for target in TARGETS:
        got = report[target]
        if got and "error" in got:
            where = ["sandbox"] if got["stage"] != "read" else ["reader", "sandbox"]
            got["detail"] = next((e for r in where if (e := first_error(lines.get(r, [])))), None)


def verdict(report: dict[str, Any]) -> tuple[str, str]:
    """(outcome, line): works, fails (at a stage, with the first error line UCX or NIXL logged),
    or untested (the probe's own set-up, or a READ of the sandbox's own allocation, failed)."""
    own, imp = report["own"] or {}, report["import"] or {}
    if report["untested"]:
        return "untested", f"reexport: untested: {report['untested']}"
    if "error" in own or not own.get("match"):
        return "untested", ("reexport: untested: a READ of the sandbox's own allocation fails too: "
                            f"{own.get('error') or 'its bytes differ from the pattern'}")
    base = f"own allocation's {own['gb_s']:.2f} GB/s"
    if "error" in imp:
        detail = f" [{imp['detail']}]" if imp.get("detail") else ""
        return "fails", f"reexport: fails: {imp['stage']}: {imp['error']}{detail} ({base})"
    if not imp.get("match"):
        return "fails", f"reexport: fails: bytes: the READ completed with bytes other than the owner's ({base})"
    via = f", via {imp['transport']}" if imp.get("transport") else ""
    if own.get("transport") != imp.get("transport"):
        via += f"; own via {own.get('transport')}"
    return "works", f"reexport: works at {imp['gb_s']:.2f} GB/s ({imp['gb_s'] / own['gb_s']:.2f} of {base}{via})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m droidmesh.shared.tools.bench.nixl_reexport", description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="cuda[:N] (device memory, CUDA IPC) or cpu (host memory, a memfd); "
                                         "default cuda where available")
    parser.add_argument("--bytes", type=int, help=f"bytes per READ (default {GPU_BYTES} on a GPU, {CPU_BYTES} on the CPU)")
    parser.add_argument("--repeats", type=int, help="timed READs per buffer, after a warm-up (default 5; CPU 2)")
    parser.add_argument("--json", type=Path, help="the report as JSON")
    args = parser.parse_args(argv)
    report = probe(torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")), args.bytes, args.repeats)
    print(report["verdict"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["outcome"] == "works" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
