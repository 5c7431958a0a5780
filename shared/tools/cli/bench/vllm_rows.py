"""`droidmesh bench vllm-rows`: vLLM with the DroidMesh connector against vLLM alone, answer by
answer, on the real tier's test rows (registered on the `bench` group by
`shared/tools/cli/bench/__init__.py`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from droidmesh.shared.engines.vllm.client import PYTHON
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save


def _interval(lo_hi: list[float] | tuple[float, float] | None) -> str:
    return "n/a" if lo_hi is None else f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"


@click.command("vllm-rows")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the verdicts and every row here.")
@click.option("--vllm-python", default=str(PYTHON), show_default=True, type=click.Path(dir_okay=False),
              help="The python of the vLLM environment (`bash infra/vllm/install.sh`).")
@click.option("--rows", default=48, show_default=True, type=click.IntRange(1, 2000), help="Test rows of doc_qa.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="vLLM's weights and cache, the sender's and the connector's own layers.")
@click.option("--no-engine", is_flag=True, help="Skip DroidMesh's own engine on the same rows.")
def vllm_rows(json_path, vllm_python, rows, dtype, no_engine) -> None:
    """Same-model first-token agreement under full reuse, and base -> docqa quality under the plan."""
    from droidmesh.shared.tools.bench import vllm_rows as bench
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    if not Path(vllm_python).is_file():
        raise click.BadParameter(f"{vllm_python} does not exist: run `bash infra/vllm/install.sh`",
                                 param_hint="--vllm-python")
    try:
        tier = zoo_dir("real")
        build_real(tier)
        with tempfile.TemporaryDirectory(prefix="dm-bench-vllm-rows-") as work:
            result = bench.run(vllm_python, tier, rows, Path(work), lambda line: click.echo(line, err=True), dtype,
                               engine_too=not no_engine)
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None
    s = result["summary"]
    same, pair = s["same_model"], s["pair"]
    lo, hi = same["first_token_interval"]
    click.echo(f"{s['rows']} rows of {result['task']} ({result['split']}), {result['dtype']}, plan {result['plan']}")
    click.echo(f"same model, full reuse (paths {same['paths']}): first token equal {same['first_token_equal']:.3f} "
               f"[{lo:.3f}, {hi:.3f}], greedy agreement {same['greedy_agreement']:.3f}")
    for name in ("vllm", "droidmesh_engine"):
        if name in pair:
            v = pair[name]
            click.echo(f"base -> docqa, {name}: {result['metric']} full prefill {v['full_prefill']:.3f}, plan "
                       f"{v['plan']:.3f}, relative {v['relative']}, 95% {_interval(v['relative_interval'])}: {v['verdict']}")
    click.echo(f"base -> docqa paths {pair['paths']}")
    save(json_path, "vllm-rows", result)


COMMANDS = (vllm_rows,)
