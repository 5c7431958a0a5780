"""`droidmesh config {publish,show,delete,relay-policy}`: the pair configs in the JetStream bucket receivers watch.

`publish FILE` takes either a profile JSON as `droidmesh profile --json` writes it (bound to the
weights of --sender / --receiver, by default the models the profile names) or a RecomputeConfig
as JSON; either is validated in full (`config_board.validate`, through
`shared/tools/apps/serve_config.load_config`) before anything connects.
`relay-policy FILE` republishes the newest config of each pair with the relay audit's verdicts.
`delete` withdraws a pair's configs: running receivers and senders drop them within seconds.
NATS roles: publishing and deleting write the bucket (`profiler` or `admin`); showing reads it
(`admin`, `profiler`, and the `sender-<id>` / `receiver-<model>` service users).
"""

from __future__ import annotations

import time
from typing import Any

import click
import msgspec

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.profiling import evidence
from droidmesh.shared.tools.apps.serve_config import load_config, maps_files, read_json
from droidmesh.shared.tools.cli.connect import Conn, nats_options
from droidmesh.shared.tools.cli.model_options import MODEL_HELP
from droidmesh.shared.wire import schemas, subjects


@click.group()
def config() -> None:
    """Recompute configs: publish one to the bucket running receivers and senders watch, or show them."""


@config.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--sender", default=None, help=f"Sender of a profile JSON: {MODEL_HELP} (default: the one it names).")
@click.option("--receiver", default=None, help=f"Receiver of a profile JSON: {MODEL_HELP} (default: the one it names).")
@click.option("--version", type=click.IntRange(0), default=None,
              help="profile_version to publish under (default: a profile's is the current time, a config's its own).")
@click.option("--dry-run", is_flag=True, help="Validate and print the config; do not connect.")
@click.option("--force", is_flag=True, help="Publish even a config whose chosen plan fails the test split's rule.")
@nats_options(default_timeout=10.0)
def publish(file: str, sender: str | None, receiver: str | None, version: int | None, dry_run: bool, force: bool,
            conn: Conn) -> None:
    """Validate FILE and publish it to the config bucket (NATS role: profiler or admin), with the
    SCD maps files its lowrank plans name (read from maps/<sha256>.safetensors next to FILE).
    A config whose chosen plan fails the tolerance rule on the profile's test split is refused
    (also with --dry-run) unless --force: receivers would serve a plan the held-out rows reject."""
    cfg = load_config(file, sender, receiver, version)
    if not force:
        evidence.check_publishable(cfg, file, "publish anyway with --force")
    maps = maps_files(file, cfg)
    key = f"{subjects.config_key(cfg.sender_model, cfg.receiver_model)}.v{cfg.profile_version}"
    if dry_run:
        click.echo(msgspec.json.format(msgspec.json.encode(cfg), indent=2).decode())
        return

    async def body(nc: Any) -> None:
        from droidmesh.shared.mesh.config_board import NatsConfigBoard
        from droidmesh.shared.mesh.maps_store import NatsMapsStore

        store = NatsMapsStore(nc)
        for data in maps.values():  # first: a service that sees the config can fetch its maps at once
            await store.put(data)
        await NatsConfigBoard(nc).put(cfg)

    conn.run(body, "publishing the config")
    if maps:
        click.echo(f"published {len(maps)} SCD maps file(s) to {subjects.MAPS_BUCKET}")
    click.echo(f"published {key} to {subjects.CONFIG_BUCKET}: {cfg.chosen.plan.groups or 'full reuse'} "
               f"({cfg.chosen.recomputed_layers} of {cfg.total_layers} layers recomputed)")


def _plan(p: schemas.FrontierPoint) -> str:
    return " ".join(f"[{s},{e})" for s, e in p.plan.groups) or "full reuse"


def _q(q: float | None) -> str:
    return "-" if q is None else f"{q:.3f}"


def _test_line(c: schemas.RecomputeConfig) -> str:
    return evidence.test_line(c.passes_test, c.test_verdict, c.test_interval, c.test_rows, c.tolerance)


def _quality(c: schemas.RecomputeConfig) -> str:
    """Train and test quality side by side: the choice was made on train, the test split checks it."""
    return (f"quality train {c.chosen.quality:.3f} test {_q(c.chosen_quality_test)} vs full prefill "
            f"train {c.full_prefill_quality:.3f} test {_q(c.full_prefill_quality_test)}"
            + (f", {_test_line(c)}" if c.test_verdict is not None else ", FAILS on test" if c.passes_test is False else ""))


