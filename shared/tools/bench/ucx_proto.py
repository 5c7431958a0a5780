"""UCX's protocol tables (printed on stdout with UCX_PROTO_INFO=y), parsed: which transport and
protocol carried a payload of a given size.

Called by `bulk_transfer`, `bandwidth` and `gpu_transfer` on the lines a child process printed,
after it ran; pure text parsing, nothing blocks. It trusts the table layout UCX prints (below);
a line that does not fit it is skipped.
"""

from __future__ import annotations

import re

# UCX prints the tables of the protocols it selected (one per endpoint configuration and
# operation) on stdout when UCX_PROTO_INFO=y: each titled "<context> <cfg#N> | <operation>", then
# one row per message-size range with the protocol and the transport (`sysv/memory`, `tcp/lo`,
# `cuda_ipc/cuda`, ...) that carry it. The operation names the memory type last. UCX 1.21 puts the
# title's two parts on lines of their own and names both memory types ("... into host memory from host").
UCX_TAG_SEND = "tagged message by ucp_tag_send* from "  # the ucx channel's sender: each payload
UCX_GET = "remote memory read by ucp_get* from "  # the nixl channel's receiver reads each payload
_UCX_RANGE = re.compile(r"(\d+[KMG]?)(?:\.\.(\d+[KMG]?|inf))?")

Protocols = list[tuple[float, float, str]]  # (low, high, "transport: protocol") per size range
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _ucx_size(text: str) -> float:
    if text == "inf":
        return float("inf")
    mult = _UNITS.get(text[-1], 1)
    return int(text.rstrip("KMG")) * mult


def ucx_tables(lines: list[str], operation: str = UCX_TAG_SEND) -> dict[str, Protocols]:
    """The tables UCX printed (UCX_PROTO_INFO=y) in `lines` for operations starting with
    `operation`, keyed by the rest of the title (for `UCX_TAG_SEND` and `UCX_GET`, the memory
    type: "host memory", "cuda/GPU0", ...). Per key the last table, the endpoint configuration
    wireup settled on last; the keys ordered by when that table was printed, so the last key is
    the last table of the operation."""
    tables: dict[str, Protocols] = {}
    current: Protocols | None = None
    context = False  # UCX 1.21 prints a title on two lines: "<context> <cfg>", then "<operation>"
    for line in lines:
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|"):].strip().strip("|").split("|")]
        if context and len(cells) == 1:
            cells = ["cfg#", cells[0]]
        context = len(cells) == 1 and "cfg#" in cells[0]
        if len(cells) == 2 and "cfg#" in cells[0]:  # a table's title: "<context> <cfg> | <operation>"
            current = None
            if cells[1].startswith(operation):
                key = cells[1][len(operation):]
                tables.pop(key, None)  # re-inserted: a key's place is its last table's
                current = tables[key] = []
        elif current is not None and len(cells) == 3 and (m := _UCX_RANGE.fullmatch(cells[0])):
            low = _ucx_size(m.group(1))
            high = _ucx_size(m.group(2)) if m.group(2) else low
            current.append((low, high, f"{cells[2]}: {cells[1].removeprefix('(?) ')}"))
    return tables


def ucx_protocol_for(nbytes: int, protocols: Protocols) -> str | None:
    """"transport: protocol" of the range holding `nbytes`; None if no range does."""
    return next((p for low, high, p in protocols if low <= nbytes <= high), None)
