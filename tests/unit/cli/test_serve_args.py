"""`droidmesh serve`'s checks before anything starts: each adapter is an adapter of BASE, ids are
unique, the API address is loopback and free; and the pair configs it would publish (the zoo's
saved profiles, `--profile` files bound to the served models by their weights). No mesh starts
here: `run` is replaced by a recorder."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.tools.apps import serve as app
from droidmesh.shared.tools.cli.main import main
from droidmesh.shared.zoo.manifest import REPO_ZOO

DEMO = REPO_ZOO / "demo"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Copies of the demo tier's LoRA: one whose base is demo/base (by absolute path), one whose base
    is the family tier's `small`, one whose base is no checkpoint."""
    d = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, base in (("mine", DEMO / "base"), ("foreign", REPO_ZOO / "family" / "small"), ("orphan", d / "nowhere")):
        shutil.copytree(DEMO / "code", d / name)
        cfg = json.loads((d / name / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = str(base)
        (d / name / "adapter_config.json").write_text(json.dumps(cfg))
        out[name] = str(d / name)
    return out


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """What `run` would have started (nothing starts)."""
    calls: list[tuple] = []
    monkeypatch.setattr(app, "run", lambda *a, **k: calls.append(a))
    return calls


def invoke(argv: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *argv], env={"DM_DEBUG": "", "DM_GATEWAY_API_KEYS": ""})
    return result.exit_code, result.stderr


def one_error(code: int, err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("Error: "), err
    for n in needles:
        assert n in lines[0], err


CASES = [
    ("unknown adapter", ["demo/base", "--adapter", "demo/nosuch"], ["demo/nosuch", "zoo list"]),
    ("adapter of another base", ["demo/qa", "--adapter", "demo/code"], ["not of the base demo/qa"]),
    ("adapter of another family", ["demo/base", "--adapter", "{foreign}"], ["not of the base demo/base"]),
    ("adapter whose base is missing", ["demo/base", "--adapter", "{orphan}"], ["not a local checkpoint"]),
    ("full checkpoint as adapter", ["demo/base", "--adapter", "demo/qa"], ["full checkpoint, not an adapter"]),
    ("adapter as the base", ["demo/code", "--adapter", "demo/code"], ["is an adapter", "--adapter demo/code"]),
    ("duplicate names", ["demo/base", "--adapter", "x=demo/code", "--adapter", "x={mine}"], ["'x' is served already"]),
    ("name of the base", ["demo/base", "--adapter", "base=demo/code"], ["'base' is served already"]),
    ("one adapter twice", ["demo/base", "--adapter", "demo/code", "--adapter", "c2=demo/code"],
     ["served already (as 'code')"]),
    ("bad name", ["demo/base", "--adapter", "a.b=demo/code"], ["letters, digits"]),
    ("empty name", ["demo/base", "--adapter", "=demo/code"], ["NAME=MODEL"]),
    ("open host", ["demo/base", "--host", "0.0.0.0"], ["refusing to listen on 0.0.0.0"]),
    ("bad transport", ["demo/base", "--transport", "inproc"], ["inproc"]),
]


@pytest.mark.parametrize("case,argv,needles", CASES, ids=[c for c, _, _ in CASES])
def test_mistake_is_one_usage_line_and_starts_nothing(case, argv, needles, adapters, ran):
    code, err = invoke([a.format(**adapters) for a in argv])
    one_error(code, err, *needles)
    assert ran == []


def test_a_port_in_use_is_refused_before_anything_starts(ran):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, err = invoke(["demo/base", "--port", str(s.getsockname()[1])])
    one_error(code, err, "cannot listen on 127.0.0.1", "--port")
    assert ran == []


def test_good_arguments_reach_run_with_the_plan_and_the_zoo_configs(adapters, ran):
    """demo/base with demo/code (its model name) and a copy under NAME: run gets them as served,
    with the demo tier's saved base-to-code profile bound to the served ids."""
    code, err = invoke(["demo/base", "--adapter", "demo/code", "--adapter", f"mine={adapters['mine']}",
                        "--port", "0", "--transport", "shm"])
    assert code == 0, err
    ((plan, published, opts, log_dir, *_),) = ran
    assert plan.ids == ["base", "code", "mine"] and plan.holder_id == "base-holder"
    assert [(p.pair, p.plan) for p in published] == [("base-to-code", "recompute [0,6)")]
    assert published[0].cfg.receiver_sha256 == plan.adapters[0].ref.sha256
    assert opts.port == 0 and opts.transport == "shm" and log_dir is None
    args = app.receiver_args(plan, opts.transport)
    assert args["adapters"] == [f"code={DEMO / 'code'}", f"mine={adapters['mine']}"]
    assert args["model_id"] == "base" and args["holder_id"] == "base-holder" and args["transport"] == "shm"


def test_a_profile_file_is_bound_to_the_served_names(adapters, ran, tmp_path):
    """`--profile` for demo/base -> demo/code, with the adapter served as `helper`: the config names
    the served ids; a profile of models not served is refused in one line."""
    code, err = invoke(["demo/base", "--adapter", "helper=demo/code", "--port", "0",
                        "--profile", str(DEMO / "profiles" / "base-to-code.json")])
    assert code == 0, err
    ((plan, published, *_),) = ran
    assert [(p.cfg.sender_model, p.cfg.receiver_model) for p in published] == [("base", "helper")]
    code, err = invoke(["demo/base", "--adapter", "demo/code", "--port", "0",
                        "--profile", str(DEMO / "profiles" / "base-to-qa.json")])
    one_error(code, err, "base-to-qa.json", "not two of the models served here")


def test_plan_models_resolves_names_and_paths(adapters):
    plan = app.plan_models("demo/base", [f"other={adapters['mine']}"])
    assert plan.ids == ["base", "other"] and plan.adapters[0].ref.path == Path(adapters["mine"])
    assert app.adapter_spec("demo/code") == (None, "demo/code")
    assert app.adapter_spec("a=b=c") == ("a", "b=c")
    with pytest.raises(ConfigError, match="not of the base"):
        app.plan_models("family/small", ["demo/code"])
