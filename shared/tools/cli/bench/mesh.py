"""`droidmesh bench drift | sidechannel | held`: suites over a whole local mesh (a drifting
workload, the reuse side channel, held contexts across adapters).
"""

from __future__ import annotations

import click

from droidmesh.shared import report
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.tools.cli.bench.kit import DEFAULT_GROUPS, demo_pair, launched_device_option, save
from droidmesh.shared.tools.cli.params import GROUP, checkpoint_layers, int_list


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the summary and every request here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write the agreement / score timeline PNG here.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Every process's log (default: a temporary directory).")
@click.option("--before", default="multihop_qa/plain", show_default=True, help="Task the pair is profiled on and served first.")
@click.option("--after", default="multihop_qa/coded", show_default=True, help="Task the workload shifts to.")
@click.option("--n-before", default=40, show_default=True, type=click.IntRange(1, 1000), help="Requests before the shift.")
@click.option("--n-settled", default=40, show_default=True, type=click.IntRange(1, 1000),
              help="Requests on the re-profiled config before stopping.")
@click.option("--max-shifted", default=200, show_default=True, type=click.IntRange(1, 2000),
              help="Requests after the shift at most (the run stops there if no new config came).")
@click.option("--profile-rows", default=8, show_default=True, type=click.IntRange(1, 200),
              help="Train and test rows of the first profile.")
@click.option("--threshold", default=0.4, show_default=True, type=click.FloatRange(0, 1),
              help="Receiver's quality_threshold (mean shadow token agreement that raises the alarm).")
