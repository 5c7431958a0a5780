"""Every user mistake ends in one `Error:` line on stderr and a non-zero exit, never a traceback.

`BAD_INPUT` is the table the CLI reference's note (docs/reference/cli.md) is made from: (case id, argv). Files named in an
argv as `{name}` are made by the `files` fixture. No NATS runs here: the NATS commands point at
a closed port and must fail fast in one line instead of hanging.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.tools.cli.main import main


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"  # closed once the socket is


NO_NATS = ["--nats", _closed_port(), "--timeout", "5"]
EVAL = ["eval", "--sender", "demo/base", "--receiver", "demo/qa", "--json", "{out}/e.json", "--n", "1"]

BAD_INPUT = [
    ("unknown model", ["eval", "--sender", "demo/nosuch", "--receiver", "demo/qa", "--task", "multihop_qa",
                       "--json", "{out}/e.json"]),
    ("unknown task", ["zoo", "data", "--task", "nosuch", "--out", "{out}/d.jsonl"]),
    ("unknown task for eval", [*EVAL, "--task", "nosuch"]),
    ("unsupported architecture", ["eval", "--sender", "{bert}", "--receiver", "demo/qa", "--task", "multihop_qa",
                                  "--json", "{out}/e.json"]),
    ("missing weights", ["eval", "--sender", "{noweights}", "--receiver", "demo/qa", "--task", "multihop_qa",
                         "--json", "{out}/e.json"]),
    ("empty context file", ["ask", "--context", "{empty}", "--question", "q", *NO_NATS]),
    ("binary context file", ["ask", "--context", "{binary}", "--question", "q", *NO_NATS]),
    ("binary prefill context", ["prefill", "--sender", "base", "--context", "{binary}", *NO_NATS]),
    ("empty question", ["ask", "--context", "{text}", "--question", " ", *NO_NATS]),
    ("reversed group", ["bench", "pipeline", "--group", "6:4"]),
    ("group beyond the model", ["bench", "load", "--group", "0:40"]),
    ("not a group", ["bench", "bandwidth", "--group", "four"]),
    ("out-of-range pair index", ["bench", "quality", "--pair", "9"]),
    ("bad number list", ["bench", "load", "--rates", "1,x"]),
    ("reversed eval group", [*EVAL, "--task", "multihop_qa", "--groups", "12:8"]),
    ("shard past its count", [*EVAL, "--task", "multihop_qa", "--shard", "2/2"]),
    ("merging what is not an eval", ["eval-merge", "{jsonobj}", "--json", "{out}/m.json"]),
    ("merging a binary file", ["eval-merge", "{binary}", "--json", "{out}/m.json"]),
    ("shards of a translated eval", [*EVAL, "--task", "multihop_qa", "--translator", "{text}", "--shard", "0/2"]),
    ("both kinds of group", [*EVAL, "--task", "multihop_qa", "--groups", "0:2", "--group-sizes", "2"]),
    ("jobs and a shard", [*EVAL, "--task", "multihop_qa", "--jobs", "2", "--shard", "0/2"]),
    ("jobs for a translated eval", [*EVAL, "--task", "multihop_qa", "--translator", "{text}", "--jobs", "2"]),
    ("no such wire", [*EVAL, "--task", "multihop_qa", "--wire", "int2"]),
    ("bad JSONL", [*EVAL, "--task", "mine", "--data", "{badjsonl}"]),
    ("JSONL row missing fields", [*EVAL, "--task", "mine", "--data", "{rowjsonl}"]),
    ("bad JSONL for profile", ["profile", "--sender", "demo/base", "--receiver", "demo/qa", "--task", "mine",
                               "--data", "{badjsonl}", "--json", "{out}/p.json"]),
    ("config file not JSON", ["config", "publish", "{binary}", "--dry-run"]),
    ("config file neither kind", ["config", "publish", "{jsonobj}", "--dry-run"]),
    ("config with a group beyond the model", ["config", "publish", "{badconfig}", "--dry-run"]),
    ("no NATS for ask", ["ask", "--context", "{text}", "--question", "q", *NO_NATS]),
    ("no NATS for receivers", ["receivers", *NO_NATS]),
    ("no NATS for config show", ["config", "show", *NO_NATS]),
    ("TLS cert without key", ["receivers", "--tls-cert", "{text}", *NO_NATS]),
    ("unknown option", ["ask", "--bogus"]),
    ("malformed scope", ["prefill", "--sender", "base", "--context", "{text}", "--scope", "a b", *NO_NATS]),
    ("bad tenant name", ["keys", "add", "--file", "{out}/keys.toml", "--tenant", "a b", "--models", "qa"]),
    ("key file not TOML", ["keys", "list", "--file", "{binary}"]),
    ("appending to a bad key file", ["keys", "add", "--file", "{jsonobj}", "--tenant", "a", "--models", "qa"]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The bad (and the few good) inputs the table names."""
    d = tmp_path_factory.mktemp("bad")
    (d / "out").mkdir()
    bert, noweights = d / "bert", d / "noweights"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    (bert / "model.safetensors").write_bytes(b"")  # never read: the architecture is refused first
    noweights.mkdir()
    (noweights / "config.json").write_text((_demo_dir() / "base" / "config.json").read_text())
    (d / "empty.txt").write_text("  \n")
    (d / "binary.bin").write_bytes(bytes(range(256)))
    (d / "text.txt").write_text("a context\n")
    (d / "bad.jsonl").write_text('{"context": "c", "input": "q", "answers": ["a"]}\n{not json\n')
    (d / "row.jsonl").write_text('{"context": "c", "input": "q"}\n')
    (d / "obj.json").write_text('{"hello": 1}')
    profile = json.loads((_demo_dir() / "profiles" / "base-to-qa.json").read_text())
    profile["chosen"] = {**profile["chosen"], "start": 10, "end": 14}
    (d / "badconfig.json").write_text(json.dumps(profile))
    return {"out": str(d / "out"), "bert": str(bert), "noweights": str(noweights), "empty": str(d / "empty.txt"),
            "binary": str(d / "binary.bin"), "text": str(d / "text.txt"), "badjsonl": str(d / "bad.jsonl"),
            "rowjsonl": str(d / "row.jsonl"), "jsonobj": str(d / "obj.json"), "badconfig": str(d / "badconfig.json")}


