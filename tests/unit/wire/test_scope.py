"""Cache scopes: strict validation, seeded ids, and the broker finding only the asker's scope and public."""

from __future__ import annotations

import msgspec
import pytest

from droidmesh.services.cache_broker.index import CacheIndex, block_keys
from droidmesh.shared.errors import BadMessageError, BadRequestError
from droidmesh.shared.mesh.caller import request_scope, user_of
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateRequest
from droidmesh.shared.wire.hashing import PUBLIC, caller_scope, check_scope, context_id, tenant_scope
from tests.unit.services.test_index import _alive, _ev

BAD = ["", " ", "a b", "a/b", "a*", ".a", "-a", "a\n", "é", "a" * 129, "tenant:a\x00"]


@pytest.mark.parametrize("scope", BAD)
def test_malformed_scopes_are_refused_by_the_check_and_at_decode(scope):
    with pytest.raises(BadRequestError):
        check_scope(scope)
    for msg in (GenerateRequest(request_id="r", context="c", question="", scope=scope),
                schemas.PrefillRequest(request_id="r", context="c", scope=scope),
                schemas.LookupRequest(token_ids=[1], fingerprint_id="fp", scope=scope)):
        with pytest.raises(BadMessageError, match="scope"):
            schemas.decode(schemas.encode(msg), type(msg))


def test_a_scope_that_is_not_a_string_is_refused_at_decode():
    raw = msgspec.msgpack.encode({"type": "lookup.request", "v": schemas.SCHEMA_VERSION, "token_ids": [1],
                                  "fingerprint_id": "fp", "scope": 7})
    with pytest.raises(BadMessageError):
        schemas.decode(raw, schemas.LookupRequest)


def test_ids_and_block_keys_are_seeded_by_scope_and_public_is_unseeded():
    tokens = list(range(64))
    assert context_id(tokens) == context_id(tokens, PUBLIC)
    ids = {context_id(tokens, s) for s in (PUBLIC, tenant_scope("a"), tenant_scope("b"), "salt-1")}
    assert len(ids) == 4
    assert block_keys(tokens, scope=tenant_scope("a")) != block_keys(tokens) != block_keys(tokens, scope="salt-1")
    assert check_scope(tenant_scope("acme.eu-1")) == "tenant:acme.eu-1"
    assert schemas.decode(schemas.encode(schemas.LookupRequest(token_ids=[1], fingerprint_id="fp")),
                          schemas.LookupRequest).scope == PUBLIC  # a message without one is public


def _scoped(ix: CacheIndex, sender: str, cid: str, tokens: list[int], scope: str) -> None:
    ix.add(msgspec.structs.replace(_ev(sender, cid, tokens), scope=scope))
    _alive(ix, sender, [c for held in ix._holders.values() for c in held])


def test_a_lookup_finds_its_own_scope_and_public_never_another():
    tokens = list(range(96))
    a, b = tenant_scope("a"), tenant_scope("b")
    ix = CacheIndex()
    _scoped(ix, "s1", "ctx-a", tokens, a)
    assert ix.lookup(tokens, "fp", scope=a)[0].context_id == "ctx-a"  # type: ignore[union-attr]
    assert ix.lookup(tokens, "fp", scope=b) == (None, 0)
    assert ix.lookup(tokens, "fp") == (None, 0)  # an unscoped (public) request sees no tenant's context
    _scoped(ix, "s1", "ctx-pub", tokens[:64], PUBLIC)
    assert ix.lookup(tokens, "fp", scope=b)[0].context_id == "ctx-pub"  # type: ignore[union-attr]
    assert ix.lookup(tokens, "fp", scope=b)[1] == 64
    holder, n = ix.lookup(tokens, "fp", scope=a)
    assert holder is not None and holder.context_id == "ctx-a" and n == 96  # its own, longer, wins


def test_on_a_tie_the_askers_own_scope_wins_and_models_still_rank_first():
    tokens = list(range(64))
    a = tenant_scope("a")
    ix = CacheIndex()
    _scoped(ix, "s1", "pub", tokens, PUBLIC)
    _scoped(ix, "s2", "own", tokens, a)
    assert ix.lookup(tokens, "fp", scope=a)[0].context_id == "own"  # type: ignore[union-attr]
    ix.add(msgspec.structs.replace(_ev("s3", "pub-qa", tokens, model="qa"), scope=PUBLIC))
    _alive(ix, "s3", ["pub-qa"])
    assert ix.lookup(tokens, "fp", models=["qa"], scope=a)[0].context_id == "pub-qa"  # type: ignore[union-attr]


def test_a_request_naming_no_scope_is_its_callers_own_and_public_only_by_the_operator():
    """`public` (the default) becomes the caller's private scope unless the operator set public
    holding; a named scope stands; a caller scope may be named by that caller alone."""
    assert request_scope(PUBLIC, "client-a", public_holding=False) == "user:client-a"
    assert request_scope(PUBLIC, "", public_holding=False) == caller_scope("") == "user:anonymous"
    assert request_scope(PUBLIC, "client-a", public_holding=True) == PUBLIC
    assert request_scope(tenant_scope("t"), "gateway", public_holding=False) == tenant_scope("t")
    assert request_scope("user:client-a", "client-a", public_holding=False) == "user:client-a"
    with pytest.raises(BadRequestError, match="caller"):
        request_scope("user:client-a", "client-b", public_holding=True)


def test_a_named_scope_is_bound_to_the_users_allowed_it():
    """A tenant's scope from that tenant's client user or the gateway; a free-form scope from the
    gateway or an operator; neither from another user. Without users (anonymous) nothing binds."""
    secret = b"k" * 32
    for scope in (tenant_scope("acme"), tenant_scope("acme", secret)):
        assert request_scope(scope, "client-acme", public_holding=False) == scope
        assert request_scope(scope, "gateway", public_holding=False) == scope
        with pytest.raises(BadRequestError, match="its tenant"):
            request_scope(scope, "client-other", public_holding=False)
        with pytest.raises(BadRequestError):
            request_scope(scope, "client", public_holding=False)
    assert request_scope("my-salt", "admin", public_holding=False) == "my-salt"
    assert request_scope("my-salt", "", public_holding=False) == "my-salt"
    with pytest.raises(BadRequestError):
        request_scope("my-salt", "client-acme", public_holding=False)


@pytest.mark.parametrize(("reply", "user"), [
    ("_INBOX_client-a.abc.1", "client-a"), ("_INBOX_gateway.x", "gateway"),
    ("_INBOX.abc.1", ""), ("", ""), (None, ""), ("_INBOX_", ""), ("_INBOX_client-a", ""), ("other.subject", "")])
def test_the_caller_is_the_user_whose_inbox_the_reply_names(reply, user):
    assert user_of(reply) == user
