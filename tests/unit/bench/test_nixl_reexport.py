"""The re-export probe's reading of what its processes said (no processes here: the CPU run end to
end is `tests/system/test_gpu_session.py`'s, a hung child `tests/integration/test_gpu_transfer.py`'s):
its verdict per outcome, each READ's transport from UCX's tables, the error line it quotes."""

from __future__ import annotations

from droidmesh.shared.tools.bench import nixl_reexport
from droidmesh.shared.tools.bench.nixl_reexport_roles import MARK

IPC = "cuda_ipc/cuda: zero-copy"
# UCX 1.21 prints a table's title on two lines and names both memory types
READ_TABLE = """\
[1.0] [vm:7:0]   | droidmesh-raw-reexport-receiver intra-node cfg#1                 |
[1.0] [vm:7:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 memory from cuda |
[1.0] [vm:7:0]   +--------+-------------+-------------------------------------------+
[1.0] [vm:7:0]   | Range  | Description |                  Config                   |
[1.0] [vm:7:0]   +--------+-------------+-------------------------------------------+
[1.0] [vm:7:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                             |
""".splitlines()


def _report(own: dict | None, imp: dict | None, untested: str | None = None) -> dict:
    return {"own": own, "import": imp, "untested": untested}


def test_works_gives_the_rate_against_the_own_allocation_and_the_transport():
    own = {"gb_s": 200.0, "match": True, "transport": IPC}
    outcome, line = nixl_reexport.verdict(_report(own, {"gb_s": 150.0, "match": True, "transport": IPC}))
    assert outcome == "works"
    assert line == f"reexport: works at 150.00 GB/s (0.75 of own allocation's 200.00 GB/s, via {IPC})"
    _, staged = nixl_reexport.verdict(_report(own, {"gb_s": 9.0, "match": True, "transport": "tcp/lo: get"}))
    assert staged.endswith(f"via tcp/lo: get; own via {IPC})")  # a different path is named beside the rate


def test_a_failed_registration_or_read_fails_with_its_stage_and_ucx_line():
    own = {"gb_s": 200.0, "match": True}
    imp = {"stage": "register", "error": "nixlBackendError: NIXL_ERR_BACKEND",
           "detail": "[1.0] [h:1:0] cuda_ipc_md.c:99 UCX ERROR cuIpcGetMemHandle() failed: invalid argument"}
    outcome, line = nixl_reexport.verdict(_report(own, imp))
    assert outcome == "fails" and line.startswith("reexport: fails: register: nixlBackendError: NIXL_ERR_BACKEND [")
    assert "cuIpcGetMemHandle" in line and line.endswith("(own allocation's 200.00 GB/s)")
    outcome, line = nixl_reexport.verdict(_report(own, {"stage": "read", "error": "no answer within 60s"}))
    assert (outcome, line) == ("fails", "reexport: fails: read: no answer within 60s (own allocation's 200.00 GB/s)")
    outcome, line = nixl_reexport.verdict(_report(own, {"gb_s": 150.0, "match": False}))
    assert outcome == "fails" and line.startswith("reexport: fails: bytes:")


def test_untested_when_the_probe_itself_or_nixl_on_its_own_memory_fails():
    assert nixl_reexport.verdict(_report(None, None, "owner: no answer within 60s")) == (
        "untested", "reexport: untested: owner: no answer within 60s")
    outcome, line = nixl_reexport.verdict(_report({"stage": "read", "error": "RuntimeError: NIXL READ failed (ERR)"},
                                                  {"stage": "read", "error": "RuntimeError: NIXL READ failed (ERR)"}))
    assert outcome == "untested" and "own allocation fails too: RuntimeError" in line


def test_each_read_has_the_transport_of_the_tables_after_its_mark():
    lines = ["noise", f"{MARK}own", *READ_TABLE, 'REEXPORT={"target": "own"}', f"{MARK}import", 'REEXPORT={}']
    assert nixl_reexport.transports(lines, 64 << 20) == {"own": IPC, "import": IPC}  # no new table: the same one
    assert nixl_reexport.transports([f"{MARK}own", f"{MARK}import"], 1) == {"own": None, "import": None}


def test_the_quoted_error_is_ucx_or_nixl_own_before_any_other():
    lines = ["REEXPORT={\"error\": \"failed\"}", "retry failed once", "[1.0] [h:1:0] md.c:1 UCX ERROR bad handle"]
    assert nixl_reexport.first_error(lines) == "[1.0] [h:1:0] md.c:1 UCX ERROR bad handle"
    assert nixl_reexport.first_error(lines[:2]) == "retry failed once"
    assert nixl_reexport.first_error(["all fine"]) is None
