"""`droidmesh ask`: one question to a receiver through the mesh, with the timing breakdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from droidmesh.shared.wire import schemas


@click.command()
@click.option("--context", "context_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="File holding the shared context (the document).")
@click.option("--question", required=True, help="The question to ask over it.")
@click.option("--receiver", default="receiver", show_default=True, help="Receiver model id.")
@click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", envvar="DM_NATS_URL", show_default=True)
@click.option("--mode", type=click.Choice(schemas.MODES), default="auto", show_default=True)
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(0.1, 3600))
def ask(context_file: str, question: str, receiver: str, nats_url: str, mode: schemas.Mode, max_new_tokens: int,
        timeout: float) -> None:
    """Ask RECEIVER a question over a context; print the answer, the path taken and its timings."""
    from droidmesh.shared.client import MeshClient, MeshError

    async def run() -> schemas.GenerateReply:
        client = await MeshClient.connect(nats_url, connect_timeout=5, max_reconnect_attempts=0)
        try:
            return await client.ask(receiver, Path(context_file).read_text(), question,
                                    max_new_tokens=max_new_tokens, mode=mode, timeout=timeout)
        finally:
            await client.close()

    try:
        reply = asyncio.run(run())
    except (MeshError, TimeoutError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(reply.text)
    click.echo("")
    reason = f" ({reply.fallback_reason})" if reply.fallback_reason else ""
    click.echo(f"path: {reply.path}{reason}   plan: {reply.plan}   served by: {reply.served_by}")
    click.echo(f"ttft: {reply.ttft_ms:.1f} ms   bytes pulled: {reply.bytes_pulled:,}"
               + (f" from {reply.sender_id}" if reply.sender_id else ""))
    for stage, ms in reply.stages_ms.items():
        click.echo(f"  {stage:<22} {ms:9.2f} ms")
