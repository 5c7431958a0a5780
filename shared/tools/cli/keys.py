"""`droidmesh keys`: make the gateway's API keys (shared/auth/keys.py) and list what a key file holds."""

from __future__ import annotations

import click

FILE_HELP = "The gateway's key file (its api_keys setting, DM_GATEWAY_API_KEYS); made owner-only if new."


def _name_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from droidmesh.shared.auth.keys import ANY_MODEL, NAME

    models = tuple(m.strip() for m in value.split(",") if m.strip())
    bad = [m for m in models if m != ANY_MODEL and not NAME.fullmatch(m)]
    if not models or bad:
        raise click.BadParameter(f"a comma-separated list of model ids or \"*\" expected (bad: {bad})", ctx, param)
    return models


def _tenant(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from droidmesh.shared.auth.keys import NAME

    if not NAME.fullmatch(value):
        raise click.BadParameter(f"must match {NAME.pattern}", ctx, param)
    return value


@click.group()
def keys() -> None:
    """API keys of the OpenAI gateway: each with a tenant, its models and its quotas."""


@keys.command("add")
@click.option("--file", "path", required=True, type=click.Path(dir_okay=False), help=FILE_HELP)
@click.option("--tenant", required=True, callback=_tenant, help="Who the key belongs to; its cache scope.")
@click.option("--models", required=True, callback=_name_list, help="Model ids it may use, comma-separated (\"*\": all).")
@click.option("--rpm", default=60, show_default=True, type=click.IntRange(1, 10**9), help="Requests per minute.")
@click.option("--tpm", default=100_000, show_default=True, type=click.IntRange(1, 10**9),
              help="Tokens per minute (prompt + completion).")
@click.option("--concurrency", default=8, show_default=True, type=click.IntRange(1, 10**9),
              help="Requests in flight at once.")
def add(path: str, tenant: str, models: tuple[str, ...], rpm: int, tpm: int, concurrency: int) -> None:
    """Make a key: print it once (it is not stored, only its hash) and add its entry to the file.
    A running gateway reads the file when it starts."""
    from droidmesh.shared.auth import keys as api_keys

    key, kid = api_keys.make_key()
    api_keys.append(path, api_keys.ApiKey(id=kid, digest=api_keys.digest(key), tenant=tenant, models=models,
                                          requests_per_minute=rpm, tokens_per_minute=tpm, max_concurrent=concurrency))
    click.echo(key)
    click.echo(f"keys: added {kid} for tenant {tenant} to {path}; the key above is shown only now", err=True)


@keys.command("list")
@click.option("--file", "path", required=True, type=click.Path(exists=True, dir_okay=False), help=FILE_HELP)
def list_keys(path: str) -> None:
    """The file's keys: id, tenant, models, quotas and the tenant's cache scope (for `prefill
    --scope`; never a key or its hash)."""
    from droidmesh.shared.auth import keys as api_keys

    for k in api_keys.load(path).values():
        click.echo(f"{k.id}  tenant={k.tenant}  models={','.join(k.models)}  rpm={k.requests_per_minute}  "
                   f"tpm={k.tokens_per_minute}  concurrency={k.max_concurrent}  scope={k.scope}")