@config.command()
@click.option("--sender", default=None, help="Only configs of this sender model id.")
@click.option("--receiver", default=None, help="Only configs of this receiver model id.")
@click.option("--json", "as_json", is_flag=True, help="Print the configs as JSON (newest version per pair).")
@nats_options(default_timeout=10.0)
def show(sender: str | None, receiver: str | None, as_json: bool, conn: Conn) -> None:
    """List the pair configs in the bucket (newest version per pair; every version with --sender and --receiver)."""
    from droidmesh.shared.mesh.config_board import NatsConfigBoard

    async def body(nc: Any) -> dict[str, schemas.RecomputeConfig | str] | None:
        return await NatsConfigBoard(nc).snapshot()

    found = conn.run(body, "reading the config bucket")
    if found is None:
        raise BadRequestError(f"no config was ever published (bucket {subjects.CONFIG_BUCKET} does not exist)")
    configs = [c for c in found.values() if isinstance(c, schemas.RecomputeConfig)
               and sender in (None, c.sender_model) and receiver in (None, c.receiver_model)]
    for key, why in sorted(found.items()):
        if isinstance(why, str):
            click.echo(f"skipping {key}: {why}", err=True)
    if not (sender and receiver):  # an overview: the newest version of each pair
        newest: dict[tuple[str, str], schemas.RecomputeConfig] = {}
        for c in configs:
            pair = (c.sender_model, c.receiver_model)
            if pair not in newest or c.profile_version > newest[pair].profile_version:
                newest[pair] = c
        configs = list(newest.values())
    configs.sort(key=lambda c: (c.sender_model, c.receiver_model, c.profile_version))
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(configs), indent=2).decode())
        return
    if not configs:
        click.echo("no matching config")
    for c in configs:
        click.echo(f"{subjects.config_key(c.sender_model, c.receiver_model)}.v{c.profile_version}  task {c.task}  "
                   f"chosen {_plan(c.chosen)} ({c.chosen.recomputed_layers}/{c.total_layers} layers, {_quality(c)})  "
                   f"frontier {len(c.frontier)} points  sha256 {c.sender_sha256[:8]}->{c.receiver_sha256[:8]}")


@config.command()
@click.option("--sender", required=True, help="Sender model id of the pair.")
@click.option("--receiver", required=True, help="Receiver model id of the pair.")
@click.option("--version", type=click.IntRange(0), default=None,
              help="Only this profile_version (default: every version of the pair).")
@nats_options(default_timeout=10.0)
def delete(sender: str, receiver: str, version: int | None, conn: Conn) -> None:
    """Withdraw a pair's configs from the bucket (NATS role: profiler or admin). Running receivers
    drop the plan within seconds and use the newest version left, else their default (default
    group or full prefill); the sender refuses the receivers' next pull grants unless its
    `readers` setting lists them."""
    from droidmesh.shared.mesh.config_board import NatsConfigBoard

    async def body(nc: Any) -> list[str]:
        return await NatsConfigBoard(nc).delete(sender, receiver, version)

    keys = conn.run(body, "withdrawing the config")
    if not keys:
        which = "" if version is None else f" version {version}"
        raise BadRequestError(f"no config of {sender} -> {receiver}{which} in {subjects.CONFIG_BUCKET}")
    click.echo(f"withdrew {', '.join(keys)} from {subjects.CONFIG_BUCKET}")


@config.command("relay-policy")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--sender", default=None, help="Only configs of this sender model id.")
@click.option("--receiver", default=None, help="Only configs of this receiver model id.")
@click.option("--dry-run", is_flag=True, help="Print what would be published; do not write the bucket.")
@nats_options(default_timeout=10.0)
def relay_policy(file: str, sender: str | None, receiver: str | None, dry_run: bool, conn: Conn) -> None:
    """Apply the relay audit's policy FILE (`droidmesh audit --policy`) to the newest config of each
    pair: republished under a new version, running receivers load it without a restart and stop
    relaying where the audit found relaying slower (NATS role: profiler or admin)."""
    from droidmesh.shared.audit.relay import relay_buckets, with_relay
    from droidmesh.shared.mesh.config_board import NatsConfigBoard, validate

    buckets = relay_buckets(read_json(file), file)

    async def body(nc: Any) -> list[schemas.RecomputeConfig]:
        board = NatsConfigBoard(nc)
        found = await board.snapshot()
        newest: dict[tuple[str, str], schemas.RecomputeConfig] = {}
        for c in (found or {}).values():
            if isinstance(c, schemas.RecomputeConfig) and sender in (None, c.sender_model) \
                    and receiver in (None, c.receiver_model):
                pair = (c.sender_model, c.receiver_model)
                if pair not in newest or c.profile_version > newest[pair].profile_version:
                    newest[pair] = c
        updated = [validate(with_relay(c, buckets, max(c.profile_version + 1, int(time.time()))))
                   for c in newest.values()]
        if not dry_run:
            for c in updated:
                await board.put(c)
        return updated

    updated = conn.run(body, "applying the relay policy")
    if not updated:
        raise BadRequestError("no matching config in the bucket to apply the policy to")
    for c in updated:
        verdicts = ", ".join(f"[{b.lo:g},{b.hi:g}) {'-' if b.relay is None else 'relay' if b.relay else 'own prefill'}"
                             for b in c.relay)
        click.echo(f"{'would publish' if dry_run else 'published'} "
                   f"{subjects.config_key(c.sender_model, c.receiver_model)}.v{c.profile_version}: {verdicts}")
