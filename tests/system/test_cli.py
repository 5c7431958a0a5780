"""Every `droidmesh` command and subcommand runs: with its defaults (only required options given)
on the ci tier, against a real nats-server and real services where it needs a mesh.

Where a default is inherently long (row counts, context lengths, sizes, seconds), the
invocation passes the smallest values instead; `SMALL` names each such flag so the table is
honest about it. Commands run in this process through click's runner (the services they start
are separate processes); `test_every_command_is_invoked` keeps the table complete.

Each invocation's output is checked by its entry of `EXPECT` (`test_every_invocation_has_an_expectation`
keeps that complete too): the table header and a row per thing asked for, the names, counts and
settings it echoes back, the files it writes; structural facts and deterministic values, never a timing.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import json
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from droidmesh.shared import __version__
from droidmesh.shared.audit import estimate, logs, relay
from droidmesh.shared.service.launch import Proc, start_nats
from droidmesh.shared.tools.cli.main import main
from tests.system.conftest import start_together, stop_together, words

# The invocation table is one scripted session over one mesh: `config publish` and `config show`
# read the profile `profile` wrote, `keys list` the file `keys add` made. Its order is part of
# the test, so `--random-order` leaves it as written.
pytestmark = [pytest.mark.system, pytest.mark.random_order(disabled=True)]

THREADS = {"OMP_NUM_THREADS": "1"}
REPO = Path(__file__).resolve().parents[2]
AUDIT_LOGS = REPO / "tests" / "data" / "audit"  # a committed sample of receiver request logs
CONTEXT_WORDS = 120  # context.txt: zoo filler words, one token each

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
    ("bench layered", ["--pair", "ci/summ:ci/qa", "--task", "multihop_qa", "--group", "1,2", "--probe-rows", "1",
                       "--rows", "2", "--json", "{tmp}/layered.json"]),
    ("bench ttft", ["--contexts", "32", "--repeats", "1"]),
    ("bench quality", ["--rows", "1", "--long-tokens", "64", "--repeats", "1"]),
    ("bench pipeline", ["--tokens", "32", "--repeats", "1"]),
    ("bench bandwidth", ["--tokens", "32", "--repeats", "1", "--rates", "0"]),  # reports a skip without netns rights
    ("bench transfer", ["--sizes", "65536", "--repeats", "1"]),
    ("bench sender-loop", ["--tokens", "32", "--repeats", "1", "--codecs", "raw,int4", "--client-process",
                           "--json", "{tmp}/sender-loop.json"]),
    ("bench hosts", ["--engine", str(REPO / "docs" / "bench" / "gpu" / "check-h200-llama3-8b-graphs.json"),
                     "--contexts", "4096", "--plot", "{tmp}/hosts.png"]),
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
    ("bench screen", ["--pairs", "ci/summ:ci/qa", "--contexts", "2", "--tokens", "64", "--plan", "full_reuse",
                      "--dtype", "float32"]),
    ("config delete", ["--sender", "summ", "--receiver", "qa", "--nats", "{url}"]),  # last: the published pair goes
]
# Commands that run in the foreground until stopped: started and stopped by their own tests.
COVERED_ELSEWHERE = {"serve": "tests/system/test_serve.py",
                     "bench peer": "tests/unit/bench/test_peer.py",  # its peer is a stand-in there
                     "bench vllm": "tests/system/test_vllm_connector.py",  # its measure, on that test's engine
                     "bench vllm-rows": "tests/system/test_vllm_connector.py",  # its rows, on that test's engine
                     "demo": "tests/system/test_secure_defaults.py",  # the same invocation, under auth
                     "eval-merge": "tests/integration/zoo/test_ci_tier.py"}  # the shards of an `eval` it runs
SMALL = {"--n", "--n-train", "--n-test", "--guided-only", "--no-robustness", "--contexts", "--repeats", "--rows",
         "--tokens", "--rates", "--sizes", "--events", "--seconds", "--copies", "--pairs", "--n-before", "--max-shifted",
         "--profile-rows", "--trials", "--warmup", "--counts", "--docs", "--chars", "--calibration-rows", "--shares",
         "--probe-rows"}


IDS = [f"{c} --workload {a[a.index('--workload') + 1]}" if "--workload" in a else c for c, a in INVOCATIONS]


def _leaves(group: click.Group, prefix: str = "") -> list[str]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        path = f"{prefix}{name}"
        out += _leaves(cmd, path + " ") if isinstance(cmd, click.Group) else [path]
    return out


def test_every_command_is_invoked():
    """The invocation table (or a test of its own) names every leaf command of the CLI."""
    assert sorted({c for c, _ in INVOCATIONS} | set(COVERED_ELSEWHERE)) == _leaves(main)


def test_every_invocation_has_an_expectation():
    """Each invocation's output is checked by its own entry of `EXPECT` (ids are unique)."""
    assert len(set(IDS)) == len(IDS)
    assert sorted(EXPECT) == sorted(IDS)


