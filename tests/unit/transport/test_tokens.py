"""Pull grants: scoped to one context, unforgeable, expiring, single use."""

from __future__ import annotations

import pytest

from droidmesh.shared.errors import OverloadedError, UnauthorizedError
from droidmesh.shared.transport.tokens import TokenIssuer


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_valid_token_passes_until_expiry():
    """A fresh grant verifies for its context and fails once its expiry has passed."""
    clock = Clock()
    issuer = TokenIssuer(ttl_s=60, clock=clock)
    token, expires = issuer.issue("ctx")
    issuer.verify("ctx", token)
    assert expires == 1060
    token, _ = issuer.issue("ctx")
    clock.t = 1061
    with pytest.raises(UnauthorizedError, match="expired"):
        issuer.verify("ctx", token)


@pytest.mark.parametrize("token", ["", "garbage", "99999999999.deadbeef"])
def test_missing_or_forged_tokens_fail(token):
    """Missing, malformed and forged tokens are refused."""
    with pytest.raises(UnauthorizedError):
        TokenIssuer(ttl_s=60).verify("ctx", token)


def test_token_is_scoped_to_its_context_and_issuer():
    """A token for one context, or from another sender's key, grants nothing else."""
    a, b = TokenIssuer(ttl_s=60), TokenIssuer(ttl_s=60)
    token, _ = a.issue("ctx")
    with pytest.raises(UnauthorizedError, match="not valid for context other"):
        a.verify("other", token)
    with pytest.raises(UnauthorizedError):
        b.verify("ctx", token)


def test_a_grant_is_used_up_by_its_first_pull():
    """The second pull with one grant is refused; a fresh grant for the same context works."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    issuer.verify("ctx", token)
    with pytest.raises(UnauthorizedError, match="already used"):
        issuer.verify("ctx", token)
    issuer.verify("ctx", issuer.issue("ctx")[0])


def test_outstanding_grants_are_bounded_and_expired_ones_forgotten():
    """Past `max_outstanding` unused live grants, asking is refused as overload; once they have
    expired they are dropped and grants are issued again."""
    clock = Clock()
    issuer = TokenIssuer(ttl_s=10, clock=clock, max_outstanding=4)
    for _ in range(4):
        issuer.issue("ctx")
    with pytest.raises(OverloadedError):
        issuer.issue("ctx")
    clock.t += 11
    issuer.issue("ctx")
    assert len(issuer._live) == 1
