"""Commands that use a running mesh as a client: `ask`, `prefill`, `receivers`.

Each connects with the shared options (`shared/tools/cli/connect.py`); all NATS work, connecting
included, ends within `--timeout`. NATS roles (infra/nats/nats-auth.conf): `client` may ask
receivers and senders; prefill requests (`dm.sender.*.prefill`) and micro discovery
(`$SRV.INFO`, used by `receivers` and by `ask` without `--receiver`) are for `admin` only.
"""

from __future__ import annotations

from typing import Any

import click

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.tools.cli.connect import Conn, nats_options
from droidmesh.shared.tools.cli.params import read_text
from droidmesh.shared.wire import schemas

WINDOW_HELP = "Seconds to collect discovery answers (part of --timeout)."


async def _receivers(nc: Any, window_s: float) -> list:
    from droidmesh.shared.mesh.discovery import receivers

    return await receivers(nc, window_s)


DISCOVERY_ROUNDS = 3  # a receiver whose loop is busy a moment (a cache just announced) can miss one window


async def _only_receiver(nc: Any, window_s: float) -> str:
    """The one receiver model that is up; none or several is a one-line error."""
    up: list = []
    for _ in range(DISCOVERY_ROUNDS):
        up = await _receivers(nc, window_s)
        if up:
            break
    if not up:
        raise BadRequestError(f"no receiver answered discovery ({DISCOVERY_ROUNDS} x {window_s:g}s); "
                              "start one, or name it with --receiver")
    if len(up) > 1:
        raise BadRequestError(f"{len(up)} receiver models are up ({', '.join(r.model_id for r in up)}); "
                              "choose one with --receiver")
    return str(up[0].model_id)


def document_chat(document: str, system: str | None = None, question: str | None = None) -> list[schemas.ChatMessage]:
    """A document as a chat's first user turn, as an OpenAI client sends it through the gateway:
    after `system` when given (else the chat template writes its default system turn), and the
    question, if any, as the next user turn. `prefill --as-chat` caches the prefix of this chat's
    tokens that every such chat shares; `ask --as-chat` asks it."""
    chat = [schemas.ChatMessage("system", system)] if system is not None else []
    chat.append(schemas.ChatMessage("user", document))
    if question is not None:
        chat.append(schemas.ChatMessage("user", question))
    return chat


def _chat_options(as_chat: bool, system: str | None) -> None:
    if system is not None and not as_chat:
        raise click.UsageError("--system needs --as-chat (a plain context has no system turn)")


def _scope(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from droidmesh.shared.wire.hashing import check_scope

    try:
        return check_scope(value)
    except BadRequestError as e:
        raise click.BadParameter(str(e), ctx, param) from None


AS_CHAT_HELP = ("Send the context as a chat's first user turn, rendered by the model's chat template (its default "
                "system turn included), as chat requests through the gateway arrive.")
SYSTEM_HELP = "With --as-chat: this system message instead of the chat template's default one."


def _client(nc: Any) -> Any:
    from droidmesh.shared import __version__
    from droidmesh.shared.mesh.bus import NatsBus
    from droidmesh.shared.mesh.client import MeshClient

    return MeshClient(NatsBus(nc, "droidmesh-client", __version__))


@click.command()
@click.option("--context", "context_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="File holding the shared context (UTF-8 text).")
@click.option("--question", required=True, help="The question to ask over it.")
@click.option("--receiver", default=None, help="Receiver model id (default: the one receiver model that is up).")
@click.option("--mode", type=click.Choice(schemas.MODES), default="auto", show_default=True)
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1, 4096))
@click.option("--window", default=0.5, show_default=True, type=click.FloatRange(0.05, 30), help=WINDOW_HELP)
@click.option("--as-chat", is_flag=True, help=AS_CHAT_HELP + " The question is the next user turn.")
@click.option("--system", default=None, help=SYSTEM_HELP)
@click.option("--scope", default="public", show_default=True, callback=_scope,
              help="Whose cached contexts the question may reuse: this scope's (a cache salt of yours) and public ones.")
