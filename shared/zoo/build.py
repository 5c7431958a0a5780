"""Build a zoo tier: pretrain the base, fine-tune the derivatives, save HF checkpoints + manifest.

Layout of a built tier directory:
    manifest.json          recipe hash, models (path, kind, parent, task, sha256), pairs, log
    base/                  config.json, model.safetensors, tokenizer files
    <derivative>/          a full fine-tune (same files) or a peft LoRA adapter directory
    .work/                 cached intermediate base states (ignored by the manifest)
A tier is rebuilt only when its recipe hash differs from the manifest's (or a file is missing
or altered); intermediate base states are reused when a recipe change leaves a prefix of the
base ops unchanged.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from droidmesh.shared.model.names import sha256_file
from droidmesh.shared.tasks import vocab as V
from droidmesh.shared.zoo import train as T
from droidmesh.shared.zoo.manifest import MANIFEST, read_manifest, zoo_dir
from droidmesh.shared.zoo.recipe import Derivative, Recipe, ops_hash, recipe_dict, recipe_hash
from droidmesh.shared.zoo.tiers import get_recipe
from droidmesh.shared.zoo.tokenizer import WordIds, save_tokenizer


def file_hashes(model_dir: Path) -> dict[str, str]:
    """sha256 of every file of a saved model (weights, config, tokenizer, adapter config)."""
    return {f.name: sha256_file(f) for f in sorted(model_dir.iterdir()) if f.is_file()}


def is_current(out_dir: Path, recipe: Recipe) -> bool:
    """True when `out_dir` holds this recipe's build with every weight file intact."""
    man = read_manifest(out_dir)
    if man is None or man.get("recipe_hash") != recipe_hash(recipe):
        return False
    for m in man["models"].values():
        f = out_dir / m["path"] / m["weights"]
        if not f.is_file() or sha256_file(f) != m["sha256"]:
            return False
    return True


