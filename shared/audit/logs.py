"""Reading receivers' logs for the relay audit: the randomized requests and their shadow agreement.

Called by `estimate.run_audit` (and tests that read the same lines). Blocks on file reads only.
It trusts nothing in a line: every `*.log` / `*.jsonl` / `*.txt` file under a directory
(recursively) is read line by line; a line is a JSON object, possibly after a prefix (`docker
compose logs` writes "receiver-1  | {...}"); anything else is skipped, and a request line without
a usable `ttft_ms` is counted as malformed, not raised on.

Receivers' `event == "request"` lines whose `assignment` is one of `ARMS` become `Request`s; all
three arms happen only where relaying was possible:
  treatment  served as the policy chose: relayed, or its own prefill when that was predicted faster
  control    the randomized holdout: full prefill whatever the policy chose
  blind      randomized: relayed whatever the policy chose
`event == "shadow"` lines give a relayed answer's token `agreement` with a full-prefill shadow,
joined by `request_id`. A request id seen twice (a log collected twice) counts once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from droidmesh.shared.errors import BadRequestError

SUFFIXES = (".log", ".jsonl", ".txt")
ARMS = ("treatment", "control", "blind")


@dataclass(frozen=True)
class Request:
    """One treatment, control or blind request, in seconds and bytes."""

    request_id: str | None
    assignment: str
    ttft_s: float
    e2e_s: float | None
    bytes_pulled: float | None
    predicted_ttft_s: float | None
    reusable_fraction: float | None
    prompt_tokens: int | None
    pair: str | None
    topology: str | None
    queued: int | None
    holdout_share: float | None
    agreement: float | None = None
    decision_s: float | None = None  # the policy's own time deciding (and assigning) the request


@dataclass
class Logs:
    requests: list[Request]
    files: int
    lines_read: int
    other_assignments: int  # request lines outside the experiment ("ineligible", or none logged)
    malformed: int  # treatment/control lines without a usable ttft_ms
    duplicates: int


def log_files(root: str | Path) -> list[Path]:
    d = Path(root)
    if not d.is_dir():
        raise BadRequestError(f"--logs {root}: no such directory")
    return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON object on `line` (after any prefix), or None."""
    start = line.find("{")
    if start < 0:
        return None
    try:
        obj = json.loads(line[start:])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _ms(v: Any) -> float | None:
    x = _num(v)
    return None if x is None or x < 0 else x / 1e3


def to_request(obj: dict[str, Any]) -> Request | None:
    """A `Request` from a treatment/control request line, or None without a usable TTFT."""
    ttft = _ms(obj.get("ttft_ms"))
    if ttft is None:
        return None
    stages = obj.get("stages_ms")
    sender, receiver = obj.get("sender_model"), obj.get("receiver_model")
    queued, prompt = _num(obj.get("queued")), _num(obj.get("prompt_tokens"))
    rid = obj.get("request_id")
    return Request(request_id=str(rid) if rid is not None else None, assignment=obj["assignment"], ttft_s=ttft,
                   e2e_s=_ms(stages.get("done")) if isinstance(stages, dict) else None,
                   bytes_pulled=_num(obj.get("bytes_pulled")), predicted_ttft_s=_ms(obj.get("predicted_ttft_ms")),
                   reusable_fraction=_num(obj.get("reusable_fraction")),
                   prompt_tokens=int(prompt) if prompt is not None else None,
                   pair=f"{sender or '?'}->{receiver or '?'}" if sender or receiver else None,
                   topology=obj.get("topology") if isinstance(obj.get("topology"), str) else None,
                   queued=int(queued) if queued is not None else None, holdout_share=_num(obj.get("holdout_share")),
                   decision_s=_ms(obj.get("decision_ms")))


def read_logs(root: str | Path) -> Logs:
    files = log_files(root)
    requests: dict[str, Request] = {}
    anonymous: list[Request] = []
    agreements: dict[str, float] = {}
    lines = other = malformed = duplicates = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                lines += 1
                obj = parse_line(line)
                if obj is None:
                    continue
                if obj.get("event") == "shadow" and obj.get("request_id") is not None:
                    if (a := _num(obj.get("agreement"))) is not None:
                        agreements[str(obj["request_id"])] = a
                    continue
                if obj.get("event") != "request":
                    continue
                if obj.get("assignment") not in ARMS:
                    other += 1
                    continue
                req = to_request(obj)
                if req is None:
                    malformed += 1
                elif req.request_id is None:
                    anonymous.append(req)
                elif req.request_id in requests:
                    duplicates += 1
                else:
                    requests[req.request_id] = req
    joined = [_with_agreement(r, agreements.get(r.request_id or "")) for r in requests.values()]
    return Logs(joined + anonymous, len(files), lines, other, malformed, duplicates)


def _with_agreement(r: Request, agreement: float | None) -> Request:
    return r if agreement is None else dataclasses.replace(r, agreement=agreement)
