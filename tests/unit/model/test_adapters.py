"""One base model's weights, several unmerged PEFT adapters served from them (`AdapterSet`).

On a tiny random Llama with two random LoRAs (lora_B non-zero, so each changes the outputs;
different target modules, so some layers carry one adapter only), every view must run as the
model its directory loads alone (`load_model`, which merges the adapter): logits within ATOL in
float32 (merged W + s·BA vs unmerged Wx + s·B(Ax) differ by rounding only), greedy tokens equal.

Without the views' `select` hook (every view then runs whatever adapter peft left active: the
first one loaded), these fail: test_each_view_is_its_merged_model[b],
test_base_view_is_the_plain_base, test_views_interleaved_give_their_own_results,
test_views_interleaved_layer_by_layer and test_cross_adapter_reuse_matches_merged_models.
test_each_view_is_its_merged_model[a] passes without it (view a is the adapter peft activates
on load), as do the validation and sha256 tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from droidmesh.shared.errors import CheckpointNotFoundError, ConfigError, UnsupportedModelError
from droidmesh.shared.kv.capture import capture_prefill
from droidmesh.shared.kv.partial import generate, generate_steps, prefill
from droidmesh.shared.kv.plan import ReusePlan
from droidmesh.shared.kv.sources import CapturedSource
from droidmesh.shared.model.adapter import ModelAdapter, load_model
from droidmesh.shared.model.lora import AdapterSet
from droidmesh.shared.model.names import weights_sha256
from droidmesh.shared.zoo.tokenizer import hf_tokenizer
from tests.conftest import ATOL

# peft (building the LoRAs) calls a transformers method deprecated in v5
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
LAYERS = 4
NEW_TOKENS = 8
TARGETS = {"a": ["q_proj", "k_proj", "v_proj", "o_proj"], "b": ["q_proj", "v_proj", "gate_proj", "down_proj"]}


def _lora(base: Path, out: Path, seed: int, **config) -> Path:
    """A random adapter of `base` as peft saves it (no tokenizer; base_model_name_or_path = base)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = config.pop("peft_config", None) or LoraConfig(**{"r": 4, "lora_alpha": 8, "init_lora_weights": False, **config})
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), cfg).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base (random Llama + the zoo tokenizer), a and b (random LoRAs of base)."""
    root = tmp_path_factory.mktemp("adapters")
    tok = hf_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    out = {"base": root / "base"}
    for i, (name, targets) in enumerate(TARGETS.items()):
        out[name] = _lora(root / "base", root / name, seed=10 + i, target_modules=targets)
    return out


@pytest.fixture(scope="module")
def shared_set(dirs) -> AdapterSet:
    return AdapterSet.load(dirs["base"], {"a": dirs["a"], "b": dirs["b"]})


@pytest.fixture(scope="module")
def merged(dirs) -> dict[str, ModelAdapter]:
    """Each served name loaded alone, as a process serving one model does (adapters merged)."""
    return {name: load_model(dirs[name], name=name) for name in ("base", "a", "b")}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 700, (40,), generator=g).tolist()


def _run(model: ModelAdapter, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(logits [T, vocab] over every prompt token, greedy tokens) through the engine."""
    logits = prefill(model, ids, ReusePlan.full_prefill(), logits_for=len(ids)).logits
    return logits, generate(model, ids, ReusePlan.full_prefill(), max_new_tokens=NEW_TOKENS).tokens