def build_tier(
    tier: str, out_dir: str | Path | None = None, *, force: bool = False, log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build (or reuse) `tier` in `out_dir` (default `zoo_dir(tier)`); return its manifest."""
    recipe = get_recipe(tier)
    out = Path(out_dir) if out_dir is not None else zoo_dir(tier)
    current = None if force or not is_current(out, recipe) else read_manifest(out)
    if current is not None:
        return current
    out.mkdir(parents=True, exist_ok=True)
    say = log or (lambda s: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    t0 = time.time()
    try:
        ids = WordIds()
        history: dict[str, Any] = {}
        base = build_base(recipe, ids, out / ".work", history, say)
        _save_full(base, out / "base", recipe.save_dtype)
        base = _rounded(base, recipe.save_dtype)  # derivatives start from the saved weights
        reader = find_reader(base, ids)
        history["reader"] = reader
        say(f"base reader layer {reader['layer']} (attention on the right value by layer: {reader['by_layer']})")
        models = {"base": _entry(out, "base", "full", None, "pretraining (retrieval)", base)}
        for d in recipe.derivatives:
            models[d.name] = build_derivative(d, base, ids, recipe, reader["layer"], out, history, say)
        manifest = {
            "tier": tier,
            "recipe_hash": recipe_hash(recipe),
            "recipe": recipe_dict(recipe),
            "models": models,
            "pairs": [{"sender": p.sender, "receiver": p.receiver, "task": p.task} for p in recipe.pairs],
            "history": history,
            "build_seconds": round(time.time() - t0, 1),
            "threads": recipe.threads,
            "torch": torch.__version__,
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return manifest
    finally:
        torch.set_num_threads(threads)


# -- base --------------------------------------------------------------------------------------
def build_base(recipe: Recipe, ids: WordIds, work: Path, history: dict[str, Any], say: Callable[[str], None],
               family: str = "llama") -> LlamaForCausalLM:
    """Run the base ops (a `family` model), resuming from the longest cached prefix in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    ops = recipe.base_ops
    model: LlamaForCausalLM | None = None
    start = 0
    for i in range(len(ops), 0, -1):
        f = work / f"base-{ops_hash(recipe, i)}.pt"
        if f.is_file():
            with torch.serialization.safe_globals([T.Arch]):  # tensors, plain data and the arch: nothing runs
                blob = torch.load(f, weights_only=True)
            model = T.new_model(blob["arch"], ids, recipe.seed, family)
            model.load_state_dict(blob["state"])
            history.update(blob.get("history", {}))
            start = i
            say(f"resuming base after op {i} from {f.name}")
            break
    for i in range(start, len(ops)):
        op = ops[i]
        if op.kind == "new":
            assert op.arch is not None, "a `new` op carries its arch"
            model = T.new_model(op.arch, ids, recipe.seed, family)
        elif op.kind == "reinit_above":
            assert model is not None
            _reinit_above(model, op.n, ids, recipe.seed + 1)
        elif op.kind == "grow":
            assert model is not None
            model = T.grow(model, list(op.placement), ids, recipe.seed + 2)
        elif op.kind == "train":
            assert model is not None and op.stage is not None
            losses = T.train_stage(model, op.stage, ids, recipe.seed, code_sampler=_code_sampler(op.stage), log=say)
            acc = _stage_accuracy(model, op.stage, ids, recipe.seed)
            history[f"base/{op.stage.name}"] = {"final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), **acc}
            say(f"base {op.stage.name}: {history[f'base/{op.stage.name}']}")
        else:
            raise ValueError(f"unknown op {op.kind!r}")
        assert model is not None
        arch = _arch_of(model)
        torch.save({"arch": arch, "state": model.state_dict(), "history": history}, work / f"base-{ops_hash(recipe, i + 1)}.pt")
    assert model is not None
    return model


def _arch_of(model: LlamaForCausalLM) -> T.Arch:
    c = model.config
    return T.Arch(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads,
                  c.intermediate_size, c.max_position_embeddings, T._rope_theta(c))


@torch.no_grad()
def _reinit_above(model: LlamaForCausalLM, n: int, ids: WordIds, seed: int) -> None:
    """Fresh weights for layers >= n: keeps layer 0's previous-token heads and forces the
    next layer to learn the key -> value binding instead of the "any value" shortcut)."""
    fresh = T.new_model(_arch_of(model), ids, seed, model.config.model_type)
    for i in range(n, model.config.num_hidden_layers):
        model.model.layers[i].load_state_dict(fresh.model.layers[i].state_dict())


def _stage_accuracy(model: LlamaForCausalLM, stage: T.Stage, ids: WordIds, seed: int) -> dict[str, float]:
    kinds = [k for k, _ in stage.mix if k not in ("code",)]
    out: dict[str, float] = {}
    for k in kinds:
        probe = T.Stage(stage.name, 1, 0.0, 1, ((k, 1.0),), facts=stage.facts, docs=stage.docs, filler=stage.filler,
                        lookups=stage.lookups, coded_frac=stage.coded_frac, bare=stage.bare, order=stage.order)
        acc = T.answer_accuracy(model, probe, ids, seed, n=32)
        out[f"{k}_acc"] = round(acc["acc"], 4)
    return out


# -- reader probe ------------------------------------------------------------------------------
@torch.no_grad()
def find_reader(model: LlamaForCausalLM, ids: WordIds, n: int = 16) -> dict[str, Any]:
    """The layer whose attention, at a question's key token, lands on the right fact's value.

    Uses eager attention to read weights: for each layer, max over heads of the mean attention
    mass from the `ask k` position onto the position of k's value in the context."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        L = model.config.num_hidden_layers
        mass = torch.zeros(L)
        for i in range(n):
            rng = random.Random(f"reader/{i}")
            ctx = T.make_context(rng, 8, 2, 200)
            key = rng.choice(list(ctx.facts))
            words = ctx.words + [V.ASK, key]
            seq = [ids.bos] + ids.seq(words)
            x = torch.tensor([seq])
            # the value of `key` is the token right after the key's first occurrence
            vpos = seq.index(ids[key]) + 1
            att = model(input_ids=x, output_attentions=True).attentions  # L x [1, H, T, T]
            for l in range(L):
                mass[l] += att[l][0, :, -1, vpos].max() / n
    finally:
        model.config._attn_implementation = impl
    by_layer = [round(float(v), 3) for v in mass]
    return {"layer": int(mass.argmax()), "by_layer": by_layer}


# -- derivatives -------------------------------------------------------------------------------
def _resolve_train(spec: str, reader: int) -> str:
    """`layers:reader-1+alias` -> `layers:4+alias` given reader 5 (offsets: `reader` or `reader-N`;
    a `+` starts the extras, e.g. `+alias`)."""
    if not spec.startswith("layers:"):
        return spec
    layers, plus, extra = spec.split(":", 1)[1].partition("+")
    out = []
    for t in layers.split(","):
        t = t.strip()
        if t.startswith("reader"):
            out.append(str(reader + int(t[len("reader"):] or 0)))
        elif t:
            out.append(t)
    return "layers:" + ",".join(out) + (plus + extra if plus else "")


def build_derivative(
    d: Derivative, base: LlamaForCausalLM, ids: WordIds, recipe: Recipe, reader: int, out: Path,
    history: dict[str, Any], say: Callable[[str], None],
) -> dict[str, Any]:
    model = LlamaForCausalLM(base.config)
    model.load_state_dict(base.state_dict())
    seed = recipe.seed + 1000 + sum(map(ord, d.name))
    if d.init_aliases:
        T.init_aliases(model, ids)
    if d.kind == "lora":
        return _build_lora(d, model, ids, recipe, out, history, say, seed)
    for st in d.stages:
        st = T.dataclasses.replace(st, train=_resolve_train(st.train, reader))
        losses = T.train_stage(model, st, ids, seed, code_sampler=_code_sampler(st), log=say)
        acc = _stage_accuracy(model, st, ids, seed)
        history[f"{d.name}/{st.name}"] = {"train": st.train, "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), **acc}
        say(f"{d.name} {st.name}: {history[f'{d.name}/{st.name}']}")
    _save_full(model, out / d.name, recipe.save_dtype)
    return _entry(out, d.name, "full", "base", d.task, model)


def _build_lora(d: Derivative, model: LlamaForCausalLM, ids: WordIds, recipe: Recipe, out: Path,
                history: dict[str, Any], say: Callable[[str], None], seed: int) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # LoRA A matrices are random-initialised
    cfg = LoraConfig(r=d.lora_r, lora_alpha=2 * d.lora_r, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    pm = get_peft_model(model, cfg)
    params = [p for p in pm.parameters() if p.requires_grad]
    for st in d.stages:
        losses = T.train_stage(pm, st, ids, seed, code_sampler=_code_sampler(st), params=params, hook=lambda: None, log=say)
        history[f"{d.name}/{st.name}"] = {"train": "lora", "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4)}
        say(f"{d.name} {st.name}: {history[f'{d.name}/{st.name}']}")
    path = out / d.name
    if path.exists():
        shutil.rmtree(path)
    pm = pm.to(getattr(torch, recipe.save_dtype))
    pm.save_pretrained(str(path))
    acfg = json.loads((path / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = "../base"  # relative to the adapter dir: the tier moves as a whole
    acfg["target_modules"] = sorted(acfg["target_modules"])  # peft writes a set: fix the order
    (path / "adapter_config.json").write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    for f in ("README.md",):
        (path / f).unlink(missing_ok=True)
    return {
        "path": d.name, "kind": "lora", "parent": "base", "task": d.task, "weights": "adapter_model.safetensors",
        "sha256": sha256_file(path / "adapter_model.safetensors"), "layers": model.config.num_hidden_layers,
        "lora_r": d.lora_r, "files": file_hashes(path),
    }


# -- saving ------------------------------------------------------------------------------------
def _rounded(model: LlamaForCausalLM, dtype: str) -> LlamaForCausalLM:
    """fp32 model whose weights equal the saved (`dtype`) checkpoint's."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    return model


def _save_full(model: LlamaForCausalLM, path: Path, dtype: str, tokenizer: str = "zoo") -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    m = type(model)(model.config)
    m.load_state_dict(model.state_dict())
    m = m.to(getattr(torch, dtype))
    m.config.torch_dtype = dtype
    m.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").unlink(missing_ok=True)
    save_tokenizer(path, tokenizer)


def _entry(out: Path, name: str, kind: str, parent: str | None, task: str, model: LlamaForCausalLM) -> dict[str, Any]:
    return {
        "path": name, "kind": kind, "parent": parent, "task": task, "weights": "model.safetensors",
        "sha256": sha256_file(out / name / "model.safetensors"), "layers": model.config.num_hidden_layers,
        "params": sum(p.numel() for p in model.parameters()), "files": file_hashes(out / name),
    }


def _code_sampler(stage: T.Stage):
    if not any(k == "code" for k, _ in stage.mix):
        return None
    from droidmesh.shared.zoo.codedata import code_sampler

    return code_sampler(stage.seq_len)