def _demo_dir():
    from droidmesh.shared.zoo.manifest import REPO_ZOO

    return REPO_ZOO / "demo"


def invoke(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `droidmesh ARGV` in this process."""
    result = CliRunner().invoke(main, argv, env={"DM_DEBUG": ""})
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("case,argv", BAD_INPUT, ids=[c for c, _ in BAD_INPUT])
def test_mistake_is_one_line(case, argv, files):
    """The mistake exits non-zero with exactly one non-empty stderr line starting `Error:`, no traceback."""
    code, _out, err = invoke([a.format(**files) for a in argv])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err


def test_unexpected_error_is_one_line_with_debug_hint(monkeypatch):
    """A bug (not a user mistake) is one line naming DM_DEBUG; DM_DEBUG=1 re-raises it."""
    import droidmesh.shared.zoo.manifest as manifest

    monkeypatch.setattr(manifest, "listing", lambda: 1 / 0)
    result = CliRunner().invoke(main, ["zoo", "list"], env={"DM_DEBUG": ""})
    assert result.exit_code == 1 and result.stderr.strip().count("\n") == 0
    assert "ZeroDivisionError" in result.stderr and "DM_DEBUG=1" in result.stderr
    debug = CliRunner().invoke(main, ["zoo", "list"], env={"DM_DEBUG": "1"})
    assert isinstance(debug.exception, ZeroDivisionError)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_wire_the_head_dim_cannot_carry_is_refused_before_a_row_is_scored(jobs, files):
    """The demo tier's head dim (32) is not a multiple of 64: refused once the models are read (the
    weights' loading bars come first), before any row or process starts."""
    code, _out, err = invoke([a.format(**files) for a in [*EVAL, "--task", "multihop_qa", "--wire", "int4-g64-e-int8",
                                                          "--jobs", jobs]])
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert code == 2 and last.startswith("Error: ") and "needs a head dim it divides, not 32" in last, err
    assert "Traceback" not in err and not (Path(files["out"]) / "e.json").exists()


@pytest.mark.parametrize(("extra", "says"), [
    (["--max-layers", "4"], "a cap on the group's layers (4) needs the fidelity search"),
    (["--search", "fidelity", "--granularity", "4", "--max-layers", "2"], "a cap of 2 layers is below the granularity 4"),
])
def test_a_group_cap_the_search_cannot_keep_is_one_line_before_the_models_load(extra, says, files, monkeypatch):
    import droidmesh.shared.model.adapter as adapter

    monkeypatch.setattr(adapter, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, _out, err = invoke(["profile", "--sender", "demo/base", "--receiver", "demo/qa", "--task", "multihop_qa",
                              *extra, "--json", f"{files['out']}/p.json"])
    assert code == 2 and err.strip().count("\n") == 0 and says in err, err
