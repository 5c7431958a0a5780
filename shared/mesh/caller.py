"""Who asked: the NATS user behind a request, read from the request's reply subject.

Each user connects with the inbox prefix `_INBOX_<user>` and may subscribe only under it (the
roster's permissions, `nats_auth.py`), so a reply subject under `_INBOX_<user>.` names the one user
that can read the answer. A request naming another user's inbox is answered to that user, never
to whoever sent it: claiming someone else's identity this way yields nothing to read. On a server
without users (nats-py's default prefix `_INBOX.`) nobody has an identity: the caller is "".

`NatsBus.serve` sets `CALLER` for each request's handler (a context variable: one per request
task); the in-process bus leaves it "" unless a test sets it.
"""

from __future__ import annotations

from contextvars import ContextVar

from droidmesh.shared.wire.subjects import INBOX_PREFIX

CALLER: ContextVar[str] = ContextVar("droidmesh_caller", default="")


def user_of(reply: str | None) -> str:
    """The user whose inbox `reply` is under ("" for the default prefix, none, or a malformed one)."""
    head = f"{INBOX_PREFIX}_"
    if not reply or not reply.startswith(head):
        return ""
    user, dot, _ = reply[len(head):].partition(".")
    return user if dot and user else ""