@click.option("--window", default=20, show_default=True, type=click.IntRange(1, 1000), help="Receiver's quality_window.")
def drift(json_path, plot_path, log_dir, before, after, n_before, n_settled, max_shifted, profile_rows, threshold,
          window) -> None:
    """Quality watch: a pair profiled on one task, the workload shifting to another; requests to
    the alarm, to the re-profiled config, and the answers' score against full prefill per phase."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.errors import BadRequestError
    from droidmesh.shared.tools.bench import drift as suite
    from droidmesh.shared.zoo.manifest import REPO_ZOO, read_manifest, tier_models
    from droidmesh.shared.zoo.tiers import get_recipe

    root = REPO_ZOO / "demo"
    manifest = read_manifest(root)
    if manifest is None:
        raise BadRequestError(f"no committed demo tier at {root}; run `droidmesh zoo build --tier demo --out {root}`")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="droidmesh-drift-"))
    result = suite.run_drift(tier_models(root, manifest), get_recipe("demo").suite, logs, lambda s: click.echo(s, err=True),
                             before=before, after=after, n_before=n_before, n_settled=n_settled, max_shifted=max_shifted,
                             n_profile=profile_rows, threshold=threshold, window=window)
    click.echo(report.format_table(result["rows"], suite.COLUMNS))
    click.echo(f"alarm {result['requests_to_alarm']} and new config {result['requests_to_new_config']} requests after "
               f"the shift; plan {result.get('old_plan')} -> {result.get('new_plan')}; re-profile took "
               f"{result['reprofile_s']} s; logs in {logs}")
    save(json_path, "drift", result)
    if plot_path:
        suite.plot_png(result, plot_path)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write both phases and every trial here.")
@click.option("--tokens", default=3000, show_default=True, type=click.IntRange(16, 4000),
              help="Context length (the demo models' filler words are one token each; they hold 4096 positions).")
@click.option("--trials", default=30, show_default=True, type=click.IntRange(4, 2000),
              help="Cached and as many uncached requests per phase; half of each train the threshold, half test it.")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(0, 100),
              help="Untimed cached + uncached pairs before each phase's trials.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--holding", is_flag=True,
              help="Contexts are the victim's own requests, held by the receiver (no sender, no operator prefill).")
@click.option("--receiver", "receiver_arg", default=None,
              help="With --holding: the receiver's model (zoo name, e.g. real/base, or a checkpoint); default the demo "
                   "pair's receiver.")
@click.option("--phase", "phases", type=click.Choice(["before", "after"]), multiple=True,
              help="Run only this phase (repeatable; default both): `after` alone is the check that scopes hold.")
@launched_device_option
def sidechannel(json_path, tokens, trials, warmup, seed, holding, receiver_arg, phases, device) -> None:
    """Timing side channel through the gateway: another tenant times its requests for cached and
    uncached contexts of a victim tenant; its best TTFT threshold's accuracy (95 % Wilson interval)
    before scopes (one tenant) and after (two)."""
    from droidmesh.shared.tools.bench import sidechannel as suite
    from droidmesh.shared.zoo.manifest import resolve_model

    if receiver_arg is not None and not holding:
        raise click.BadParameter("only with --holding (a sender of the demo pair serves the other mode)",
                                 param_hint="'--receiver'")
    sender, receiver = demo_pair()
    if receiver_arg is not None:
        try:
            receiver = str(resolve_model(receiver_arg).path)
        except DroidMeshError as e:
            raise click.BadParameter(str(e), param_hint="'--receiver'") from None
    layers = checkpoint_layers(receiver)
    # the demo pair's profiled group; another receiver (the ci tier's, the real tier's) recomputes its upper half
    group = DEFAULT_GROUPS["base"] if receiver_arg is None and layers >= DEFAULT_GROUPS["base"][1] else \
        (layers // 2, layers)
    setup = suite.Setup(sender, receiver, group, device, holding,
                        tuple(p for p in suite.PHASES if p in phases) if phases else tuple(suite.PHASES))
    result = suite.run_sidechannel(setup, tokens, trials, warmup, seed, lambda m: click.echo(m, err=True))
    click.echo(report.format_table(suite.table_rows(result), suite.COLUMNS))
    for name, p in result["phases"].items():
        lo, hi = p["ci95"]
        click.echo(f"{name}: accuracy {p['accuracy']:.3f} on {p['test_trials']} test trials, 95% CI [{lo:.3f}, {hi:.3f}]"
                   f" {'contains' if p['chance_in_ci'] else 'excludes'} 0.5; paths {p['paths']}")
    save(json_path, "sidechannel", {"tokens": tokens, "trials_per_label": trials, "warmup": warmup, "seed": seed,
                                    "group": list(group), "sender": None if holding else sender, "receiver": receiver,
                                    **result})


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows here.")
@click.option("--docs", "n_docs", default=3, show_default=True, type=click.IntRange(1, 20),
              help="Documents per kind of row (each asked twice).")
@click.option("--chars", default="7600,8400", show_default=True, callback=int_list,
              help="Document length range in characters (~2K SmolLM2 tokens at 8K).")
@click.option("--base", "base_arg", default="real/base", show_default=True, help="The base model (zoo name or directory).")
@click.option("--adapters", "adapter_args", default="real/docqa,real/summ,real/code", show_default=True,
              help="Comma list of PEFT adapters of the base served beside it.")
@click.option("--pairs", "pair_args", default="summ:docqa,base:summ", show_default=True,
              help="Comma list of FIRST:SECOND served ids of paired rows (the first request to FIRST, the second to "
                   "SECOND, whose pair config plans the reuse).")
@click.option("--group", type=GROUP, default=None,
              help="Recompute group 'start,end' of the pair when its tier has no servable saved profile.")
@click.option("--model", "model_arg", default="real-family/gemma", show_default=True,
              help="One more model served alone for same-model rows ('' for none; skipped when not built).")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep every process's log here.")
def held(json_path, n_docs, chars, base_arg, adapter_args, pair_args, group, model_arg, log_dir) -> None:
    """Reuse without ceremony: one receiver serving the real tier's base and adapters, no sender, no
    prefill command; TTFT of the second request over a document against its first (same model, and
    a paired adapter in process), and against the same plan with the KV already local."""
    import tempfile
    from pathlib import Path

    from droidmesh.shared.model.names import Pair
    from droidmesh.shared.tools.bench import held as suite
    from droidmesh.shared.zoo.manifest import resolve_model

    if len(chars) != 2 or not 0 < chars[0] <= chars[1]:
        raise click.BadParameter(f"give 'LOW,HIGH' characters, got {chars}", param_hint="'--chars'")
    pairs = []
    for spec in (p.strip() for p in pair_args.split(",") if p.strip()):
        first, colon, second = spec.partition(":")
        if not (colon and first and second):
            raise click.BadParameter(f"{spec!r} is not FIRST:SECOND", param_hint="'--pairs'")
        pairs.append(Pair(first, second))
    try:
        base = resolve_model(base_arg)
        refs = [resolve_model(a.strip()) for a in adapter_args.split(",") if a.strip()]
    except DroidMeshError as e:
        raise click.UsageError(str(e)) from None
    logs = Path(log_dir or tempfile.mkdtemp(prefix="droidmesh-held-"))
    result = {"adapters": suite.run_adapters(base, refs, pairs, n_docs, logs / "adapters",
                                             chars=(chars[0], chars[1]), group=group)}
    if model_arg:
        try:
            model = resolve_model(model_arg)
        except DroidMeshError as e:
            click.echo(f"{model_arg}: {e}; its rows skipped", err=True)
        else:
            result["single"] = suite.run_single(model, n_docs, logs / "single", chars=(chars[0], chars[1]))
    rows = [r for part in result.values() for r in part["rows"]]
    click.echo(report.format_table(rows, suite.COLUMNS))
    for name, part in result.items():
        click.echo(f"{name}: {part['summary']}; holding: {part['holding']}")
    save(json_path, "held", {"when": suite.timestamp(), "log_dir": str(logs),
                             **{k: suite.strip(v) for k, v in result.items()}})


COMMANDS = (drift, sidechannel, held)
