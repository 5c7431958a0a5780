"""`shared/tools/bench/bulk_transfer.py`: the memcpy reference, UCX protocol-table parsing (`ucx_proto.py`) and `bench
transfer` built on them: the tensor server's one-line refusal, and a whole run over the
in-process channel (structure only; no timing assertions)."""

from __future__ import annotations

import asyncio
import math

from droidmesh.shared.tools.bench import bulk_transfer, tensor_server, ucx_proto

# Two tag-send tables as UCX_PROTO_INFO=y prints them (log prefix kept); the last one counts.
PROTO_LINES = """\
[1.0] [vm:1:0]   | ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from host memory    |
[1.0] [vm:1:0]   +--------------------------------+--------------------------------------------+--------+
[1.0] [vm:1:0]   |                              0 | eager short                                | tcp/lo |
[1.0] [vm:1:0]   |                     16353..inf | (?) rendezvous fragmented copy-in copy-out | tcp/lo |
[1.0] [vm:1:0]   | ucp_context_0 intra-node cfg#3 | tagged message by ucp_tag_send* from host memory         |
[1.0] [vm:1:0]   |                          0..92 | eager short                                | sysv/memory |
[1.0] [vm:1:0]   |                       93..8191 | eager copy-in copy-out                     | sysv/memory |
[1.0] [vm:1:0]   |                        8K..inf | (?) rendezvous fragmented copy-in copy-out | sysv/memory |
[1.0] [vm:1:0]   | ucp_context_0 intra-node cfg#3 | active message by ucp_am_send* from host memory     |
[1.0] [vm:1:0]   |                        8K..inf | rendezvous zero-copy                       | tcp/lo |
""".splitlines()


def test_memcpy_reference_reports_warm_and_cold():
    ref = bulk_transfer.memcpy_reference(64 << 10, repeats=2, llc=1 << 20)
    assert ref["bytes"] == 64 << 10
    assert ref["cold_pairs"] == 2 * (1 << 20) // (64 << 10) + 1  # (pairs - 1) x 2 x 64 KiB >= 2 x LLC
    for key in ("memcpy_gb_s", "memcpy_cold_gb_s"):
        assert math.isfinite(ref[key]) and ref[key] > 0


def test_ucx_tables_take_the_last_tag_send_table():
    tables = ucx_proto.ucx_tables(PROTO_LINES)
    assert list(tables) == ["host memory"]  # the active-message table is another operation's
    protocols = tables["host memory"]
    assert protocols[0] == (0, 92, "sysv/memory: eager short")
    assert protocols[-1] == (8192, math.inf, "sysv/memory: rendezvous fragmented copy-in copy-out")
    assert ucx_proto.ucx_protocol_for(16 << 20, protocols) == "sysv/memory: rendezvous fragmented copy-in copy-out"
    assert ucx_proto.ucx_protocol_for(1, []) is None


def test_ucx_tables_per_memory_type():
    lines = ["[1] [vm:1:0]   | ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from host memory |",
             "[1] [vm:1:0]   |                          0..8K | eager short | cma/memory |",
             "[1] [vm:1:0]   |                        8K..inf | rendezvous zero-copy read from remote | cma/memory |",
             "[1] [vm:1:0]   | ucp_context_0 intra-node cfg#2 | tagged message by ucp_tag_send* from cuda/GPU0 |",
             "[1] [vm:1:0]   |                         0..inf | (?) rendezvous zero-copy read from remote | cuda_ipc/cuda |"]
    tables = ucx_proto.ucx_tables(lines)
    assert ucx_proto.ucx_protocol_for(1 << 20, tables["host memory"]) == "cma/memory: rendezvous zero-copy read from remote"
    assert ucx_proto.ucx_protocol_for(64, tables["cuda/GPU0"]) == "cuda_ipc/cuda: rendezvous zero-copy read from remote"


def test_ucx_tables_order_keys_by_their_last_table():
    get = "remote memory read by ucp_get* from "
    lines = [f"| ctx cfg#1 | {get}host memory |", "| 0..inf | zero-copy | tcp/lo |",
             f"| ctx cfg#2 | {get}cuda/GPU0 |", "| 0..inf | zero-copy | cuda_ipc/cuda |",
             f"| ctx cfg#3 | {get}host memory |", "| 0..inf | zero-copy | sysv/memory |"]
    tables = ucx_proto.ucx_tables(lines, ucx_proto.UCX_GET)
    assert list(tables) == ["cuda/GPU0", "host memory"]
    assert tables["host memory"] == [(0, math.inf, "sysv/memory: zero-copy")]


def test_default_transports_are_the_ones_between_processes():
    assert "ucx" in bulk_transfer.bench_transports() and "inproc" not in bulk_transfer.bench_transports()


def test_tensor_server_refuses_an_unknown_transport_in_one_line(capsys):
    assert asyncio.run(tensor_server.serve("no-such-channel", [1024])) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(tensor_server.ERROR_PREFIX) and "no-such-channel" in out[0]


def test_transfer_rows_over_the_inproc_channel():
    # a small cache to overflow: this machine's (480 MiB here) would mean ~2 GB of reference buffers
    r = bulk_transfer.run_transfer([4096, 8192], repeats=1, transports=["inproc"], llc=1 << 20)
    assert [row["bytes"] for row in r["rows"]] == [4096, 8192]
    for row in r["rows"]:
        assert row["transport"] == "inproc" and row["ucx_transports"] is None
        assert row["ratio"] == row["throughput_gb_s"] / row["memcpy_gb_s"]
        assert row["memcpy_cold_gb_s"] > 0
    assert r["over_memcpy"] == {"inproc": None}  # no row of 16 MiB or more
    assert r["ucx_over_memcpy"] is None


def test_ucx_tables_with_the_title_on_two_lines():
    """UCX 1.21 prints "<context> <cfg>" and the operation on lines of their own."""
    lines = ["[1] [vm:1:0]   | ucp_context_0 intra-node cfg#1 |",
             "[1] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |",
             "[1] [vm:1:0]   +--------+-------------+------------+",
             "[1] [vm:1:0]   | Range  | Description |   Config   |",
             "[1] [vm:1:0]   | 0..inf | zero-copy   | cma/memory |"]
    tables = ucx_proto.ucx_tables(lines, "remote memory read by ucp_get")
    assert tables == {"*(multi) into host memory from host": [(0, math.inf, "cma/memory: zero-copy")]}
    assert ucx_proto.ucx_tables(lines[1:], "remote memory read by ucp_get") == {}  # an operation without its context line
