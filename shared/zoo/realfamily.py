"""The real-family tier: two real families, translated KV each way between them.

  smollm2  SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, a 49K-token
           tokenizer): the real tier's base (`shared/zoo/real.py`, Apache-2.0), linked here.
  gemma    Gemma 3 270M (18 layers, hidden 640, sliding-window and global layers, a 262K-token
           tokenizer): built from its registry packages (`realbase.gemma3_base`).
  docqa    a LoRA of Gemma 3 trained here on the real tier's `doc_qa` train split (as the real tier's
           SmolLM2 fine-tunes are, `real.train_lora`): the pair gemma -> docqa is same-family
           reuse on the second family (partial recompute, `droidmesh profile`).
Each base is a translation source and target for the other. A pair's translator is fitted by the
code path of `droidmesh profile --translate` (`translate_fit.profile_translated`) on the real
tier's `doc_qa` train split, and scored on its test split (other source files): the profile
JSON is profiles/<pair>.json, the translator profiles/translators/<pair>.safetensors, and the
manifest's `translate_pairs` name each with its sha256 (as the family tier's do).

Gemma 3 comes under the Gemma Terms of Use, not Apache-2.0: building this tier is the user's
choice. Nothing of its weights, and nothing fitted on them (the translators, both directions
read or write Gemma's states), is committed; the repository's zoo/real-family holds only a
README. Everything is built into the user's cache (`zoo_dir("real-family")`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.model.names import Pair, sha256_file
from droidmesh.shared.zoo import realbase
from droidmesh.shared.zoo.manifest import MANIFEST, profile_file, read_manifest, zoo_dir
from droidmesh.shared.zoo.real import FineTune

TIER = "real-family"
TASK = "doc_qa"
N_TRAIN = 16  # calibration contexts (~1-1.5K tokens each; the last quarter held out by the fit)
N_TEST = 8    # scored test rows: a CPU budget (each row runs both models' prefills several times)
CANDIDATES = 2  # source layers the fit may read: the build's CPU budget (`profile --translate` fits at 8)
TRANSLATE_PAIRS = (Pair("smollm2", "gemma", TASK), Pair("gemma", "smollm2", TASK))
PAIRS = (Pair("gemma", "docqa", TASK),)  # same-family pairs on Gemma 3
GEMMA_FINE_TUNE = FineTune("docqa", TASK, 120, chars=(3500, 6000))  # the profile's context lengths (~1K tokens)
LICENSE_NOTE = ("gemma: " + realbase.GEMMA3.license + ". Building this tier is the user's choice under those terms; "
                "its weights and the translators fitted on them stay in the user's cache, never in the repository.")


def recipe_hash() -> str:
    from droidmesh.shared.profiling import translate_fit as F

    blob = [TASK, N_TRAIN, N_TEST, [p.id for p in TRANSLATE_PAIRS], realbase.SMOLLM2.facts, realbase.GEMMA3.facts,
            [CANDIDATES, F.MAX_SOURCES, F.MIN_GAIN, list(F.RANKS), F.MAX_RANK_LOSS, list(F.LAMBDAS)]]
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def build_real_family(out_dir: str | Path | None = None, *, force: bool = False,
                      log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Both bases (built or reused), then each pair's translator (fitted, or reused where its
    profile names the same weights and its file is intact); writes and returns the manifest.
    Raises ConfigError where a base's packages cannot be had."""
    from droidmesh.shared.zoo.real import build_real

    say = log or (lambda s: None)
    out = Path(out_dir) if out_dir is not None else zoo_dir(TIER)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    build_real(zoo_dir("real"), log=say)  # the SmolLM2 base (reused when built)
    link = out / "smollm2"
    target = (zoo_dir("real") / "base").resolve()
    if link.is_symlink() and link.resolve() != target:
        link.unlink()
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)
    realbase.gemma3_base(out / "gemma", say)
    models = {
        "smollm2": _entry(out, "smollm2", "pretrained (SmolLM2-135M-Instruct)", realbase.SMOLLM2.license),
        "gemma": _entry(out, "gemma", "pretrained (Gemma 3 270M)", realbase.GEMMA3.license),
    }
    models["docqa"] = _gemma_finetune(out, models["gemma"]["sha256"], force, say)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the measured TTFTs are 1-thread figures, as the other tiers'
    try:
        pairs = [_translate_pair(out, p, models, force, say) for p in TRANSLATE_PAIRS]
    finally:
        torch.set_num_threads(threads)
    manifest = {"tier": TIER, "recipe_hash": recipe_hash(), "models": models,
                "pairs": [{"sender": p.sender, "receiver": p.receiver, "task": p.task} for p in PAIRS],
                "translate_pairs": pairs,
                "license": LICENSE_NOTE, "build_seconds": round(time.time() - t0, 1), "threads": 1,
                "torch": torch.__version__}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _entry(out: Path, name: str, task: str, license_: str) -> dict[str, Any]:
    d = out / name
    cfg = json.loads((d / "config.json").read_text())
    return {"path": name, "weights": "model.safetensors", "sha256": sha256_file(d / "model.safetensors"),
            "kind": "full", "parent": None, "task": task, "license": license_,
            "layers": cfg.get("num_hidden_layers") or cfg.get("text_config", {}).get("num_hidden_layers"),
            "family": cfg.get("model_type", "")}


