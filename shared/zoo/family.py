"""The family tier: models that differ from the demo family the way real families differ, the
sources and targets of translated KV (a target of another size, architecture or tokenizer).

Each is pretrained from scratch with the demo base's ops (the same data, steps, rates and
stages; its own architecture, seed and reader layer), so each really reads its context (its
`fact_lookup` quality is in the tier's README):
  large   Llama, 16 layers, hidden 160, 5 heads of 32: the demo family, bigger; zoo tokenizer
  small   Llama, 6 layers, hidden 96, 3 heads of 32: the demo family, smaller; zoo tokenizer
  other   Qwen2, 6 layers, hidden 144, 4 heads of 36 over 2 KV heads (GQA 2:1), RoPE base 1e4,
          and the `split` tokenizer: another vocabulary over the same text (a filler word is two
          tokens), so moving a cache to or from it needs token alignment
The demo tier's `base` (12 layers, hidden 128) sits between large and small.

Sequence: per model, `build.build_base` with the demo ops rewritten for its arch and reader
(intermediate states cached in `.work/`, so separate processes may build separate models:
`--only`), saved in bf16 with its tokenizer; once every model is built, the translators of the
intended pairs are fit (`build_translators`) and the manifest names them all with their sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.model.names import Pair
from droidmesh.shared.zoo import build as B
from droidmesh.shared.zoo.manifest import MANIFEST, read_manifest, zoo_dir
from droidmesh.shared.zoo.recipe import RECIPE_VERSION, Recipe
from droidmesh.shared.zoo.tiers import demo_recipe
from droidmesh.shared.zoo.tokenizer import WordIds
from droidmesh.shared.zoo.train import Arch

TIER = "family"
TASK = "fact_lookup"
CALIBRATION = 32  # train contexts a zoo translator is fit on


@dataclasses.dataclass(frozen=True)
class Relative:
    name: str
    family: str       # train.FAMILIES
    tokenizer: str    # tokenizer.VARIANTS
    arch: Arch
    reader: int       # the layer whose attention the lookup stages supervise (demo: 5 of 12)


RELATIVES = (
    Relative("large", "llama", "zoo", Arch(16, 160, 5, 5, 416, 4096, 500000.0), reader=7),
    Relative("small", "llama", "zoo", Arch(6, 96, 3, 3, 256, 4096, 500000.0), reader=2),
    Relative("other", "qwen2", "split", Arch(6, 144, 4, 2, 384, 4096, 10000.0), reader=2),
)
# Translated pairs (source -> target) the tier intends; "demo/base" is the demo tier's base.
TRANSLATE_PAIRS = (
    ("large", "small"), ("small", "large"), ("demo/base", "small"),
    ("large", "other"), ("other", "small"), ("small", "other"),
)


def relative_recipe(rel: Relative, index: int) -> Recipe:
    """The demo tier's base ops for `rel`: its arch in `new`, its reader in the supervised stages."""
    demo = demo_recipe()
    ops = tuple(
        dataclasses.replace(op, arch=rel.arch) if op.kind == "new"
        else dataclasses.replace(op, stage=dataclasses.replace(op.stage, attn_layer=rel.reader))
        if op.stage is not None and op.stage.attn_sup > 0 else op
        for op in demo.base_ops
    )
    return dataclasses.replace(demo, tier=f"{TIER}/{rel.name}", seed=demo.seed + 100 * (index + 1), base_ops=ops,
                               derivatives=(), pairs=())


