"""Who asked: the NATS user behind a request, read from the request's reply subject.

Each user connects with the inbox prefix `_INBOX_<user>` and may subscribe only under it (the
roster's permissions, `nats_auth.py`), so a reply subject under `_INBOX_<user>.` names the one user
that can read the answer. A request naming another user's inbox is answered to that user, never
to whoever sent it: claiming someone else's identity this way yields nothing to read. On a server
without users (nats-py's default prefix `_INBOX.`) nobody has an identity: the caller is "".

`NatsBus.serve` sets `CALLER` for each request's handler (a context variable: one per request
task); the in-process bus leaves it "" unless a test sets it. `request_scope` binds the scope a
request names to the user that sent it.
"""

from __future__ import annotations

from contextvars import ContextVar

from droidmesh.shared.errors import BadRequestError
from droidmesh.shared.mesh.nats_auth import tenant_user
from droidmesh.shared.wire.hashing import CALLER_SCOPE_PREFIX, PUBLIC, caller_scope
from droidmesh.shared.wire.subjects import INBOX_PREFIX, model_token

# Users that may name any scope: the gateway sets each tenant's from its API key; operators.
TRUSTED_ASKERS = frozenset({"gateway", "admin"})
TENANT_SCOPE_PREFIX = "tenant:"

CALLER: ContextVar[str] = ContextVar("droidmesh_caller", default="")


def user_of(reply: str | None) -> str:
    """The user whose inbox `reply` is under ("" for the default prefix, none, or a malformed one)."""
    head = f"{INBOX_PREFIX}_"
    if not reply or not reply.startswith(head):
        return ""
    user, dot, _ = reply[len(head):].partition(".")
    return user if dot and user else ""


def request_scope(named: str, user: str, public_holding: bool) -> str:
    """The scope a request reads and is held in, bound to its caller `user`:
      - none named (`public`, the default): the caller's own (`caller_scope`), so what it causes
        to be held is reused by that user alone; `public` only where the operator set
        `public_holding`;
      - the caller's own, or a tenant's from that tenant's client user (`client-<tenant>`): as named;
      - anything else only from the gateway or an operator (`TRUSTED_ASKERS`), or on a server
        without users, where nobody can be told apart (`user` ""); otherwise `BadRequestError`."""
    if named == PUBLIC:
        return PUBLIC if public_holding else caller_scope(user)
    if named == caller_scope(user) or (user and user in TRUSTED_ASKERS):
        return named
    if named.startswith(CALLER_SCOPE_PREFIX):
        raise BadRequestError(f"scopes starting {CALLER_SCOPE_PREFIX!r} are each NATS user's own; "
                              "a request may name only its caller's")
    tenant = named.removeprefix(TENANT_SCOPE_PREFIX).partition(".")[0] if named.startswith(TENANT_SCOPE_PREFIX) else None
    if not user or (tenant and user == model_token(tenant_user(tenant))):
        return named
    raise BadRequestError(f"NATS user {user} may name no scope but its own (send none) or its tenant's")
