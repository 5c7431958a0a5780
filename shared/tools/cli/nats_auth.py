"""`droidmesh nats-auth`: write nats-server's users and permissions for a roster (shared/mesh/nats_auth.py)."""

from __future__ import annotations

from pathlib import Path

import click


def _sender(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for v in values:
        sender_id, eq, model_id = v.partition("=")
        if not (eq and sender_id and model_id):
            raise click.BadParameter(f"{v!r} is not ID=MODEL", ctx, param)
        pairs.append((sender_id, model_id))
    return tuple(pairs)


@click.command("nats-auth")
@click.option("--sender", "senders", multiple=True, metavar="ID=MODEL", callback=_sender,
              help="A sender's id (DM_SENDER_SENDER_ID) and the model it serves; user sender-ID. Repeatable.")
@click.option("--receiver", "receivers", multiple=True, metavar="MODEL",
              help="A model whose receivers log in as receiver-MODEL. Repeatable.")
@click.option("--holder", "holders", multiple=True, metavar="MODEL=ID", callback=_sender,
              help="Receivers of MODEL hold what they prefill under holder id ID (DM_RECEIVER_HOLDER_ID): they may "
                   "announce and grant under ID only. Repeatable: one ID per copy of a model's receiver; without it "
                   "receivers hold nothing.")
@click.option("--hosted", "hosted", multiple=True, metavar="MODEL=ADAPTER", callback=_sender,
              help="Receivers of MODEL also serve ADAPTER (DM_RECEIVER_ADAPTERS): they may join its queue group too. "
                   "Repeatable.")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME",
              help="A tenant of direct mesh clients: user client-NAME, which reads only its own reply inbox "
                   "(receivers may stream to it). Repeatable.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the conf here (default: stdout).")
def nats_auth(senders: tuple[tuple[str, str], ...], receivers: tuple[str, ...], holders: tuple[tuple[str, str], ...],
              hosted: tuple[tuple[str, str], ...], tenants: tuple[str, ...], out: str | None) -> None:
    """Render nats-auth.conf: each sender pinned to its own id, each model's receivers to its queue
    group, a client user per --tenant, plus the broker, profiler, client, gateway and admin users.
    Without --sender and --receiver: the shipped roster's services (infra/nats/nats-auth.conf)."""
    from droidmesh.shared.mesh.nats_auth import DEFAULT_ROSTER, Roster, render

    base = Roster(senders, receivers) if senders or receivers else DEFAULT_ROSTER
    try:
        adapters: dict[str, list[str]] = {}
        for model, adapter in hosted:
            adapters.setdefault(model, []).append(adapter)
        roster = Roster(base.senders, base.receivers, tuple(dict.fromkeys(tenants)),
                        hosted=tuple((m, tuple(a)) for m, a in adapters.items()),
                        holders=holders or (() if senders or receivers else base.holders))
    except ValueError as e:  # a name NATS users or env variables cannot carry, or a model no --receiver names
        raise click.BadParameter(str(e), param_hint="'--tenant' / '--holder' / '--hosted'") from None
    text = render(roster)
    if out:
        Path(out).write_text(text)
        click.echo(f"nats-auth: wrote {out}; give nats-server the DM_NATS_PASSWORD_* variables it names "
                   "(infra/secrets/generate.sh)", err=True)
    else:
        click.echo(text, nl=False)