@nats_options(default_timeout=60.0)
def ask(context_file: str, question: str, receiver: str | None, mode: schemas.Mode, max_new_tokens: int,
        window: float, as_chat: bool, system: str | None, scope: str, conn: Conn) -> None:
    """Ask a receiver a question over a context; print the answer, the path taken and its timings.

    NATS role: `client` (with --receiver) or `admin` (discovery needs $SRV.INFO)."""
    _chat_options(as_chat, system)
    context = read_text(context_file)
    if not question.strip():
        raise BadRequestError("--question is empty")
    chat = document_chat(context, system, question) if as_chat else None

    async def body(nc: Any) -> schemas.GenerateReply:
        model = receiver or await _only_receiver(nc, window)
        # The request's own deadline is what is left of --timeout once connected (Conn enforces it).
        # A chat carries all its text in `chat`, as the gateway's chat requests do.
        return await _client(nc).ask(model, "" if chat else context, "" if chat else question, chat=chat,
                                     max_new_tokens=max_new_tokens, mode=mode, timeout=conn.timeout, scope=scope)

    reply = conn.run(body, "asking")
    click.echo(reply.text)
    click.echo("")
    reason = f" ({reply.fallback_reason})" if reply.fallback_reason else ""
    click.echo(f"path: {reply.path}{reason}   plan: {reply.plan}   served by: {reply.served_by}")
    click.echo(f"ttft: {reply.ttft_ms:.1f} ms   bytes pulled: {reply.bytes_pulled:,}"
               + (f" from {reply.sender_id}" if reply.sender_id else ""))
    for stage, ms in reply.stages_ms.items():
        click.echo(f"  {stage:<22} {ms:9.2f} ms")


@click.command()
@click.option("--sender", required=True, help="Sender model id (the id the sender serves under, e.g. base).")
@click.option("--context", "context_file", required=True, type=click.Path(exists=True, dir_okay=False),
              help="File holding the context to prefill (UTF-8 text).")
@click.option("--as-chat", is_flag=True, help=AS_CHAT_HELP + " Chats whose first user message is the context "
              "then reuse the cache; a plain prefill serves completions and plain `ask`.")
@click.option("--system", default=None, help=SYSTEM_HELP)
@click.option("--scope", default="public", show_default=True, callback=_scope,
              help="Who may reuse the cache: public (every request), tenant:T (gateway keys of tenant T) or another "
                   "scope (clients asking with it).")
@nats_options(default_timeout=60.0)
def prefill(sender: str, context_file: str, as_chat: bool, system: str | None, scope: str, conn: Conn) -> None:
    """Have SENDER prefill a context and announce its KV cache to the mesh, for requests of --scope.

    NATS role: `admin` only (infra/nats/nats-auth.conf lets no other user publish to
    dm.sender.*.prefill; a `client` login times out with a permissions violation)."""
    _chat_options(as_chat, system)
    context = read_text(context_file)
    chat = document_chat(context, system) if as_chat else None

    async def body(nc: Any) -> schemas.PrefillReply:
        return await _client(nc).prefill(sender, "" if chat else context, chat=chat, timeout=conn.timeout, scope=scope)

    reply = conn.run(body, "prefilling")
    if chat and reply.tokens <= 1:  # a sender older than PrefillRequest.chat cached its start token alone
        raise BadRequestError(f"sender {sender} ignored --as-chat (it predates chat prefills); upgrade it")
    click.echo(f"context_id: {reply.context_id}")
    click.echo(f"tokens: {reply.tokens}")
    click.echo(f"bytes: {reply.nbytes:,}")


@click.command()
@click.option("--window", default=0.5, show_default=True, type=click.FloatRange(0.05, 30), help=WINDOW_HELP)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@nats_options(default_timeout=10.0)
def receivers(window: float, as_json: bool, conn: Conn) -> None:
    """List the receiver models that are up (NATS micro discovery), with their instances.

    NATS role: `admin` (discovery publishes to $SRV.INFO)."""
    import json

    up = conn.run(lambda nc: _receivers(nc, window), "discovering receivers")
    if as_json:
        click.echo(json.dumps([{"model_id": r.model_id, "instances": list(r.instances), "version": r.version}
                               for r in up], indent=2))
        return
    if not up:
        click.echo("no receiver is up")
    for r in up:
        click.echo(f"{r.model_id:20s} {len(r.instances)} instance(s)  version {r.version}  {' '.join(r.instances)}")