def _gemma_finetune(out: Path, base_sha256: str, force: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Gemma 3's doc_qa LoRA (`GEMMA_FINE_TUNE`): reused where its training record names this base
    and these settings and its weights are intact, else trained (about 30 minutes here)."""
    from droidmesh.shared.zoo.real import SOURCES, train_lora

    ft = GEMMA_FINE_TUNE
    d = out / ft.name
    record = d / "training.json"
    facts = json.loads(record.read_text()) if record.is_file() else {}
    weights = d / "adapter_model.safetensors"
    if force or facts.get("base_sha256") != base_sha256 or facts.get("steps") != ft.steps \
            or facts.get("chars") != list(ft.chars) \
            or not weights.is_file() or facts.get("adapter_sha256") != sha256_file(weights):
        facts = train_lora(out / "gemma", d, ft, say, base_ref="../gemma")
        facts.update(base_sha256=base_sha256, adapter_sha256=sha256_file(weights))
        record.write_text(json.dumps(facts, indent=2) + "\n")
    else:
        say(f"{ft.name}: Gemma 3 adapter reused (trained {facts.get('seconds', '?')} s)")
    return {"path": ft.name, "weights": weights.name, "sha256": facts["adapter_sha256"], "kind": "lora",
            "parent": "gemma", "task": ft.task, "lora_r": ft.r, "layers": 18, "family": "gemma3_text",
            "license": realbase.GEMMA3.license, "data": SOURCES[ft.task],
            "training": {k: facts[k] for k in ("steps", "rows", "lr", "seconds", "threads", "loss_first", "loss_last")}}


def _translate_pair(out: Path, pair: Pair, models: dict[str, Any], force: bool,
                    say: Callable[[str], None]) -> dict[str, Any]:
    """The pair's manifest entry: its profile (`droidmesh profile --translate`'s JSON) reused
    when it names these weights and its translator file is intact, else fitted and scored."""
    json_path = profile_file(out, pair)
    shas = (models[pair.sender]["sha256"], models[pair.receiver]["sha256"])
    prof = json.loads(json_path.read_text()) if json_path.is_file() else None
    tr_path = json_path.parent / "translators" / f"{pair.id}.safetensors"
    fresh = prof is not None and not force and _same_recipe(prof, pair, shas) and tr_path.is_file() \
        and sha256_file(tr_path) == prof["translator_sha256"]
    if not fresh:
        prof = _profile(out, pair, shas, tr_path, say)
        json_path.write_text(json.dumps(prof, indent=2) + "\n")
    assert prof is not None
    return {"source": pair.sender, "target": pair.receiver, "task": pair.task,
            "translator": str(tr_path.relative_to(out)), "translator_sha256": prof["translator_sha256"],
            "profile": str(json_path.relative_to(out)), "fit": prof["translator"], "fit_s": prof["fit_s"]}


def _same_recipe(prof: dict[str, Any], pair: Pair, shas: tuple[str, str]) -> bool:
    """Whether a profile JSON (this build's, or `droidmesh profile --translate --candidates
    CANDIDATES --n-train N_TRAIN --n-test N_TEST --task TASK`'s written at its path) is this recipe's."""
    fit = prof.get("translator", {})
    return (prof.get("models", {}).get("sender_sha256"), prof.get("models", {}).get("receiver_sha256")) == shas \
        and prof.get("task") == pair.task and prof.get("rows") == N_TEST and fit.get("contexts") == N_TRAIN \
        and fit.get("candidates") == CANDIDATES


def _profile(out: Path, pair: Pair, shas: tuple[str, str], tr_path: Path, say: Callable[[str], None]) -> dict[str, Any]:
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling.translate_fit import profile_translated
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    say(f"fitting and scoring translator {pair.id} ({N_TRAIN} train contexts, {N_TEST} test rows of {pair.task}; "
        "about 15 minutes on one CPU thread)")
    train = [r["context"] for r in make_rows(pair.task, "train", N_TRAIN, SuiteShape())]
    test = make_rows(pair.task, "test", N_TEST, SuiteShape())
    source, target = load_model(out / pair.sender, name=pair.sender), load_model(out / pair.receiver, name=pair.receiver)
    result = profile_translated(source, target, train, test, task_spec(pair.task), tr_path, weights=shas,
                                candidates=CANDIDATES)
    result["models"] = {"sender": f"{TIER}/{pair.sender}", "receiver": f"{TIER}/{pair.receiver}",
                        "sender_sha256": shas[0], "receiver_sha256": shas[1]}
    return result


def built(out_dir: Path | None = None) -> dict[str, Any] | None:
    """The tier's manifest where it is built, else None."""
    return read_manifest(out_dir if out_dir is not None else zoo_dir(TIER))
