"""`droidmesh bench ttft | quality`: the engine alone, in this process (TTFT by context and
group; quality of every plan on a zoo pair).
"""

from __future__ import annotations

from typing import Any

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import save
from droidmesh.shared.tools.cli.model_options import device_options
from droidmesh.shared.tools.cli.params import int_list

# Before the zoo's demo tier exists, latency runs on a random-init 12-layer model of this shape.
SHAPE_NAMES = ("llama3-8b", "qwen2.5-7b", "llama3.2-1b", "smollm2-135m", "tiny")  # shared/model/shapes.py (imported lazily: transformers)
RANDOM_BENCH_MODEL: dict[str, Any] = dict(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=6,
    num_key_value_heads=2, vocab_size=4096, max_position_embeddings=8192,
)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows and machine info here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a speedup-vs-k PNG here.")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False),
              help="Local HF checkpoint (default: a random-init 12-layer Llama).")
@click.option("--shape", type=click.Choice(sorted(SHAPE_NAMES)), default=None,
              help="A named architecture, random-init directly on the device (latency and memory only).")
@click.option("--contexts", default="1024,2048,4096", callback=int_list, show_default=True,
              help="Context lengths in tokens.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@device_options
@click.option("--threads", default=None, type=click.IntRange(1, 256), help="torch threads (default: torch's).")
def ttft(json_path, plot_path, model_path, shape, contexts, repeats, device, dtype,
         threads) -> None:
    """Receiver TTFT: full prefill vs full reuse vs partial prefill with k layers recomputed."""
    from droidmesh.shared.model import shapes
    from droidmesh.shared.model.adapter import load_model, random_model
    from droidmesh.shared.tools.bench import ttft as suite

    if threads:
        import torch

        torch.set_num_threads(threads)
    if model_path and shape:
        raise click.UsageError("give --model or --shape, not both")
    try:
        if model_path:
            model = load_model(model_path, device=device, dtype=dtype)
        elif shape:
            model = shapes.build(shape, device, dtype)
        else:
            click.echo("no --model given: using a random-init 12-layer Llama (latency only, no quality)", err=True)
            model = random_model("llama", device=device, dtype=dtype, name="random-llama-12L", **RANDOM_BENCH_MODEL)
    except DroidMeshError as e:  # no such GPU, not a checkpoint: one line
        raise click.UsageError(str(e)) from None
    rows = suite.measure(model, contexts, repeats)
    cols = ["context_tokens", "mode", "recomputed_layers", "total_layers", "ttft_s", "speedup", "ideal_speedup"]
    click.echo(report.format_table(rows, cols))
    report.write_json(json_path, {"suite": "ttft", "machine": report.machine(), "model": report.model_record(model),
                                  "rows": rows})
    if plot_path:
        suite.plot(rows, plot_path)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False))
@click.option("--pair", "pair_index", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Which of the zoo's pairs.")
@click.option("--rows", default=32, show_default=True, type=click.IntRange(1, 1000))
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False),
              help="A `droidmesh profile` JSON whose frontier to sweep (default: the zoo's, if saved).")
@click.option("--long-tokens", default=4096, show_default=True, type=click.IntRange(16, 65536),
              help="Tokens of the long context each config's second TTFT (`ttft_4k_s`) is timed on.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50),
              help="Timed runs per TTFT (median), after one untimed.")
@device_options
def quality(json_path, plot_path, pair_index, rows, profile_path, long_tokens, repeats, device, dtype) -> None:
    """TTFT vs quality for full prefill, full reuse, CacheBlend and DroidMesh groups."""
    import json
    from pathlib import Path

    from droidmesh.shared.model.adapter import load_model
    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.profiling.datasets import load_rows
    from droidmesh.shared.tasks.scorer import PairScorer
    from droidmesh.shared.tasks.spec import task_spec
    from droidmesh.shared.tools.bench import quality as suite
    from droidmesh.shared.zoo.manifest import find_tiers, profile_file, resolve_model
    from droidmesh.shared.zoo.tiers import get_recipe

    tiers = find_tiers()
    if not tiers:
        raise click.ClickException("no zoo tier built: run `droidmesh zoo build --tier demo` (or ci)")
    tier, root, man = tiers[0]
    if pair_index >= len(man["pairs"]):
        raise click.BadParameter(f"the {tier} tier has {len(man['pairs'])} pairs (0..{len(man['pairs']) - 1}), "
                                 f"not {pair_index}", param_hint="'--pair'")
    pair = man["pairs"][pair_index]
    names = Pair(pair["sender"], pair["receiver"])
    try:
        s_ref, r_ref = resolve_model(f"{tier}/{names.sender}"), resolve_model(f"{tier}/{names.receiver}")
        sender = load_model(s_ref.path, device=device, dtype=dtype, name=s_ref.name)
        receiver = load_model(r_ref.path, device=device, dtype=dtype, name=r_ref.name)
    except DroidMeshError as e:  # no such GPU: one line
        raise click.UsageError(str(e)) from None
    shape = get_recipe(tier).suite
    ev = PairScorer(sender, receiver, load_rows(pair["task"], "test", rows, shape=shape), task_spec(pair["task"]))
    prof = Path(profile_path) if profile_path else profile_file(root, names)
    frontier = json.loads(prof.read_text())["frontier"] if prof.is_file() else None
    result = suite.measure(sender, receiver, ev, frontier, long_tokens=long_tokens, repeats=repeats)
    click.echo(report.format_table(result["rows"], ["config", "recomputed_layers", "quality", "ttft_s", "speedup",
                                                    "ttft_4k_s", "speedup_4k"]))
    click.echo(f"sender alone: {result['sender_alone']:.3f}; speedup_at_5pct (4K tokens): {result['speedup_at_5pct']}")
    save(json_path, "quality", {"pair": pair, "tier": tier, "model": report.model_record(receiver), **result})
    if plot_path:
        suite.plot(result, plot_path, f"{names.id} ({pair['task']})")


COMMANDS = (ttft, quality)
