"""Your own model pair, end to end: a user's checkpoints on disk (a full fine-tune and a peft LoRA of
one base), profiled from a user's JSONL with `droidmesh profile`, then served by a real mesh.

The models are tiny random Llamas with the zoo's tokenizer. Their answers mean nothing, so each
JSONL's gold answers are its receiver's own greedy answers (what the profiler's scorer produces
for the receiver's full prefill): full prefill then scores 1 and the fine-tune's changed layers
decide the frontier. Nothing here asserts quality, only the flow and facts that hold whatever
the weights: the profile's shape, the published config bound to the pair's sha256s, and a
receiver answering through the published plan with KV pulled from the sender.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from click.testing import CliRunner
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from droidmesh.shared import ZOO_DIR
from droidmesh.shared.kv.policy import eligible, option_label, plan_of
from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.model.adapter import load_model
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.service.launch import Proc, start_service
from droidmesh.shared.tasks import vocab
from droidmesh.shared.tasks.jsonl import write_jsonl
from droidmesh.shared.tasks.scorer import PairScorer
from droidmesh.shared.tasks.spec import task_spec
from droidmesh.shared.tools.cli.main import main as droidmesh_main
from droidmesh.shared.wire import schemas
from tests.system.conftest import until_indexed

pytestmark = [pytest.mark.system,
              # peft (building the LoRA) calls a transformers method deprecated in v5
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

ZOO_BASE = ZOO_DIR / "demo" / "base"  # its tokenizer files make the random models read text
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LAYERS = 4
TUNED_LAYERS = (2, 3)  # the layers the "fine-tune" changed
TASK, METRIC, MAX_NEW = "mine", "edit_sim", 4  # edit similarity: any decoded text, even an empty one, scores 1 against itself
ROWS = 8  # --data splits them 4 train / 4 test
THREADS = {"OMP_NUM_THREADS": "1"}
# The published profile carries a latency fit, so the receiver weighs relaying against its own
# prefill from measured timings (pull bandwidth, the grant round trip, calibration), which a busy
# machine tips towards its own prefill. The test is about the flow, not that choice: the randomized
# audit's blind arm at share 1 relays every request the policy weighed, through the plan it chose.
PIN_RELAY = {"blind_share": 1.0}
QUESTION = " ask anna answer"


def _context(i: int, n: int = 120) -> str:
    """A LongBench-style context of zoo words (one token each): a document with facts, then filler."""
    facts = " ".join(f"{vocab.KEYS[(i + k) % 16]} {vocab.VALUES[(3 * i + k) % 16]} ." for k in range(4))
    filler = " ".join(vocab.FILLER[(5 * i + 7 * k) % len(vocab.FILLER)] for k in range(n))
    return f"doc {vocab.TITLES[i % 16]} {facts} {filler}"


def _save(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(ZOO_BASE / name, path / name)
    return path


def _build(root: Path) -> dict[str, Path]:
    """base, tuned (base with layers TUNED_LAYERS perturbed) and lora (a peft LoRA adapter on base)."""
    tok = AutoTokenizer.from_pretrained(ZOO_BASE)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    tuned = LlamaForCausalLM(cfg)
    tuned.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in TUNED_LAYERS:
            for p in tuned.model.layers[layer].parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    dirs = {"base": _save(base, root / "base"), "tuned": _save(tuned, root / "tuned")}
    # A LoRA as peft saves it: no tokenizer, `base_model_name_or_path` = the base directory.
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(dirs["base"]),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(str(root / "lora"))
    dirs["lora"] = root / "lora"
    return dirs


def _data(dirs: dict[str, Path], receiver: str, path: Path) -> Path:
    """The user's JSONL for base -> receiver, its gold answers the receiver's own (see the module docstring)."""
    rows = [{"context": _context(i), "input": QUESTION.strip(), "answers": ["?"]} for i in range(ROWS)]
    scorer = PairScorer(load_model(dirs["base"]), load_model(dirs[receiver]), rows,
                        task_spec(TASK, metric=METRIC, max_new_tokens=MAX_NEW))
    answers = [res["receiver_full_prefill"].prediction for res in scorer.paths({})]
    write_jsonl(path, [dict(row, answers=[a]) for row, a in zip(rows, answers, strict=True)])
    return path


def droidmesh(*args: object, cwd: Path) -> str:
    """Run the `droidmesh` CLI as a user would; a failure shows its (one-line) error."""
    res = subprocess.run([sys.executable, "-m", "droidmesh.shared.tools.cli.main", *map(str, args)], cwd=cwd,
                         capture_output=True, text=True, env={**os.environ, **THREADS}, timeout=300)
    assert res.returncode == 0, f"droidmesh {' '.join(map(str, args[:2]))} failed ({res.returncode}): {res.stderr[-2000:]}"
    return res.stdout


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The user's workspace: checkpoints, JSONLs and both pairs' profiles (`droidmesh profile --json`)."""
    root = tmp_path_factory.mktemp("own_pair")
    dirs = _build(root)
    out: dict[str, Any] = {"root": root, "dirs": dirs, "profiles": {}}
    for receiver in ("tuned", "lora"):
        data = _data(dirs, receiver, root / f"{receiver}.jsonl")
        path = root / f"base-to-{receiver}.json"
        droidmesh("profile", "--sender", "base", "--receiver", receiver, "--task", TASK, "--data", data.name,
                  "--metric", METRIC, "--max-new-tokens", MAX_NEW, "--n-train", 4, "--n-test", 4,
                  "--budget", 0, "--json", path.name, cwd=root)
        out["profiles"][receiver] = path
    return out


