"""Every `droidmesh` command and subcommand runs: with its defaults (only required options given)
on the ci tier, against a real nats-server and real services where it needs a mesh.

Where a default is inherently long (row counts, context lengths, sizes, seconds), the
invocation passes the smallest values instead; `SMALL` names each such flag so the table is
honest about it. Commands run in this process through click's runner (the services they start
are separate processes); `test_every_command_is_invoked` keeps the table complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from droidmesh.shared.audit import estimate, logs, relay
from droidmesh.shared.service.launch import Proc, start_nats
from droidmesh.shared.tools.cli.main import main
from tests.system.conftest import start_together, stop_together, words

pytestmark = pytest.mark.system

THREADS = {"OMP_NUM_THREADS": "1"}
AUDIT_LOGS = Path(__file__).resolve().parents[1] / "data" / "audit"  # a committed sample of receiver request logs

# (command path, extra argv): required options, plus the smallest values where a default is long.
INVOCATIONS: list[tuple[str, list[str]]] = [
    ("agents", ["--rows", "1", "--logs", "{tmp}/agents"]),
    ("zoo list", []),
    ("zoo build", ["--tier", "ci"]),  # cached: the session's ci tier is in DROIDMESH_ZOO_DIR
    ("zoo data", ["--task", "multihop_qa", "--out", "{tmp}/rows.jsonl"]),
    ("eval", ["--sender", "ci/summ", "--receiver", "ci/qa", "--task", "multihop_qa", "--json", "{tmp}/eval.json",
              "--n", "2"]),
    ("profile", ["--sender", "ci/summ", "--receiver", "ci/qa", "--task", "multihop_qa", "--json", "{tmp}/prof.json",
                 "--n-train", "2", "--n-test", "2", "--guided-only", "--no-robustness", "--publish", "--nats", "{url}",
                 "--budget", "0", "--allow-no-signal"]),  # the ci tier's untrained qa scores 0 on multihop_qa: no signal, by design
    ("config publish", ["{tmp}/prof.json", "--nats", "{url}"]),
    ("config show", ["--nats", "{url}"]),
    ("config relay-policy", ["{tmp}/policy.json", "--nats", "{url}", "--dry-run"]),
    ("receivers", ["--nats", "{url}"]),
    ("prefill", ["--sender", "summ", "--context", "{tmp}/context.txt", "--nats", "{url}"]),
    ("ask", ["--context", "{tmp}/context.txt", "--question", "what?", "--nats", "{url}"]),
    ("audit", ["--logs", str(AUDIT_LOGS)]),
    ("nats-auth", []),  # the shipped roster's conf, on stdout
    ("keys add", ["--file", "{tmp}/keys.toml", "--tenant", "a", "--models", "qa"]),
    ("keys list", ["--file", "{tmp}/keys.toml"]),
    ("bench codecs", ["--pairs", "summ:qa", "--rows", "1", "--tokens", "64", "--rates", "0.5", "--repeats", "1",
                      "--calibration-rows", "2", "--shares", "0.9"]),
    ("bench ttft", ["--contexts", "32", "--repeats", "1"]),
    ("bench quality", ["--rows", "1", "--long-tokens", "64", "--repeats", "1"]),
    ("bench pipeline", ["--tokens", "32", "--repeats", "1"]),
    ("bench bandwidth", ["--tokens", "32", "--repeats", "1", "--rates", "0"]),  # reports a skip without netns rights
    ("bench transfer", ["--sizes", "65536", "--repeats", "1"]),
    ("bench control", ["--events", "10"]),
    ("bench drift", ["--n-before", "1", "--max-shifted", "1", "--profile-rows", "1"]),
    ("bench load", ["--tokens", "32", "--rates", "2", "--seconds", "1", "--copies", "1"]),
    ("bench load", ["--workload", "agents", "--rows", "2", "--rates", "4", "--logs", "{tmp}/load-agents"]),
    ("bench sidechannel", ["--tokens", "64", "--trials", "4", "--warmup", "0"]),
    ("bench stall", ["--requests", "3", "--stalled", "1", "--words", "60", "--transport", "shm"]),
    ("bench idle", ["--seconds", "1", "--transport", "shm"]),
    ("bench adapters", ["--base", "ci/base", "--adapters", "ci/code", "--counts", "1", "--tokens", "32", "--repeats", "1"]),
    ("bench held", ["--base", "ci/base", "--adapters", "ci/code", "--pairs", "base:code", "--group", "2,4", "--docs", "1",
                    "--chars", "600,900", "--model", ""]),
    ("demo", ["--rows", "1"]),
]
# Commands that run in the foreground until stopped: started and stopped by their own tests.
COVERED_ELSEWHERE = {"serve": "tests/system/test_serve.py",
                     "bench peer": "tests/unit/bench/test_peer.py"}  # its peer is a stand-in there
SMALL = {"--n", "--n-train", "--n-test", "--guided-only", "--no-robustness", "--contexts", "--repeats", "--rows",
         "--tokens", "--rates", "--sizes", "--events", "--seconds", "--copies", "--pairs", "--n-before", "--max-shifted",
         "--profile-rows", "--trials", "--warmup", "--counts", "--docs", "--chars", "--calibration-rows", "--shares"}


def _leaves(group: click.Group, prefix: str = "") -> list[str]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        out += _leaves(cmd, path + " ") if isinstance(cmd, click.Group) else [path]
    return out


def test_every_command_is_invoked():
    """The invocation table (or a test of its own) names every leaf command of the CLI."""
    assert sorted({c for c, _ in INVOCATIONS} | set(COVERED_ELSEWHERE)) == _leaves(main)


@pytest.fixture(scope="module")
def mesh(zoo_ci: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(NATS url, scratch dir): nats-server, a broker, the ci tier's `summ` sender and `qa` receiver."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "context.txt").write_text(words(120))
    (tmp / "policy.json").write_text(json.dumps(relay.policy_proposal(estimate.run_audit(AUDIT_LOGS, n_boot=100))))
    nats, url = start_nats(store_dir=str(tmp / "js"))
    procs: list[Proc] = []
    try:
        start_together(url, [
            ("cache_broker", {}, {"env": THREADS}),
            ("sender", {"model_path": zoo_ci / "summ", "model_id": "summ", "e_layers": [0]}, {"env": THREADS}),
            ("receiver", {"model_path": zoo_ci / "qa", "model_id": "qa"}, {"env": THREADS}),
        ], procs)
        yield url, tmp
    finally:
        stop_together(procs)
        nats.stop()


@pytest.mark.parametrize("command,argv", INVOCATIONS, ids=[c for c, _ in INVOCATIONS])
def test_command_runs(command, argv, mesh, zoo_ci, monkeypatch):
    """The command exits 0 with output, and without a traceback."""
    url, tmp = mesh
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(zoo_ci.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [*command.split(), *(a.format(tmp=tmp, url=url) for a in argv)]
    result = CliRunner().invoke(main, args, env={"DM_DEBUG": "1"}, catch_exceptions=True)
    assert result.exit_code == 0, f"{args}: {result.stderr}\n{result.stdout}\n{result.exception!r}"
    assert result.stdout.strip() and "Traceback" not in result.stderr
    if command == "profile":  # 2 test rows: the profile says its choice means nothing
        saved = json.loads((tmp / "prof.json").read_text())
        assert "test rows" in saved["sample_warning"] and "warning:" in result.stderr
    if command == "receivers":
        assert result.stdout.split()[0] == "qa"
    if command == "agents":  # every agent is also a sender: its model's sender took its output
        for model in ("qa", "code"):
            lines = (tmp / "agents" / f"sender-{model}.log").read_text().splitlines()
            held = [r for r in map(logs.parse_line, lines) if r is not None and r.get("event") == "request"]
            assert held and all(r["tokens"] > 0 for r in held)
    if command == "ask":  # no --receiver: the one receiver model up answered
        assert "path:" in result.stdout
