"""`droidmesh bench vllm` (vLLM alone against vLLM with the DroidMesh connector: TTFT and decode
rate) and `droidmesh bench vllm-rows` (the same, answer by answer on the real tier's doc_qa rows),
registered on the `bench` group by `shared/tools/cli/bench/__init__.py`."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from droidmesh.shared import report
from droidmesh.shared.engines.vllm.client import PYTHON
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.params import GROUP, int_list

COLUMNS = ["context_tokens", "alone_ttft_s", "miss_over_alone", "partial_ttft_s", "alone_over_partial",
           "full_reuse_ttft_s", "alone_over_full_reuse", "decode_ratio", "hold_over_alone", "save_copy_ms", "hold_ms"]


VLLM_PYTHON = click.option("--vllm-python", default=str(PYTHON), show_default=True, type=click.Path(dir_okay=False),
                           help="The python of the vLLM environment (`bash infra/vllm/install.sh`).")


def _on_real_tier(vllm_python: str, prefix: str, run: Callable[[Path, Path, Callable[[str], None]], Any]) -> Any:
    """`run(tier, scratch dir, progress)` on the built real tier; one line for a user's error."""
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    if not Path(vllm_python).is_file():
        raise click.BadParameter(f"{vllm_python} does not exist: run `bash infra/vllm/install.sh`",
                                 param_hint="--vllm-python")
    try:
        tier = zoo_dir("real")
        build_real(tier)
        with tempfile.TemporaryDirectory(prefix=prefix) as work:
            return run(tier, Path(work), lambda line: click.echo(line, err=True))
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None


PLAN_HELP = ("The pair's plan: this group of layers, START:END, recomputed from the sender's E at START "
             "(START 0: from the receiver's own embeddings).")