def test_profile_of_a_fine_tune_and_of_a_lora(own: dict[str, Any]) -> None:
    """`droidmesh profile` on user checkpoints and a user JSONL writes a profile with a chosen group on its frontier."""
    for receiver, path in own["profiles"].items():
        prof = json.loads(path.read_text())
        assert (prof["sender"], prof["receiver"], prof["task"]) == ("base", receiver, TASK)
        assert prof["total_layers"] == LAYERS and len(prof["sensitivity"]) == LAYERS
        front = [(p["start"], p["end"]) for p in prof["frontier"]]
        assert front and all(0 <= s <= e <= LAYERS for s, e in front), front
        ch = prof["chosen"]
        assert (ch["start"], ch["end"]) in front and ch["recomputed_layers"] == ch["end"] - ch["start"]
        assert prof["robustness"][0]["task"] == TASK and prof["latency_fit"]["c0"] >= 0
    assert weights_sha256(own["dirs"]["lora"]) != weights_sha256(own["dirs"]["base"])


def _mistakes(own: dict[str, Any]) -> dict[str, tuple[list[str], str]]:
    """Checkpoints and data a user may get wrong, with the command each breaks and a word of its error."""
    from peft import PrefixTuningConfig, get_peft_model

    root, dirs = own["root"] / "mistakes", own["dirs"]
    root.mkdir()
    two = LlamaForCausalLM(LlamaConfig(vocab_size=776, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2))
    _save(two, root / "two_layers")
    prefix = get_peft_model(AutoModelForCausalLM.from_pretrained(dirs["base"]),
                            PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    prefix.save_pretrained(str(root / "prefix"))
    shutil.copytree(dirs["lora"], root / "hub_lora")  # an adapter downloaded from a hub names its base by hub id
    adapter_cfg = root / "hub_lora" / "adapter_config.json"
    adapter_cfg.write_text(json.dumps({**json.loads(adapter_cfg.read_text()), "base_model_name_or_path": "org/base-1b"}))
    (root / "bad.jsonl").write_text(json.dumps({"context": "doc north", "input": "ask anna"}) + "\n")
    data = str(root.parent / "tuned.jsonl")
    prof = ["profile", "--sender", str(dirs["base"]), "--task", TASK, "--n-train", "1", "--n-test", "1",
            "--no-robustness", "--json", str(root / "out.json")]
    return {
        "layer count": ([*prof, "--receiver", str(root / "two_layers"), "--data", data], "num_layers"),
        "row without answers": ([*prof, "--receiver", str(dirs["tuned"]), "--data", str(root / "bad.jsonl")], "answers"),
        "prefix tuning": ([*prof, "--receiver", str(root / "prefix"), "--data", data], "PREFIX_TUNING"),
        "hub base": ([*prof, "--receiver", str(root / "hub_lora"), "--data", data], "org/base-1b"),
        "profile of other weights": (["config", "publish", str(own["profiles"]["tuned"]), "--receiver", str(dirs["lora"]),
                           "--dry-run"], "weights"),
    }


def test_user_mistakes_fail_in_one_line(own: dict[str, Any]) -> None:
    """A mismatched pair, a bad JSONL row, an unmergeable or unfound adapter and a profile of other weights each end in one error line."""
    for what, (args, word) in _mistakes(own).items():
        res = CliRunner().invoke(droidmesh_main, args)
        lines = res.stderr.strip().splitlines()  # model loading's progress bars may come first
        assert res.exit_code != 0 and lines[-1].startswith("Error: "), (what, res.stderr)
        assert "Traceback" not in res.stderr and sum(line.startswith("Error") for line in lines) == 1, (what, res.stderr)
        assert word in lines[-1], (what, lines[-1])


def _config_loaded(proc: Proc) -> None:
    proc.wait_for(lambda line: '"config_loaded"' in line, 60, "the published config")


def _labels(cfg: dict[str, Any]) -> set[str]:
    """The plan labels a receiver may serve from a published config (its frontier and choice)."""
    points = [*cfg["frontier"], cfg["chosen"]]
    return {plan_of(schemas.PlanSpec(groups=[tuple(g) for g in p["plan"]["groups"]])).label() for p in points}


def test_mesh_serves_a_profiled_pair(own: dict[str, Any], nats, services) -> None:
    """Prefill, publish the fine-tune's profile, and the fine-tune receiver answers through the published plan."""
    root, dirs, url = own["root"], own["dirs"], nats[1]
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    sender = start_service("sender", {"model_path": dirs["base"]}, url, env=THREADS)  # serves as "base"
    services.append(sender)
    receiver = start_service("receiver", {"model_path": dirs["tuned"], **PIN_RELAY}, url, env=THREADS)  # serves as "tuned"
    services.append(receiver)

    # A context prefilled before its pair's config exists keeps E of layer 0 only: once the config
    # is published it is still reused, its group extended down to layer 0 (shared/kv/policy.py).
    early = _context(200)
    (root / "early.txt").write_text(early)
    assert "tokens:" in droidmesh("prefill", "--sender", "base", "--context", "early.txt", "--nats", url, cwd=root)
    asyncio.run(_until_indexed(url, dirs["tuned"], early))

    droidmesh("config", "publish", own["profiles"]["tuned"].name, "--nats", url, cwd=root)
    _config_loaded(sender)  # the sender now keeps E at the group starts (a prefill before this would lack them)
    _config_loaded(receiver)
    shown = droidmesh("config", "show", "--json", "--nats", url, cwd=root)
    (cfg,) = json.loads(shown)
    assert (cfg["sender_model"], cfg["receiver_model"]) == ("base", "tuned")
    assert (cfg["sender_sha256"], cfg["receiver_sha256"]) == (weights_sha256(dirs["base"]), weights_sha256(dirs["tuned"]))
    prof = json.loads(own["profiles"]["tuned"].read_text())
    assert [tuple(g) for g in cfg["chosen"]["plan"]["groups"]] == (
        [(prof["chosen"]["start"], prof["chosen"]["end"])] if prof["chosen"]["end"] > prof["chosen"]["start"] else [])
    labels = _labels(cfg)

    context = _context(100)
    (root / "context.txt").write_text(context)
    assert "tokens:" in droidmesh("prefill", "--sender", "base", "--context", "context.txt", "--nats", url, cwd=root)
    asyncio.run(_until_indexed(url, dirs["tuned"], context))

    # The CLI's answer.
    out = droidmesh("ask", "--receiver", "tuned", "--context", "context.txt", "--question", QUESTION,
                    "--max-new-tokens", MAX_NEW, "--nats", url, cwd=root)
    path_line = next(line for line in out.splitlines() if line.startswith("path: "))
    assert "full_prefill" not in path_line and "fallback" not in path_line, out
    assert any(f"plan: {label} " in path_line for label in labels), (path_line, labels)
    pulled = re.search(r"bytes pulled: ([\d,]+) from base-", out)
    assert pulled and int(pulled[1].replace(",", "")) > 0, out

    out = droidmesh("ask", "--receiver", "tuned", "--context", "early.txt", "--question", QUESTION,
                    "--max-new-tokens", MAX_NEW, "--nats", url, cwd=root)
    # The early context keeps E of layer 0 only: the points the receiver may serve it by are the
    # frontier's points whose E it keeps, else those points with their groups extended down to layer 0
    # (which of them is the policy's online choice).
    (published,) = msgspec.json.decode(shown.encode(), type=list[schemas.RecomputeConfig])
    early_labels = {option_label(p) for p in eligible(published, {0})}
    path_line = next(line for line in out.splitlines() if line.startswith("path: "))
    assert path_line.startswith(("path: partial", "path: full_reuse")), out
    assert any(f"plan: {label} " in path_line for label in early_labels), (path_line, early_labels)

    # The same question through the OpenAI-compatible gateway.
    gateway = start_service("gateway", {"http_port": 0}, url, env=THREADS)
    services.append(gateway)
    # ready once it listens (it answers a one-line 503 until NATS is up): ask once it joined the mesh
    gateway.wait_for(lambda line: "gateway_mesh_joined" in line, 60, "the gateway joining the mesh")
    port = gateway.events("gateway_started")[0]["http_port"]
    api = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    resp = api.completions.create(model="tuned", prompt=context + QUESTION, max_tokens=MAX_NEW, temperature=0)
    ext = (resp.model_extra or {})["droidmesh"]
    assert ext["path"] in ("partial", "full_reuse") and ext["plan"] in labels, ext
    assert ext["bytes_pulled"] > 0 and ext["reused_tokens"] > 0 and ext["sender_id"].startswith("base-"), ext


async def _until_indexed(url: str, receiver_dir: Path, context: str) -> None:
    """Events are asynchronous: wait until the broker can answer the receiver's lookup of `context`."""
    client = await MeshClient.connect(url)
    try:
        await until_indexed(client, load_model(receiver_dir), context)
    finally:
        await client.close()