def test_views_share_one_copy_of_the_weights(shared_set, merged):
    """Every view runs the same module object; it holds the base's parameters once plus the
    adapters' (a few per cent here), not a copy per view."""
    views = shared_set.views()
    assert list(views) == ["base", "a", "b"] and shared_set.names == ("base", "a", "b")
    assert len({id(v.model) for v in views.values()}) == 1
    base_params = sum(p.numel() for p in merged["base"].model.parameters())
    held = sum(p.numel() for p in shared_set.peft_model.parameters())
    assert base_params < held < 1.2 * base_params
    assert held == base_params + shared_set.added_params("a") + shared_set.added_params("b")
    # r * (in + out) per projection of a: q and o are 64 -> 64, k and v 64 -> 32 (2 KV heads of 16)
    assert shared_set.added_params("a") == LAYERS * 4 * (2 * (64 + 64) + 2 * (64 + 32))
    assert shared_set.added_params("base") == 0
    assert all(v.fingerprint == merged["base"].fingerprint for v in views.values())


@pytest.mark.parametrize("name", ["a", "b"])
def test_each_view_is_its_merged_model(shared_set, merged, ids, name):
    """An adapter view's logits over a prompt equal the merged model's within ATOL (float32);
    its greedy tokens are the same. The adapter does change the outputs (vs the base)."""
    logits, tokens = _run(shared_set.view(name), ids)
    ref_logits, ref_tokens = _run(merged[name], ids)
    assert (logits - ref_logits).abs().max().item() < ATOL
    assert tokens == ref_tokens
    assert (logits - _run(merged["base"], ids)[0]).abs().max().item() > 100 * ATOL


def test_base_view_is_the_plain_base(shared_set, merged, ids):
    """With every adapter layer disabled the base view computes exactly the plain base model,
    also right after an adapter view ran."""
    _run(shared_set.view("b"), ids)
    logits, tokens = _run(shared_set.view("base"), ids)
    ref_logits, ref_tokens = _run(merged["base"], ids)
    # bitwise: disabled adapters run the base layers alone: the same kernels and shapes
    assert torch.equal(logits, ref_logits) and tokens == ref_tokens


def test_views_interleaved_give_their_own_results(dirs, shared_set, ids):
    """A, B, A, base, B, base, A on one set: each call gives exactly what that view gives in a
    set where it is the only one ever used (made active there once, by hand)."""
    alone = {}
    for name in ("base", "a", "b"):
        own = AdapterSet.load(dirs["base"], {"a": dirs["a"], "b": dirs["b"]})
        own.activate(name)
        alone[name] = _run(own.view(name), ids)
    for name in ("a", "b", "a", "base", "b", "base", "a"):
        logits, tokens = _run(shared_set.view(name), ids)
        # bitwise: the same view, kernels and shapes; interleaving must leave no state behind
        assert torch.equal(logits, alone[name][0]) and tokens == alone[name][1], name


def test_views_interleaved_layer_by_layer(shared_set, merged, ids):
    """Two requests on two views advanced alternately, one layer (and one decode step) at a time,
    as a service's compute thread interleaves requests: each still gets its own model's tokens."""
    runs = {name: generate_steps(shared_set.view(name), ids, ReusePlan.full_prefill(), max_new_tokens=NEW_TOKENS,
                                 turns=True) for name in ("a", "b", "base")}
    done: dict[str, list[int]] = {}
    with torch.inference_mode():
        while runs:
            for name, steps in list(runs.items()):
                try:
                    next(steps)
                except StopIteration as stop:
                    done[name] = stop.value.tokens
                    del runs[name]
    assert done == {name: _run(merged[name], ids)[1] for name in done}


def test_cross_adapter_reuse_matches_merged_models(shared_set, merged, ids):
    """A context captured under view a, reused under view b with layers 1..2 recomputed, gives
    the tokens (and logits, within ATOL) the same plan gives between the two merged models."""
    context, prompt = ids[:32], ids
    plan = ReusePlan.recompute(1, 3)

    def reuse(sender: ModelAdapter, receiver: ModelAdapter) -> tuple[torch.Tensor, list[int]]:
        source = CapturedSource(capture_prefill(sender, context, e_layers=plan.e_layers))
        logits = prefill(receiver, prompt, plan, source, logits_for=len(prompt) - len(context)).logits
        return logits, generate(receiver, prompt, plan, source, max_new_tokens=NEW_TOKENS).tokens

    logits, tokens = reuse(shared_set.view("a"), shared_set.view("b"))
    ref_logits, ref_tokens = reuse(merged["a"], merged["b"])
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < ATOL


