"""Who may have a pull grant: the reader a grant request's reply inbox names, checked against the
receiver models that may read this sender's model.

A grant is one pull of a context's KV/E, and those tensors carry what was prefilled, so a sender
grants only to the receivers of a model that may reuse its own:
  - its own model;
  - every receiver model a pair config on the board names with it (only the profiler and
    operators write the board), while one does: a pair whose configs are all withdrawn
    (`droidmesh config delete`) is unpaired at once (`unpair_withdrawn`);
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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import structlog

from droidmesh.shared.errors import UnauthorizedError
from droidmesh.shared.mesh.bus import Bus, NatsBus, RequestHandler
from droidmesh.shared.mesh.nats_auth import receiver_user
from droidmesh.shared.wire.subjects import inbox_prefix, model_token

if TYPE_CHECKING:  # the holder calls into this module: its type is only an annotation here
    from droidmesh.shared.holding.holder import Holder
    from droidmesh.shared.wire.schemas import RecomputeConfig

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

    def keep_paired(self, receiver_models: Iterable[str]) -> list[str]:
        """Only `receiver_models` stay paired (those the board's configs still name with this
        sender's model); returns the tokens of the pairs revoked."""
        keep = {model_token(m) for m in receiver_models}
        revoked = sorted(self.paired - keep)
        self.paired &= keep
        return revoked

    def allows(self, model: str) -> bool:
        if ANY in self.configured:
            return True
        token = model_token(model)
        return token == model_token(self.own) or token in self.paired or token in map(model_token, self.configured)


def unpair_withdrawn(holder: Holder, left: Iterable[RecomputeConfig]) -> None:
    """A pair config was withdrawn; `left` are the configs still on the board. Each held model
    keeps as readers only the receiver models `left` pairs it with (a withdrawn pair's receivers
    are refused their next grant), and the E layers of those configs' plans, read again from them
    newest last (`Holder.on_config`, which pairs nobody new here)."""
    left = list(left)
    for held in holder.models.values():
        mine = sorted((c for c in left if c.sender_model == held.model_id), key=lambda c: c.profile_version)
        for token in held.readers.keep_paired(c.receiver_model for c in mine):
            log.info("reader_unpaired", sender_model=held.model_id, receiver_model=token)
        held.profiled_e.clear()
        for c in mine:
            holder.on_config(c)


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