@click.command("vllm")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows and the machine here.")
@VLLM_PYTHON
@click.option("--contexts", default="2048", callback=int_list, show_default=True, help="Context lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50), help="Median of this many.")
@click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(2, 1024),
              help="Tokens of the decode-rate generation.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="vLLM's weights and cache, the sender's and the connector's own layers.")
@click.option("--lora", is_flag=True, help="Serve docqa as a LoRA adapter of base (default: merged into it).")
@click.option("--rounds", default=8, show_default=True, type=click.IntRange(2, 200),
              help="Rounds of each engine in turn for the miss's TTFT and the decode rate (their intervals).")
@click.option("--connector-first", is_flag=True,
              help="Start the connector's engine before vLLM alone (the start order moves a miss's TTFT on a "
                   "small host: run both orders).")
@click.option("--plan", "group", type=GROUP, default="6:9", show_default=True, help=PLAN_HELP)
def vllm(json_path, vllm_python, contexts, repeats, new_tokens, dtype, lora, rounds, connector_first, group) -> None:
    """TTFT and decode rate: vLLM alone, and with the connector (miss, partial, full reuse)."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.tools.bench import vllm_reuse

    result = _on_real_tier(vllm_python, "dm-bench-vllm-", lambda tier, work, say: vllm_reuse.run(
        vllm_python, tier, contexts, repeats, new_tokens, dtype, work, say, lora=lora, rounds=rounds,
        connector_first=connector_first, plan=ReusePlan.recompute(*group)))
    click.echo(report.format_table(result["rows"], COLUMNS))
    for row in result["rows"]:
        n, rounds_run = row["context_tokens"], row["decode_rounds"]
        click.echo(f"{n} tokens, connector paths: {row['paths']}")
        for what, key in (("decode rate", "decode_ratio"), ("miss TTFT", "miss_over_alone")):
            lo, hi = row[f"{key}_interval"]
            click.echo(f"{n} tokens, {what} with / without the connector: {row[key]:.3f} [{lo:.3f}, {hi:.3f}] "
                       f"(95 %, {rounds_run} rounds of each engine in turn)")
    save(json_path, "vllm", result)


def _interval(lo_hi: list[float] | tuple[float, float] | None) -> str:
    return "n/a" if lo_hi is None else f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"


@click.command("vllm-rows")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the verdicts and every row here.")
@VLLM_PYTHON
@click.option("--rows", default=48, show_default=True, type=click.IntRange(1, 2000), help="Rows of doc_qa.")
@click.option("--split", default="test", show_default=True, type=click.Choice(["test", "heldout"]),
              help="heldout: the standard library's packages, for a verdict on more rows and sources than test.")
@click.option("--pair-only", is_flag=True, help="Ask only the pair's questions (base -> docqa), not the same model's.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="vLLM's weights and cache, the sender's and the connector's own layers.")
@click.option("--no-engine", is_flag=True, help="Skip DroidMesh's own engine on the same rows.")
@click.option("--chunk", default=150, show_default=True, type=click.IntRange(1, 2000),
              help="Rows per mesh and engine start (a sender holds one chunk's contexts at a time).")
@click.option("--plan", "group", type=GROUP, default="6:9", show_default=True, help=PLAN_HELP)
@click.option("--resume", "resume_path", type=click.Path(exists=True, dir_okay=False),
              help="Continue a stopped run from its JSON (the same options; it may be --json's own file).")
@click.option("--beside", "beside_path", type=click.Path(exists=True, dir_okay=False),
              help="A `droidmesh eval --per-row` of real/base -> real/docqa on the same split that scored the "
                   "plan's group: DroidMesh's engine beside vLLM on the rows both scored.")
def vllm_rows(json_path, vllm_python, rows, split, pair_only, dtype, no_engine, chunk, group, resume_path,
              beside_path) -> None:
    """Same-model first-token agreement under full reuse, and base -> docqa quality under the plan."""
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.tools.bench import vllm_rows as bench

    plan = ReusePlan.recompute(*group)
    done = _read_json(resume_path, "--resume", "vllm-rows") if resume_path else None
    beside = _read_json(beside_path, "--beside") if beside_path else None
    if beside is not None:
        try:
            bench.check_beside(beside, split, dtype, plan)
        except DroidMeshError as e:
            raise click.BadParameter(str(e).removeprefix("--beside: "), param_hint="--beside") from None
    result = _on_real_tier(vllm_python, "dm-bench-vllm-rows-", lambda tier, work, say: bench.run(
        vllm_python, tier, rows, work, say, dtype, engine_too=not no_engine, chunk=chunk,
        on_chunk=lambda partial: save(json_path, "vllm-rows", {**partial, "partial": True}), split=split,
        same=not pair_only, done=done, plan=plan))
    s = result["summary"]
    same, pair = s.get("same_model", {}), s["pair"]
    click.echo(f"{s['rows']['pair']} rows of {result['task']} ({result['split']}, {result['contexts']} contexts), "
               f"{result['dtype']}, plan {result['plan']}")
    if same:
        lo, hi = same["first_token_interval"]
        click.echo(f"same model, full reuse (paths {same['paths']}): first token equal {same['first_token_equal']:.3f} "
                   f"[{lo:.3f}, {hi:.3f}], greedy agreement {same['greedy_agreement']:.3f}")
    own = same.get("vllm_across_batch_sizes")
    if own:
        lo, hi = own["first_token_interval"]
        click.echo(f"vLLM against itself, batched vs alone: first token equal {own['first_token_equal']:.3f} "
                   f"[{lo:.3f}, {hi:.3f}], greedy agreement {own['greedy_agreement']:.3f} ({own['rows']} rows)")
    for name in ("vllm", "vllm_by_source", "droidmesh_engine", "droidmesh_engine_by_source"):
        if name in pair:
            v = pair[name]
            click.echo(f"base -> docqa, {name}: {result['metric']} full prefill {v['full_prefill']:.3f}, plan "
                       f"{v['plan']:.3f}, relative {v['relative']}, 95% {_interval(v['relative_interval'])}: {v['verdict']}")
    click.echo(f"base -> docqa paths {pair['paths']}")
    save(json_path, "vllm-rows", result)  # the verdicts kept before the join, which may refuse the eval
    if beside is not None:
        b = pair["beside_eval"] = bench.engine_beside(result["pair_per_row"], beside, split, dtype, plan)
        for name in ("vllm", "droidmesh_engine"):
            v = b[name]
            click.echo(f"on the {b['rows']} rows the eval scored too, {name}: full prefill {v['full_prefill']:.3f}, "
                       f"plan {v['plan']:.3f}, 95% {_interval(v['relative_interval'])}: {v['verdict']}")
        click.echo(f"the same score in both engines: full prefill {b['same_score_full_prefill']}/{b['rows']}, "
                   f"plan {b['same_score_plan']}/{b['rows']}")
    save(json_path, "vllm-rows", result)


def _read_json(path: str, option: str, suite: str | None = None) -> dict[str, Any]:
    """A JSON object the user named (a `bench <suite>` JSON when `suite`); its contents are
    checked by the bench before use (`resumed`, `check_beside`)."""
    try:
        got = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}", param_hint=option) from None
    if not isinstance(got, dict) or (suite is not None and got.get("suite") != suite):
        what = f"a `bench {suite}` JSON" if suite else "a JSON object"
        raise click.BadParameter(f"{path} is not {what}", param_hint=option)
    return got


COMMANDS = (vllm, vllm_rows)
