"""`droidmesh serve BASE [--adapter NAME=MODEL ...]`: one command, a local mesh serving a base and its adapters.

The command checks its arguments (`shared.tools.apps.serve.plan_models`: every adapter is an adapter
of BASE, ids are unique) and the gateway's address (loopback, or API keys through
DM_GATEWAY_API_KEYS; a port that is free) before anything starts, gathers the pair configs to
publish (the zoo tier's saved profiles of pairs among the served models, plus `--profile` files,
each bound to the served models by the sha256 of their weights), then runs the mesh in the
foreground (`shared.tools.apps.serve.run`): progress on stderr, where to send requests on stdout
ending in a `ready:` line, and `stopped` after Ctrl-C.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import click

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.profiling import evidence
from droidmesh.shared.tools.cli.model_options import MODEL_HELP, device_options

if TYPE_CHECKING:  # the app imports torch: loaded when the command runs, not when the CLI starts
    from droidmesh.shared.tools.apps.serve import Published, Ready, ServePlan


def _say(line: str) -> None:
    click.echo(line, err=True)


def _transport(_ctx: click.Context, param: click.Parameter, value: str) -> str:
    from droidmesh.shared.transport.bulk import TRANSPORTS

    usable = [t for t in TRANSPORTS if t != "inproc"]  # inproc: one process, tests only
    if value not in usable:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(usable)}", param=param)
    return value


def check_address(host: str, port: int) -> None:
    """The gateway's config check (loopback without API keys), then whether the port is free."""
    from droidmesh.services.gateway.config import GatewayConfig

    try:
        GatewayConfig(http_host=host, http_port=port, api_keys=os.environ.get("DM_GATEWAY_API_KEYS", ""))
    except DroidMeshError as e:
        raise click.UsageError(f"--host {host} --port {port}: {e}") from None
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise click.UsageError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port "
                                   "(0: any free one)") from None


def gather_configs(plan: ServePlan, profiles: tuple[str, ...]) -> list[Published]:
    """The configs to publish: `--profile` files (an error if one does not fit the served models or
    fails its test split), then the zoo's saved profiles of the other served pairs (skipped, with
    a line, where one fails its test split or was profiled on other weights)."""
    from droidmesh.shared.tools.apps.serve_config import Published, bind, load_config, maps_files, renamed, zoo_profiles

    out: dict[str, Published] = {}
    for f in profiles:
        cfg = load_config(f)
        bound = bind(cfg, plan)
        if bound is None:
            raise click.UsageError(f"--profile {f}: its pair {cfg.sender_model} -> {cfg.receiver_model} is not two of "
                                   f"the models served here ({', '.join(plan.ids)}; matched by the weights' sha256)")
        failure = evidence.unpublishable(cfg)
        if failure is not None:
            raise click.UsageError(f"--profile {f}: {failure}; publish it yourself with `droidmesh config publish "
                                   "--force` if you mean it")
        p = Published(bound, maps_files(f, cfg))
        out.setdefault(p.pair, p)
    for s, r, saved in zoo_profiles(plan):
        pair = f"{s.id}-to-{r.id}"
        if pair in out:
            continue
        try:
            cfg = load_config(str(saved), sender=s.ref.label, receiver=r.ref.label)
            maps = maps_files(str(saved), cfg)
        except DroidMeshError as e:
            _say(f"not publishing {pair}: {e}")
            continue
        failure = evidence.unpublishable(cfg)
        if failure is not None:
            _say(f"not publishing {pair} ({saved}): {failure}")
            continue
        out[pair] = Published(renamed(cfg, s.id, r.id), maps)
    return list(out.values())


@click.command()
@click.argument("base")
@click.option("--adapter", "adapters", multiple=True, metavar="[NAME=]MODEL",
              help=f"An adapter of BASE to serve too, under NAME (default: its model name); MODEL is {MODEL_HELP}. "
                   "Repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the OpenAI API listens on (loopback only unless DM_GATEWAY_API_KEYS names a key file).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="API port (0: any free port, printed).")
@click.option("--transport", default="shm", show_default=True, callback=_transport,
              help="Bulk channel for pulls between processes (shm: one host; ucx, nixl).")
@click.option("--profile", "profiles", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A pair profile (`droidmesh profile --json`) or RecomputeConfig to publish, for two served "
                   "models. Repeatable; the zoo tier's saved profiles of served pairs are published anyway.")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), default=None,
              help="Keep every process's log here (default: a new temporary directory, printed).")
@device_options
def serve(base: str, adapters: tuple[str, ...], host: str, port: int, transport: str, profiles: tuple[str, ...],
          log_dir: str | None, device: str, dtype: str | None) -> None:
    """Serve BASE and its adapters through an OpenAI-compatible API, reusing KV across them.

    Starts, in the foreground: nats-server, a broker, one receiver process holding BASE's weights
    once and serving every adapter from them (what it prefills is held and reused by the next
    request over the same document, by the same model or a paired one), and the gateway. The
    pair configs found among the served models are published first. Ctrl-C stops everything.

    \b
    droidmesh serve real/base --adapter real/docqa --adapter real/summ
    droidmesh serve ./my-base --adapter qa=./my-lora --port 8080"""
    from droidmesh.shared.tools.apps.serve import Options, instructions, plan_models, ready_line, run

    try:
        plan = plan_models(base, adapters)
    except DroidMeshError as e:
        raise click.UsageError(str(e)) from None
    check_address(host, port)
    published = gather_configs(plan, profiles)

    def ready(r: Ready) -> None:
        for line in instructions(r, plan):
            click.echo(line)
        click.echo(ready_line(r))

    run(plan, published, Options(host=host, port=port, device=device, dtype=dtype, transport=transport),
        Path(log_dir) if log_dir else None, _say, ready)
