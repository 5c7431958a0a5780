"""The `real` zoo tier: SmolLM2-135M-Instruct (pretrained elsewhere) and LoRA fine-tunes of it made here.

Layout of the tier directory (default $DROIDMESH_ZOO_DIR/real or ~/.cache/droidmesh/zoo/real):
    manifest.json   models (sha256 of every file), pairs, each fine-tune's data, steps, time and loss
    base/           the dequantized float32 checkpoint (`shared.zoo.realbase`; fetched, never committed)
    <fine-tune>/    a peft LoRA adapter whose base is ../base
The adapters and the manifest are committed in the repository's zoo/real (the weights packed, as
`adapter_model.safetensors.xz`: `packed.py`), so a build on a fresh clone only fetches the base and
copies them out; `--force` trains them again (an hour or so on two
cores). Training rows come from the train split of `shared.tasks.realtext` (split by source file),
so no test context was ever trained on.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from droidmesh.shared.errors import CheckpointNotFoundError
from droidmesh.shared.model.names import Pair, sha256_file
from droidmesh.shared.tasks.realtext import SOURCES, make_real_rows
from droidmesh.shared.zoo import packed
from droidmesh.shared.zoo.manifest import MANIFEST, REPO_ZOO, read_manifest, zoo_dir
from droidmesh.shared.zoo.realbase import FACTS, write_base

TIER = "real"


@dataclasses.dataclass(frozen=True)
class FineTune:
    name: str
    task: str
    steps: int
    lr: float = 1e-3
    r: int = 16
    chars: tuple[int, int] = (1200, 2400)  # training contexts (~300-700 tokens): shorter than the test's


FINE_TUNES = (
    FineTune("docqa", "doc_qa", 40),
    FineTune("summ", "doc_summary", 40),
    FineTune("code", "code_completion/real", 40),
)
PAIRS = (
    Pair("base", "docqa", "doc_qa"),
    Pair("base", "summ", "doc_summary"),
    Pair("base", "code", "code_completion/real"),
    Pair("summ", "docqa", "doc_qa"),
)
SEED = 29


def build_real(out_dir: str | Path | None = None, *, force: bool = False,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Fetch the base, then copy the committed fine-tunes (or train them: `force`, or none committed)."""
    say = log or (lambda s: None)
    out = Path(out_dir) if out_dir is not None else zoo_dir(TIER)
    out.mkdir(parents=True, exist_ok=True)
    committed = read_manifest(REPO_ZOO / TIER)
    t0 = time.time()
    base_facts = _ensure_base(out, committed, say)
    models: dict[str, Any] = {"base": {**_files_entry(out, "base", "model.safetensors"), "kind": "full", "parent": None,
                                       "task": "pretrained (SmolLM2-135M-Instruct)", **base_facts}}
    history: dict[str, Any] = dict((committed or {}).get("history", {})) if not force else {}
    trained = []
    for ft in FINE_TUNES:
        src = REPO_ZOO / TIER / ft.name
        entry = (committed or {}).get("models", {}).get(ft.name)
        if not force and entry:  # the committed adapter, checked against its manifest, unpacked into `out`
            _copy_out(src, entry, out / ft.name)
            say(f"{ft.name}: committed adapter (trained {history.get(ft.name, {}).get('seconds', '?')} s)")
        else:
            history[ft.name] = train_lora(out / "base", out / ft.name, ft, say)
            trained.append(ft.name)
        models[ft.name] = {**_files_entry(out, ft.name, "adapter_model.safetensors"), "kind": "lora", "parent": "base",
                           "task": ft.task, "lora_r": ft.r, "data": SOURCES[ft.task.split("/")[0]]}
    if out.resolve() == (REPO_ZOO / TIER).resolve():  # the committed tier refreshed: its new weights are committed packed
        for name in trained:  # (the unpacked ones stay, git-ignored: the tier stays loadable where it is)
            packed.pack(out / name / "adapter_model.safetensors")
    for extra in ("profiles", "eval"):  # committed measurements travel with the adapters they measured
        src = REPO_ZOO / TIER / extra
        if src.is_dir() and src.resolve() != (out / extra).resolve():
            shutil.copytree(src, out / extra, dirs_exist_ok=True)
    manifest = {
        "tier": TIER, "recipe_hash": _recipe_hash(), "models": models,
        "pairs": [{"sender": p.sender, "receiver": p.receiver, "task": p.task} for p in PAIRS],
        "history": history, "build_seconds": round(time.time() - t0, 1), "torch": torch.__version__,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _ensure_base(out: Path, committed: dict[str, Any] | None, say: Callable[[str], None]) -> dict[str, Any]:
    want = (committed or {}).get("models", {}).get("base", {})
    have = out / "base" / "model.safetensors"
    if have.is_file() and (not want or sha256_file(have) == want.get("sha256")):
        return dict(FACTS)
    facts = write_base(out / "base", say)
    got = sha256_file(have)
    if want and got != want.get("sha256"):  # another transformers/gguf version may round differently
        say(f"note: the dequantized base has sha256 {got[:16]}, the committed manifest says {want['sha256'][:16]}")
    return facts


def _copy_out(src: Path, entry: dict[str, Any], to: Path) -> None:
    """The committed adapter's files (those `entry` names), each from the copy in `src` (as it is,
    or packed) with the bytes it hashes, unpacked, as the whole of `to`; where `to` is `src` itself
    (the repository's tier built in place), only the unpacked files it lacks are added.
    `CheckpointNotFoundError` naming the first missing or damaged one, leaving no part of `to`
    (`--force` trains it again, which takes an hour or so: never done unasked)."""
    in_place = src.resolve() == to.resolve()
    if not in_place:
        shutil.rmtree(to, ignore_errors=True)
    for name, want in entry.get("files", {}).items():
        if not any(packed.sha256_of(path) == want if path == to / name else packed.copy_out(path, to / name, want)
                   for path in packed.copies(src, name)):
            if not in_place:
                shutil.rmtree(to, ignore_errors=True)
            raise CheckpointNotFoundError(f"{src / name}: the committed file is missing or does not match its manifest "
                                          f"(a damaged checkout?); `droidmesh zoo build --tier real --force` trains it again")


def _files_entry(out: Path, name: str, weights: str) -> dict[str, Any]:
    d = out / name
    files = sorted(f for f in d.iterdir() if f.is_file() and not f.name.startswith(".") and not f.name.endswith(packed.SUFFIX))
    return {"path": name, "weights": weights, "sha256": sha256_file(d / weights), "layers": 30,
            "files": {f.name: sha256_file(f) for f in files}}


def _recipe_hash() -> str:
    import hashlib

    blob = json.dumps([dataclasses.asdict(f) for f in FINE_TUNES] + [dataclasses.astuple(p) for p in PAIRS] + [SEED])
    return hashlib.sha256(blob.encode()).hexdigest()


# -- training -------------------------------------------------------------------------------------
def train_lora(base: Path, out: Path, ft: FineTune, say: Callable[[str], None], base_ref: str = "../base") -> dict[str, Any]:
    """A LoRA (q, k, v, o of every layer) trained on `ft.steps` train-split rows of `ft.task`, one row
    a step, loss on the answer and the end-of-turn token after it (so greedy decoding stops there).
    `base_ref`: the base's directory as the adapter names it, relative to the adapter's own."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from droidmesh.shared.tasks.rows import encode_row
    from droidmesh.shared.tasks.spec import task_spec

    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    pm = get_peft_model(model, LoraConfig(r=ft.r, lora_alpha=2 * ft.r, lora_dropout=0.0,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ft.lr, weight_decay=0.0)
    warm = max(1, ft.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / ft.steps))))
    rows = make_real_rows(ft.task, "train", ft.steps, chars=ft.chars, seed=SEED)
    random.Random(SEED).shuffle(rows)
    spec = task_spec(ft.task)
    losses, t0 = [], time.time()
    pm.train()
    bar = tqdm(rows, desc=f"train {ft.name} ({ft.task})", unit="step")
    for row in bar:
        ctx, q, ans = encode_row(tok, row, spec)
        target = ans + [tok.eos_token_id]
        ids = torch.tensor([ctx + q + target])  # [1, T]
        # loss on the answer and its end only, so only their predictions need the vocabulary head
        # (Gemma 3's 262K-token head over every position tripled a step); same loss as `labels=`
        logits = pm(input_ids=ids, logits_to_keep=len(target) + 1).logits  # [1, len(target) + 1, V]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, -len(target):])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    seconds = round(time.time() - t0, 1)
    if out.exists():
        shutil.rmtree(out)
    pm = pm.to(torch.bfloat16)
    pm.save_pretrained(str(out))
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base_ref  # relative: the tier directory moves as a whole
    cfg["target_modules"] = sorted(cfg["target_modules"])  # peft writes a set: a stable order
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)
    k = max(1, len(losses) // 10)
    facts = {"task": ft.task, "data": SOURCES[ft.task.split("/")[0]], "split": "train (by source file)",
             "steps": ft.steps, "rows": len(rows), "chars": list(ft.chars), "lr": ft.lr, "lora_r": ft.r, "seconds": seconds,
             "threads": torch.get_num_threads(), "loss_first": round(sum(losses[:k]) / k, 4),
             "loss_last": round(sum(losses[-k:]) / k, 4), "losses": [round(x, 4) for x in losses]}
    say(f"{ft.name}: {ft.steps} steps in {seconds} s, loss {facts['loss_first']} -> {facts['loss_last']}")
    return facts
