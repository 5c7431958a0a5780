"""Who may have a pull grant: the reader a grant request's reply inbox names, checked against the
receiver models that may read this sender's model.

A grant is one pull of a context's KV/E, and those tensors carry what was prefilled, so a sender
grants only to the receivers of a model that may reuse its own:
  - its own model;
  - every receiver model a pair config on the board names with it (only the profiler and
    operators write the board);
  - the sender's `readers` setting: receivers that reuse it without a config (a default group, a
    translator, explicit modes), or '*' for any.

Who asks: under NATS auth (the roster `shared.mesh.nats_auth` renders) every user may subscribe
only under its own inbox prefix (`subjects.inbox_prefix`), so the subject a grant is sent to names
who can read it: `_INBOX_receiver-<model>.…` the receivers of <model>, `_INBOX_admin.…` the
operators. An asker may name another user's inbox, but the grant then goes where it cannot read it.
Any other reply subject is refused under auth (receivers may subscribe to some shared subjects,
`$SRV.>` among them). Without auth (the sender has no NATS user) every inbox is readable by every
client, so an unnamed asker is granted as before: the check then binds nobody.

The identity lives in the reply subject, which the `Bus` interface does not pass to a handler:
`serve` subscribes on the NATS connection itself (the in-process bus has no inboxes; every ask
there is unnamed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import structlog

from droidmesh.shared.errors import UnauthorizedError
from droidmesh.shared.mesh.bus import Bus, NatsBus, RequestHandler
from droidmesh.shared.mesh.nats_auth import receiver_user
from droidmesh.shared.wire.subjects import inbox_prefix, model_token

log = structlog.get_logger("sender")

ANY = "*"  # a `readers` entry: every receiver model
QUEUE = "grants"  # copies of one sender id share its grant requests
RECEIVER_INBOX = inbox_prefix(receiver_user(""))  # `_INBOX_receiver-`, then the model's token
OPERATOR_INBOX = inbox_prefix("admin")

EndpointFor = Callable[[str], RequestHandler]  # a request's reply subject -> the endpoint that answers it


@dataclasses.dataclass
class Readers:
    """The receiver models that may read `own`'s contexts, compared as subject tokens (the form an
    inbox carries). Touched on the event loop only."""

    own: str
    configured: tuple[str, ...] = ()
    paired: set[str] = dataclasses.field(default_factory=set)

    def pair(self, receiver_model: str) -> bool:
        """A pair config names `receiver_model` with this sender's model; True when it is new."""
        token = model_token(receiver_model)
        new = token not in self.paired
        self.paired.add(token)
        return new

    def allows(self, model: str) -> bool:
        if ANY in self.configured:
            return True
        token = model_token(model)
        return token == model_token(self.own) or token in self.paired or token in map(model_token, self.configured)


def check(readers: Readers, reply: str, authenticated: bool) -> None:
    """Raise `UnauthorizedError` unless whoever can read `reply` may read this sender's contexts."""
    head = reply.partition(".")[0]
    if head == OPERATOR_INBOX:
        return
    if head.startswith(RECEIVER_INBOX):
        model = head[len(RECEIVER_INBOX):]
        if not readers.allows(model):
            raise UnauthorizedError(f"the receivers of {model} may not read {readers.own}'s contexts: no pair config "
                                    f"names them with {readers.own} and the sender's readers do not list them")
        return
    if authenticated:
        raise UnauthorizedError("a pull grant goes only to a receiver's own inbox")


async def serve(bus: Bus, subject: str, endpoint_for: EndpointFor) -> None:
    """Answer the requests on `subject` in queue group `QUEUE`, each by `endpoint_for(its reply subject)`."""
    if not isinstance(bus, NatsBus):
        await bus.serve(subject, endpoint_for(""), queue=QUEUE)
        return

    async def on_request(msg: Any) -> None:
        if not msg.reply:  # a publish, not a request: nobody to answer
            return
        data = await endpoint_for(msg.reply)(msg.data)  # never raises: wrapped by `rpc`
        try:
            await msg.respond(data)
        except Exception as e:  # connection lost meanwhile: the asker's request times out
            log.warning("reply_failed", subject=subject, error=repr(e))

    # a subscription's callbacks run one at a time: a grant is a dictionary lookup and an HMAC
    await bus.nc.subscribe(subject, queue=QUEUE, cb=on_request)