@pytest.fixture(scope="module")
def mesh(zoo_ci: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(NATS url, scratch dir): nats-server, a broker, the ci tier's `summ` sender and `qa` receiver."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "context.txt").write_text(words(CONTEXT_WORDS))
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


# ---- what each invocation must print (and write) -------------------------------------------------
# Structural facts and deterministic values only: table headers, a row per thing asked for, names,
# counts and settings echoed back, values the command derives from its inputs; never a timing.


@dataclasses.dataclass(frozen=True)
class Ran:
    out: str  # stdout
    err: str  # stderr
    tmp: Path  # the mesh's scratch dir ({tmp} in INVOCATIONS), where files the command wrote are
    zoo: Path  # the ci tier's directory
    manifest: dict  # ... and its manifest

    def layers(self, model: str) -> int:
        return self.manifest["models"][model]["layers"]


def table(out: str, *columns: str, more: bool = False) -> list[dict[str, str]]:
    """The rows, as {column: cell} (cells stripped; '' for None), of the `report.format_table` table in
    `out` whose header is `columns` (with `more`: starts with them; the dict has every header column)."""
    lines = out.splitlines()
    for i, (head, rule) in enumerate(itertools.pairwise(lines)):
        names = head.split()
        if (names[:len(columns)] if more else names) != list(columns) or not set(rule) <= {"-", " "} or "-" not in rule:
            continue
        spans = [m.span() for m in re.finditer(r"-+", rule)]
        gaps = [(a, b) for (_, a), (b, _) in itertools.pairwise(spans)]
        rows = []
        for line in lines[i + 2:]:
            if len(line) != len(rule) or any(line[a:b].strip() for a, b in gaps):
                break
            rows.append({c: line[a:b].strip() for c, (a, b) in zip(names, spans, strict=True)})
        return rows
    raise AssertionError(f"no table with columns {columns}")


def col(rows: list[dict[str, str]], name: str) -> list[str]:
    return [r[name] for r in rows]


def has(out: str, pattern: str) -> re.Match:
    """The first line of `out` that `pattern` matches (from its start; re.M)."""
    m = re.search(pattern, out, re.M)
    assert m, f"no line matches {pattern!r}"
    return m


PATHS = {"partial", "full_reuse", "cacheblend", "full_prefill", "fallback", "sender_own", "translate"}  # schemas.Path
AGENTS = [("analyst", "qa"), ("verifier", "qa"), ("coder", "code"), ("tester", "code"), ("reviewer", "qa")]  # demo tier
AGENT_COLUMNS = ("rate", "agent", "model", "requests", "ttft_p50_ms", "ttft_p99_ms", "paths", "from", "reused_p50",
                 "quality")


def path_mix(cell: str) -> dict[str, int]:
    """'full_prefill:1 full_reuse:1' -> {path: count}; every path a known one."""
    mix = {p: int(n) for p, n in (x.split(":") for x in cell.split())}
    assert set(mix) <= PATHS | {"error"}, cell
    return mix


def agents_table(r: Ran, rate: str, rows: int, logs: str) -> None:
    """The agents table: a row per agent, in pipeline order, each with every row's request and path."""
    got = table(r.out, *AGENT_COLUMNS)
    assert [(x["agent"], x["model"]) for x in got] == AGENTS
    for x in got:
        assert x["rate"] == rate and x["requests"] == str(rows) and sum(path_mix(x["paths"]).values()) == rows, x
    assert r.out.rstrip().endswith(f"audit it: droidmesh audit --logs {r.tmp / logs}")


def expect_agents(r: Ran) -> None:
    agents_table(r, "one row", 1, "agents")
    for model in ("qa", "code"):  # every agent is also a sender: its model's sender took its output
        lines = (r.tmp / "agents" / f"sender-{model}.log").read_text().splitlines()
        held = [x for x in map(logs.parse_line, lines) if x is not None and x.get("event") == "request"]
        assert held and all(x["tokens"] > 0 for x in held)


def expect_zoo_list(r: Ran) -> None:
    for name, m in r.manifest["models"].items():  # the session's ci tier, each model at its path
        parent = f"ci/{m['parent']}" if m["parent"] else "-"
        has(r.out, rf"^ci/{name} +{m['kind']} +parent={parent} +for={re.escape(m['task'])} +{re.escape(str(r.zoo / name))}$")
    for p in r.manifest["pairs"]:
        has(r.out, rf"^pair {p['sender']}-to-{p['receiver']} +ci/{p['sender']} -> ci/{p['receiver']} on {p['task']}$")


def expect_zoo_build(r: Ran) -> None:
    has(r.out, rf"^tier ci at {re.escape(str(r.zoo))} \(recipe {r.manifest['recipe_hash'][:12]}, \d+s this run\)$")
    for name, m in r.manifest["models"].items():
        has(r.out, rf"^  {name} +{m['kind']} +parent={m['parent'] or '-'} +for={re.escape(m['task'])} +"
                   rf"sha256={m['sha256'][:16]}$")


def expect_zoo_data(r: Ran) -> None:
    assert r.out.strip() == f"wrote 100 rows to {r.tmp / 'rows.jsonl'}"  # --n's default
    rows = [json.loads(line) for line in (r.tmp / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 100 and all(x["_id"].startswith("multihop_qa-test-") for x in rows)
    assert all(x["context"] and x["input"] and x["answers"] for x in rows)


def expect_eval(r: Ran) -> None:
    ev, n = json.loads((r.tmp / "eval.json").read_text()), r.layers("qa")
    assert {k: ev[k] for k in ("sender", "receiver", "task", "metric", "rows", "total_layers", "split", "data")} == {
        "sender": "ci/summ", "receiver": "ci/qa", "task": "multihop_qa", "metric": "f1", "rows": 2, "total_layers": n,
        "split": "test", "data": "zoo"}
    assert [p["layer"] for p in ev["per_layer_reuse"]] == list(range(n))  # --layer-stride 1: every layer
    assert r.out.splitlines()[0] == f"multihop_qa (f1, 2 rows, {n} layers)"
    has(r.out, r"^path +quality +nll +kl +top1 +greedy +vs full prefill, 95 % interval$")
    for name in ("sender alone", "receiver full prefill", "receiver full reuse", *(f"reuse only layer {i}" for i in range(n))):
        has(r.out, rf"^{name} +-?\d")
    has(r.out, rf"^receiver full prefill +{ev['receiver_full_prefill']['quality']:.4f} ")  # the JSON's numbers
    assert all("vs_full_prefill" in ev[k] for k in ("sender_alone", "receiver_full_reuse"))  # each with its interval
    has(r.out, r"^receiver full reuse .*  (\S+ \[.*\] (within|below|undecided)|\S+, no interval \(too few rows\)"
               r"|n/a \(full prefill scores 0\))$")
    for g in ev["best_groups"]:
        has(r.out, rf"^recompute \[{g['start']},{g['end']}\) ")
    has(r.out, rf"^full reuse loses .* critical layers {re.escape(str(ev['summary']['critical_layers']))} ")


def _profile(r: Ran) -> dict:
    return json.loads((r.tmp / "prof.json").read_text())


def expect_profile(r: Ran) -> None:
    prof, n = _profile(r), r.layers("qa")
    assert {k: prof["models"][k] for k in ("sender", "receiver")} == {"sender": "ci/summ", "receiver": "ci/qa"}
    assert (prof["task"], prof["total_layers"], prof["rows"], prof["search"]) == (
        "multihop_qa", n, {"train": 2, "test": 2}, "guided")  # --guided-only
    # 2 test rows: the profile says its choice means nothing
    assert "test rows" in prof["sample_warning"] and "warning:" in r.err
    ch = prof["chosen"]
    assert r.out.splitlines()[0] == f"summ-to-qa on multihop_qa ({n} layers)"
    has(r.out, rf"^  chosen \[{ch['start']},{ch['end']}\) \({ch['recomputed_layers']} layers\) ")
    has(r.out, r"^  guided search: \d+ configs")
    has(r.out, r"^  transfer search \(maps fitted on 2 contexts")  # --n-train 2
    has(r.out, r"^  published summ-to-qa v\d+$")  # --publish


def expect_config_publish(r: Ran) -> None:
    ch = _profile(r)["chosen"]
    has(r.out, rf"^published summ-to-qa\.v\d+ to dm_recompute_configs: .* \({ch['recomputed_layers']} of "
               rf"{r.layers('qa')} layers recomputed\)$")


def expect_config_show(r: Ran) -> None:
    prof = _profile(r)
    lines = r.out.strip().splitlines()
    assert len(lines) == 1, "one pair published"
    has(lines[0], rf"^summ-to-qa\.v\d+  task multihop_qa  chosen .* \({prof['chosen']['recomputed_layers']}/"
                  rf"{r.layers('qa')} layers, .*  sha256 {prof['models']['sender_sha256'][:8]}->"
                  rf"{prof['models']['receiver_sha256'][:8]}$")


def expect_relay_policy(r: Ran) -> None:
    buckets = json.loads((r.tmp / "policy.json").read_text())["buckets"]
    verdicts = ", ".join(f"[{lo:g},{hi:g}) {'-' if b['relay'] is None else 'relay' if b['relay'] else 'own prefill'}"
                         for b in buckets for lo, hi in [b["reusable_fraction"]])
    has(r.out, rf"^would publish summ-to-qa\.v\d+: {re.escape(verdicts)}$")  # --dry-run


def expect_receivers(r: Ran) -> None:
    assert re.fullmatch(rf"qa +1 instance\(s\)  version {re.escape(__version__)}  \S+", r.out.strip())


def expect_prefill(r: Ran) -> None:
    has(r.out, r"^context_id: [0-9a-f]{32}$")
    assert has(r.out, r"^tokens: (\d+)$")[1] == str(CONTEXT_WORDS + 1)  # and the start token
    assert int(has(r.out, r"^bytes: ([\d,]+)$")[1].replace(",", "")) > 0


def expect_ask(r: Ran) -> None:
    assert r.out.split("\n\n")[0].strip(), "an answer"
    path = has(r.out, r"^path: (\w+)(?: \(.*\))?   plan: .+   served by: qa-\S+$")[1]  # no --receiver: the one up
    assert path in PATHS
    pulled = has(r.out, r"^ttft: [\d.]+ ms   bytes pulled: ([\d,]+)( from summ-\S+)?$")
    if path != "full_prefill":  # reused KV: pulled from the summ sender that prefilled it
        assert pulled[1] != "0" and pulled[2], pulled[0]
    for stage in ("start", "first_token"):
        has(r.out, rf"^  {stage} +[\d.]+ ms$")


def expect_audit(r: Ran) -> None:  # the committed sample's counts
    rows = table(r.out, "stratum", "requests", "treatment", "control", "ate_ttft_s", "ci_low", "ci_high",
                 "policy_p50_ttft_s", "full_prefill_p50_ttft_s", "quality_agreement", "blind", "blind_p50_ttft_s")
    by = {x["stratum"]: x for x in rows}
    assert (by["overall"]["requests"], by["overall"]["treatment"], by["overall"]["control"]) == ("48", "33", "15")
    for stratum in ("reusable=[0.95,1]", "context=<1K", "pair=base->qa", "pair=summ->qa", "topology=same_host", "load=0"):
        assert stratum in by, stratum
    for outcome in ("ttft_s", "e2e_s", "bytes", "agreement"):
        has(r.out, rf"^effect of relaying on {outcome}: ")
    has(r.out, r"^48 requests from 65 lines in 1 files .*; 95% CI, 2000 resamples$")  # --bootstrap's default


def expect_nats_auth(r: Ran) -> None:
    assert r.out == (REPO / "infra" / "nats" / "nats-auth.conf").read_text()  # the shipped roster's, as checked in
    has(r.out, r"^authorization \{$")
    users = re.findall(r"\{ user: ([\w-]+), password: \$DM_NATS_PASSWORD_[A-Z_]+\b", r.out)
    assert users == ["sender-summ", "receiver-qa", "broker", "profiler", "client", "gateway", "admin"]


def _key_entries(r: Ran) -> list[dict]:
    return tomllib.loads((r.tmp / "keys.toml").read_text())["key"]


def expect_keys_add(r: Ran) -> None:
    key = r.out.strip()
    kid = re.fullmatch(r"dmk_([0-9a-f]{12})_\S+", key)[1]
    [entry] = _key_entries(r)  # the file holds the key's hash, never the key
    assert (entry["id"], entry["tenant"], entry["models"]) == (kid, "a", ["qa"])
    assert entry["hash"] == "sha256:" + hashlib.sha256(key.encode()).hexdigest() and key not in (r.tmp / "keys.toml").read_text()


def expect_keys_list(r: Ran) -> None:
    [entry] = _key_entries(r)
    assert re.fullmatch(rf"{entry['id']}  tenant=a  models=qa  rpm=60  tpm=100000  concurrency=8  scope=tenant:a\.[0-9a-f]+",
                        r.out.strip())


def expect_bench_codecs(r: Ran) -> None:
    rows = table(r.out, "pair", "tokens", "link_gbit", "config", "wire_bytes", "bytes_vs_raw", "bytes_vs_raw_group",
                 "bytes_on_wire", "quality", "quality_vs_full", "nll", "kl", "prepare_s", "encode_s", "decode_s",
                 "ttft_s", "error")
    assert {(x["pair"], x["tokens"], x["link_gbit"]) for x in rows} == {("summ->qa", "64", "0.5")}
    group = has(r.out, r"^pair summ->qa \(demo/summ -> demo/qa, task multihop_qa, .*: plan recompute (\[\d+,\d+\)) .*"
                       r"SCD fit on 2 train contexts")[1]  # a bare name: the demo tier's; --calibration-rows 2
    configs = col(rows, "config")
    assert configs[:2] == ["full prefill", "full reuse raw"]  # the baselines
    for config in (f"raw {group}", f"int8 {group}", f"int4 {group}", f"lowrank s0.9 {group}"):  # --shares 0.9
        assert config in configs, config
    assert not any(re.match(r"lowrank s[\d.]+ \[", c) and not c.startswith("lowrank s0.9 ") for c in configs)
    has(r.out, r"^SCD target \(summ->qa, 64 tokens\): ")
    has(r.out, r"^runtime \d+ s \(")


def expect_bench_layered(r: Ran) -> None:
    rows = table(r.out, "wire", "int4_layers", "quality", "vs_full_prefill", "verdict", "vs_raw", "kl_nats",
                 "bytes_vs_raw_bf16", "bytes_vs_plan_raw")
    assert col(rows, "wire") == ["raw", "int8", "int4", "chosen"]
    by = {x["wire"]: x for x in rows}
    assert float(by["raw"]["bytes_vs_plan_raw"]) == 1.0 and float(by["int4"]["bytes_vs_plan_raw"]) < float(
        by["int8"]["bytes_vs_plan_raw"]) < 1.0
    got = json.loads((r.tmp / "layered.json").read_text())
    assert got["rows"] == 2 and got["layered"]["probe_rows"] == 1 and got["plan"]["groups"] == [[1, 2]]
    layers = got["wires"]["int8"]["codec_params"]["layers"]
    assert layers[1] == "r" and set(layers) == {"8", "r"}  # layer 1 recomputed; every other one int8
    has(r.out, r"^int4 at layers \[[\d, ]*\] \(group (\d+|default)\), E (raw|int8): ")


def expect_bench_ttft(r: Ran) -> None:
    rows = table(r.out, "context_tokens", "mode", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal_speedup")
    assert set(col(rows, "context_tokens")) == {"32"} and set(col(rows, "total_layers")) == {"12"}  # the random 12-layer Llama
    assert [(x["mode"], x["recomputed_layers"]) for x in rows[:2]] == [("full_prefill", "12"), ("full_reuse", "0")]
    partial = rows[2:]
    assert partial and all(x["mode"] == "partial" for x in partial)
    assert all(float(x["ideal_speedup"]) == pytest.approx(12 / int(x["recomputed_layers"]), rel=1e-3) for x in partial)


def expect_bench_quality(r: Ran) -> None:  # the zoo's first tier: the committed demo tier's first pair
    rows = table(r.out, "config", "recomputed_layers", "quality", "ttft_s", "speedup", "ttft_4k_s", "speedup_4k")
    layers = {x["config"]: x["recomputed_layers"] for x in rows}
    assert (layers.pop("full prefill"), layers.pop("full reuse")) == ("12", "0")
    assert any(c.startswith("cacheblend ") for c in layers)
    groups = [re.fullmatch(r"droidmesh \[(\d+),(\d+)\)", c) for c in layers if c.startswith("droidmesh ")]
    assert groups and all(int(layers[g[0]]) == int(g[2]) - int(g[1]) for g in groups)
    has(r.out, r"^sender alone: [\d.]+; speedup_at_5pct ")


def expect_bench_pipeline(r: Ran) -> None:
    rows = {x["mode"]: x["vs_piped"] for x in table(r.out, "mode", "seconds", "vs_piped")}
    assert set(rows) == {"transfer", "recompute", "all", "reused", "piped", "prefill"} and rows["piped"] == "1"
    has(r.out, r"^pipeline_overhead = TTFT\(piped\) / max\(recompute, transfer\) = [\d.]+$")


def expect_bench_bandwidth(r: Ran) -> None:
    [row] = table(r.out, "configured_gbit_s", "transport", "ucx_transports", "achieved_gbit_s", "link_efficiency",
                  "piped", "reused", "all", "prefill")
    assert (row["configured_gbit_s"], row["transport"]) == ("", "ucx")  # --rates 0: unlimited; the default channel


def expect_bench_transfer(r: Ran) -> None:
    rows = table(r.out, "bytes", "items", "item_bytes", "transport", "throughput_gb_s", "memcpy_gb_s", "memcpy_cold_gb_s",
                 "ratio", "ucx_transports", more=True)  # + "unavailable" where a channel cannot start
    assert {"ucx", "nixl", "shm"} <= set(col(rows, "transport"))  # every channel between processes
    assert all((x["bytes"], x["items"], x["item_bytes"]) == ("65536", "1", "65536") for x in rows)
    fixed = table(r.out, "transport", "grant_us", "pull_us", "with_grant_us", "samples")
    assert set(col(fixed, "transport")) <= set(col(rows, "transport"))


def expect_bench_sender_loop(r: Ran) -> None:
    rows = table(r.out, "codec", "pull_ms", "lag_max_ms", "lag_p99_ms", "ticks", "receiver_lag_max_ms")
    assert col(rows, "codec") == ["raw", "int4"]
    assert all(float(x["pull_ms"]) > 0 and int(x["ticks"]) > 0 for x in rows)
    assert json.loads((r.tmp / "sender-loop.json").read_text())["client"] == "process"


def expect_bench_hosts(r: Ran) -> None:
    rows = table(r.out, "context", "plan", "codec", "path", "link_gbit_s", "wire_mb", "pull_s", "engine_s", "mesh_s",
                 "full_prefill_s", "mesh_over_engine", "relay_pays")
    assert set(col(rows, "context")) == {"4096"} and set(col(rows, "link_gbit_s")) == {"25", "100", "200", "400"}
    assert {"gpudirect", "staged", "today", "host_held"} == set(col(rows, "path"))
    even = table(r.out, "context", "plan", "codec", "path", "wire_mb", "pays_from_gbit_s", "target_from_gbit_s")
    assert len(even) == 2 * (4 + 3 + 3)  # two plans; raw on four paths, each code on three
    assert (r.tmp / "hosts.png").stat().st_size > 0


def expect_bench_control(r: Ran) -> None:
    [row] = table(r.out, "events", "event_to_index_p50_ms", "event_to_index_p99_ms", "lookup_rtt_p50_ms",
                  "lookup_rtt_p99_ms")
    assert row["events"] == "10"


def expect_bench_drift(r: Ran) -> None:
    rows = table(r.out, "phase", "task", "requests", "plans", "score", "full_prefill_score", "ratio", "agreement")
    assert [(x["phase"], x["task"], x["requests"]) for x in rows[:2]] == [
        ("before", "multihop_qa/plain", "1"), ("shifted", "multihop_qa/coded", "1")]  # --n-before 1, --max-shifted 1
    has(r.out, r"^alarm \S+ and new config \S+ requests after the shift; plan .* -> .*; logs in \S+$")


def expect_bench_screen(r: Ran) -> None:
    rows = table(r.out, "pair", "plan", "pulls", "trials", "refused", "rate", "ci95_lo", "ci95_hi", "screen_ms_p50")
    by = {x["pulls"]: x for x in rows}
    assert {x["pair"] for x in rows} == {"summ->qa"} and {x["plan"] for x in rows} == {"full reuse"}
    assert by["honest"]["trials"] == "2" and float(by["honest"]["screen_ms_p50"]) > 0  # --contexts 2
    assert (by["zeros"]["trials"], by["zeros"]["refused"]) == ("2", "2")  # all-zero K/V: never passes
    assert "flip_E" not in by and by["other_context"]["trials"] == "1"  # full reuse pulls no E; one previous context


def expect_config_delete(r: Ran) -> None:
    has(r.out, r"^withdrew summ-to-qa\S*(, summ-to-qa\S*)* from dm_recompute_configs$")  # every version published


def expect_bench_load(r: Ran) -> None:
    rows = table(r.out, "receivers", "rate", "mode", "requests", "ttft_p50", "ttft_p99", "tbt_p50", "e2e_p50", "e2e_p99",
                 "goodput")
    assert sorted((x["receivers"], x["rate"], x["mode"]) for x in rows) == [("1", "2", "auto"), ("1", "2", "full_prefill")]
    has(r.out, r"^goodput_ratio \(best DroidMesh / best full prefill at TTFT <= 1\.0s\) = ")


def expect_bench_load_agents(r: Ran) -> None:
    agents_table(r, "4/s", 2, "load-agents")  # --rates 4, --rows 2


def expect_bench_sidechannel(r: Ran) -> None:
    rows = table(r.out, "phase", "attacker", "tokens", "test_trials", "median_cached_s", "median_uncached_s",
                 "threshold_s", "accuracy", "ci95_lo", "ci95_hi", "chance_in_ci")
    assert [(x["phase"], x["attacker"], x["test_trials"]) for x in rows] == [("before", "victim", "4"),
                                                                              ("after", "attacker", "4")]  # --trials 4
    assert all(int(x["tokens"]) >= 64 for x in rows)
    paths = {name: ast.literal_eval(has(r.out, rf"^{name}: accuracy .* paths (\{{.*\}})$")[1]) for name in ("before", "after")}
    assert set(paths["after"]["cached"]) == {"full_prefill"}  # scopes: another tenant never reuses the victim's KV


def expect_bench_stall(r: Ran) -> None:
    rows = table(r.out, "phase", "requests", "ttft_p50_ms", "ttft_max_ms", "paths")
    assert [(x["phase"], x["requests"]) for x in rows] == [("baseline", "3"), ("during_stall", "3"), ("stalled", "1")]
    assert all(set(x["paths"].split("/")) <= PATHS for x in rows)
    has(r.out, r"^stall_ratio = TTFT p50 while a sender stalls / before = [\d.]+ \([01] of 1 stalled requests ")


def expect_bench_idle(r: Ran) -> None:
    rows = table(r.out, "process", "cpu_s", "core_share", "meets_target")
    assert col(rows, "process") == ["nats", "cache_broker", "sender", "receiver", "gateway"]
    assert set(col(rows, "meets_target")) <= {"True", "False"}
    has(r.out, r"^shm: [0-5] of 5 processes at most 1% of a core over 1 s idle$")


def expect_bench_adapters(r: Ran) -> None:
    rows = table(r.out, "layout", "adapters", "served_models", "rss_mib", "ratio_to_one_merged", "host_mib", "anon_mib",
                 "file_mib", "rss_loaded_mib", "hwm_mib", "estimate")
    assert [(x["layout"], x["adapters"], x["served_models"]) for x in rows] == [
        ("merged", "1", "1"), ("adapter_set", "1", "2"), ("merged_processes", "1", "1")]  # --counts 1; the base + 1
    receivers = table(r.out, "layout", "adapters", "served_models", "rss_mib", "ratio_to_one_merged")
    assert [(x["layout"], x["served_models"]) for x in receivers] == [("receiver_merged", "1"), ("receiver_adapter_set", "2")]
    has(r.out, r"^prefill of 32 tokens \(median of 1\), wall: ")


def expect_bench_held(r: Ran) -> None:
    rows = table(r.out, "model", "kind", "first", "second", "tokens", "first_ttft_ms", "second_ttft_ms", "speedup",
                 "second_path", "second_plan", "local_ttft_ms", "vs_local")
    assert [(x["model"], x["kind"], x["first"], x["second"]) for x in rows] == [
        ("base", "same_model", "base", "base"), ("code", "paired_adapter", "base", "code")]  # --docs 1, --pairs base:code
    assert all(x["second_path"] in PATHS for x in rows)
    summary = ast.literal_eval(has(r.out, r"^adapters: (\{.*\}); holding: ")[1])
    assert set(summary) == {"same_model", "base-to-code"}
    assert not re.search(r"^single:", r.out, re.M)  # --model '': no same-model rows of another model


EXPECT: dict[str, Callable[[Ran], None]] = {
    "agents": expect_agents,
    "zoo list": expect_zoo_list,
    "zoo build": expect_zoo_build,
    "zoo data": expect_zoo_data,
    "eval": expect_eval,
    "profile": expect_profile,
    "config publish": expect_config_publish,
    "config show": expect_config_show,
    "config relay-policy": expect_relay_policy,
    "receivers": expect_receivers,
    "prefill": expect_prefill,
    "ask": expect_ask,
    "audit": expect_audit,
    "nats-auth": expect_nats_auth,
    "keys add": expect_keys_add,
    "keys list": expect_keys_list,
    "bench codecs": expect_bench_codecs,
    "bench layered": expect_bench_layered,
    "bench ttft": expect_bench_ttft,
    "bench quality": expect_bench_quality,
    "bench pipeline": expect_bench_pipeline,
    "bench bandwidth": expect_bench_bandwidth,
    "bench transfer": expect_bench_transfer,
    "bench sender-loop": expect_bench_sender_loop,
    "bench hosts": expect_bench_hosts,
    "bench control": expect_bench_control,
    "bench drift": expect_bench_drift,
    "bench load": expect_bench_load,
    "bench load --workload agents": expect_bench_load_agents,
    "bench sidechannel": expect_bench_sidechannel,
    "bench stall": expect_bench_stall,
    "bench idle": expect_bench_idle,
    "bench adapters": expect_bench_adapters,
    "bench held": expect_bench_held,
    "bench screen": expect_bench_screen,
    "config delete": expect_config_delete,
}


@pytest.mark.parametrize("command,argv", INVOCATIONS, ids=IDS)
def test_command_runs(command, argv, mesh, ci_tier, monkeypatch):
    """The command exits 0, without a traceback, and prints (and writes) what `EXPECT` says it must."""
    url, tmp = mesh
    zoo, manifest = ci_tier
    monkeypatch.setenv("DROIDMESH_ZOO_DIR", str(zoo.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [*command.split(), *(a.format(tmp=tmp, url=url) for a in argv)]
    result = CliRunner().invoke(main, args, env={"DM_DEBUG": "1"}, catch_exceptions=True)
    assert result.exit_code == 0, f"{args}: {result.stderr}\n{result.stdout}\n{result.exception!r}"
    assert result.stdout.strip() and "Traceback" not in result.stderr
    ran = Ran(result.stdout, result.stderr, tmp, zoo, manifest)
    try:
        EXPECT[IDS[INVOCATIONS.index((command, argv))]](ran)
    except AssertionError as e:
        raise AssertionError(f"{args}: {e}\n--- stdout:\n{result.stdout}") from None