def test_sha256_is_what_each_directory_alone_reports(dirs, shared_set):
    """A view's weights identity is its directory's, so pair configs profiled on the merged
    adapter apply to the view; an unknown name is a one-line ConfigError."""
    for name in ("base", "a", "b"):
        assert shared_set.sha256(name) == weights_sha256(Path(dirs[name]))
    assert len({shared_set.sha256(n) for n in shared_set.names}) == 3
    with pytest.raises(ConfigError, match="no view named 'c'"):
        shared_set.sha256("c")


def _refused(error: type[Exception], match: str, base: Path, adapters, **kw) -> None:
    with pytest.raises(error, match=match) as info:
        AdapterSet.load(base, adapters, **kw)
    assert "\n" not in str(info.value)


def test_names_are_refused_when_repeated_empty_or_the_base(dirs):
    base, a, b = dirs["base"], dirs["a"], dirs["b"]
    _refused(ConfigError, "'x' given twice", base, [("x", a), ("x", b)])
    _refused(ConfigError, "is the base's", base, {"base": a})
    _refused(ConfigError, "is the base's", base, {"main": a}, base_name="main")
    _refused(ConfigError, "is empty", base, {"": a})
    _refused(ConfigError, "no adapters given", base, {})


def test_wrong_paths_are_refused(dirs, tmp_path):
    base, a = dirs["base"], dirs["a"]
    _refused(ConfigError, "is a PEFT adapter, not a base", a, {"b": dirs["b"]})
    _refused(CheckpointNotFoundError, "never downloads", tmp_path / "absent", {"a": a})
    _refused(CheckpointNotFoundError, "not a PEFT adapter", base, {"a": base})
    other = tmp_path / "other_base"
    shutil.copytree(base, other)
    _refused(ConfigError, f"trained on {base.resolve()}, not on {other.resolve()}", other, {"a": a})


def test_adapters_that_cannot_share_the_base_are_refused(dirs, tmp_path):
    """Prompt learning, a second peft kind, trained base biases, and a tokenizer of another
    vocabulary: each a one-line error naming the adapter."""
    from peft import IA3Config, PrefixTuningConfig

    base, a = dirs["base"], dirs["a"]
    prefix = _lora(base, tmp_path / "prefix", 1, peft_config=PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                                  num_virtual_tokens=4))
    _refused(UnsupportedModelError, "'p' .* adds virtual tokens", base, {"a": a, "p": prefix})
    ia3 = _lora(base, tmp_path / "ia3", 1, peft_config=IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                                 feedforward_modules=["down_proj"]))
    _refused(UnsupportedModelError, r"kinds \['IA3', 'LORA'\]", base, {"a": a, "i": ia3})
    biased = _lora(base, tmp_path / "biased", 1, target_modules=["q_proj"], bias="all")
    _refused(UnsupportedModelError, "'c' .*bias='all'.* changes the base's own weights", base, {"a": a, "c": biased})
    retok = tmp_path / "retok"
    shutil.copytree(a, retok)
    hf_tokenizer("split").save_pretrained(retok)
    _refused(ConfigError, "'r' .* vocabulary differs", base, {"r": retok})
    same = tmp_path / "same_tok"
    shutil.copytree(a, same)
    hf_tokenizer().save_pretrained(same)  # the base's own vocabulary: accepted
    assert AdapterSet.load(base, {"s": same}).names == ("base", "s")
    cfg = json.loads((a / "adapter_config.json").read_text())
    pissa = tmp_path / "pissa"
    shutil.copytree(a, pissa)
    (pissa / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": "pissa"}))
    _refused(UnsupportedModelError, "init_lora_weights='pissa'", base, {"a": a, "s": pissa})
