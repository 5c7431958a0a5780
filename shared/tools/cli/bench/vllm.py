"""`droidmesh bench vllm`: vLLM alone against vLLM with the DroidMesh connector, in one run
(registered on the `bench` group by `shared/tools/cli/bench/__init__.py`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from droidmesh.shared import report
from droidmesh.shared.engines.vllm.client import PYTHON
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.params import int_list

COLUMNS = ["context_tokens", "alone_ttft_s", "miss_over_alone", "partial_ttft_s", "alone_over_partial",
           "full_reuse_ttft_s", "alone_over_full_reuse", "decode_ratio"]


@click.command("vllm")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows and the machine here.")
@click.option("--vllm-python", default=str(PYTHON), show_default=True, type=click.Path(dir_okay=False),
              help="The python of the vLLM environment (`bash infra/vllm/install.sh`).")
@click.option("--contexts", default="2048", callback=int_list, show_default=True, help="Context lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50), help="Median of this many.")
@click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(2, 1024),
              help="Tokens of the decode-rate generation.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]),
              help="vLLM's weights and cache, the sender's and the connector's own layers.")
@click.option("--lora", is_flag=True, help="Serve docqa as a LoRA adapter of base (default: merged into it).")
def vllm(json_path, vllm_python, contexts, repeats, new_tokens, dtype, lora) -> None:
    """TTFT and decode rate: vLLM alone, and with the connector (miss, partial, full reuse)."""
    from droidmesh.shared.tools.bench import vllm_reuse
    from droidmesh.shared.zoo.manifest import zoo_dir
    from droidmesh.shared.zoo.real import build_real

    if not Path(vllm_python).is_file():
        raise click.BadParameter(f"{vllm_python} does not exist: run `bash infra/vllm/install.sh`",
                                 param_hint="--vllm-python")
    try:
        tier = zoo_dir("real")
        build_real(tier)
        with tempfile.TemporaryDirectory(prefix="dm-bench-vllm-") as work:
            result = vllm_reuse.run(vllm_python, tier, contexts, repeats, new_tokens, dtype, Path(work),
                                    lambda line: click.echo(line, err=True), lora=lora)
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report.format_table(result["rows"], COLUMNS))
    for row in result["rows"]:
        click.echo(f"{row['context_tokens']} tokens, connector paths: {row['paths']}")
    save(json_path, "vllm", result)


COMMANDS = (vllm,)