def relative_hash(rel: Relative, index: int) -> str:
    """What one model's weights depend on: its arch, family, tokenizer and recipe (a built model
    stays current when another model of the tier changes)."""
    blob = {"version": RECIPE_VERSION, "relative": dataclasses.asdict(rel),
            "recipe": dataclasses.asdict(relative_recipe(rel, index))}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def recipe_hash() -> str:
    """The tier's: every model's own hash, the pairs, and the demo base a translator reads."""
    demo = json.loads((demo_dir() / MANIFEST).read_text())["models"]["base"]["sha256"]
    blob = {"models": [relative_hash(r, i) for i, r in enumerate(RELATIVES)], "demo_base": demo, "pairs": TRANSLATE_PAIRS}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def build_family(out_dir: str | Path | None = None, *, only: Iterable[str] | None = None, force: bool = False,
                 log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Build the models named in `only` (default all) that are missing or stale; write and
    return the manifest once every model is built (None while some are still missing)."""
    out = Path(out_dir) if out_dir is not None else zoo_dir(TIER)
    names = [r.name for r in RELATIVES]
    wanted = list(only) if only else names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise BadRequestError(f"unknown family model(s) {unknown}; expected some of {names}")
    say = log or (lambda s: None)
    current = read_manifest(out)
    if current is not None and current.get("recipe_hash") == recipe_hash() and not force and all(
            (out / e.get("translator", "-")).is_file() for e in current.get("translate_pairs", [])):
        return current
    entries = out / ".work"
    entries.mkdir(parents=True, exist_ok=True)
    for i, rel in enumerate(RELATIVES):
        entry = entries / f"{rel.name}.entry.json"
        if rel.name in wanted and (force or not _current_entry(entry, out, relative_hash(rel, i))):
            say(f"building {rel.name} ({rel.family}, {rel.arch.layers} layers, tokenizer {rel.tokenizer})")
            entry.write_text(json.dumps(build_relative(rel, i, out, say), indent=2, sort_keys=True))
    built = {r.name: json.loads(p.read_text()) for i, r in enumerate(RELATIVES)
             if _current_entry(p := entries / f"{r.name}.entry.json", out, relative_hash(r, i))}
    if len(built) < len(RELATIVES):
        return None
    manifest = {
        "tier": TIER, "recipe_hash": recipe_hash(), "models": {n: e["model"] for n, e in built.items()},
        "pairs": [], "translate_pairs": build_translators(out, say),
        "history": {n: e["history"] for n, e in built.items()},
        "build_seconds": {n: e["seconds"] for n, e in built.items()}, "threads": 1, "torch": torch.__version__,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _current_entry(entry: Path, out: Path, want: str) -> bool:
    if not entry.is_file():
        return False
    e = json.loads(entry.read_text())
    f = out / e["model"]["path"] / e["model"]["weights"]
    return e.get("recipe_hash") == want and f.is_file() and B.sha256_file(f) == e["model"]["sha256"]


def build_relative(rel: Relative, index: int, out: Path, say: Callable[[str], None]) -> dict[str, Any]:
    recipe = relative_recipe(rel, index)
    ids = WordIds(variant=rel.tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    t0 = time.time()
    try:
        history: dict[str, Any] = {}
        model = B.build_base(recipe, ids, out / ".work" / rel.name, history, lambda s: say(f"{rel.name}: {s}"), rel.family)
        B._save_full(model, out / rel.name, recipe.save_dtype, rel.tokenizer)
        history["reader"] = B.find_reader(B._rounded(model, recipe.save_dtype), ids)
        entry = B._entry(out, rel.name, "full", None, "pretraining (retrieval)", model)
        entry.update(family=rel.family, tokenizer=rel.tokenizer)
    finally:
        torch.set_num_threads(threads)
    return {"recipe_hash": relative_hash(rel, index), "model": entry, "history": history,
            "seconds": round(time.time() - t0, 1)}


def build_translators(out: Path, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Fit every intended pair's translator on CALIBRATION train contexts of `TASK` (deterministic),
    saved as translators/<pair>.safetensors; the manifest's entries name each file and its sha256."""
    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.profiling.translate_fit import fit
    from droidmesh.shared.tasks.suite import SuiteShape, make_rows

    contexts = [r["context"] for r in make_rows(TASK, "train", CALIBRATION, SuiteShape())]
    entries = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for source, target in TRANSLATE_PAIRS:
            s_dir = demo_dir() / "base" if source == "demo/base" else out / source
            pair = Pair(source.rpartition("/")[2], target)
            path = out / "translators" / f"{pair.id}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            say(f"fitting translator {pair.id} on {len(contexts)} contexts")
            weights = (B.sha256_file(s_dir / "model.safetensors"), B.sha256_file(out / target / "model.safetensors"))
            t0 = time.time()
            tr = fit(load_model(s_dir, name=source.rpartition("/")[2]), load_model(out / target, name=target), contexts,
                     weights=weights)
            entries.append({"source": source, "target": target, "task": TASK, "translator": f"translators/{path.name}",
                            "translator_sha256": tr.save(path), "fit": tr.info, "fit_s": round(time.time() - t0, 1)})
    finally:
        torch.set_num_threads(threads)
    return entries


def demo_dir() -> Path:
    from droidmesh.shared.zoo.manifest import REPO_ZOO

    return REPO_ZOO / "demo"
