"""Per-key quotas under a pinned clock: requests per minute, tokens per minute, requests at once."""

from __future__ import annotations

import pytest

from droidmesh.shared.auth.keys import ApiKey
from droidmesh.shared.auth.quota import Quotas
from droidmesh.shared.errors import QuotaExceededError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(rpm: int = 60, tpm: int = 1000, conc: int = 4) -> ApiKey:
    return ApiKey(id="0123456789ab", digest="sha256:" + "0" * 64, tenant="a", models=("*",), requests_per_minute=rpm,
                  tokens_per_minute=tpm, max_concurrent=conc)


def test_request_rate_refuses_past_the_minute_and_says_when():
    clock, k = Clock(), key(rpm=2)
    q = Quotas(clock)
    for _ in range(2):
        with q.admit(k):
            pass
    with pytest.raises(QuotaExceededError) as e, q.admit(k):
        pass
    assert e.value.retry_after_s == 30.0  # one request refills in 60 / 2 s
    clock.now += 30
    with q.admit(k):
        pass


def test_concurrency_cap_counts_requests_in_flight():
    q, k = Quotas(Clock()), key(conc=1)
    with q.admit(k):
        assert q.inflight(k) == 1
        with pytest.raises(QuotaExceededError) as e, q.admit(k):
            pass
        assert e.value.retry_after_s == 1.0
    assert q.inflight(k) == 0


def test_token_budget_reserves_then_charges_what_was_used():
    """max_tokens is reserved; the reply's prompt + completion replaces it and may overdraw the
    bucket, after which the key waits until it refills above zero."""
    clock, k = Clock(), key(tpm=60)
    q = Quotas(clock)
    with q.admit(k):
        q.reserve(k, 10)
        q.settle(k, 10, 90)  # a 80-token prompt: the bucket is at -30
    with pytest.raises(QuotaExceededError) as e, q.admit(k):
        pass
    assert e.value.retry_after_s == 31.0  # 60 tokens a minute: one a second, 31 to get back to 1
    clock.now += 31
    with q.admit(k):
        with pytest.raises(QuotaExceededError):
            q.reserve(k, 5)  # 1 token in the bucket
        clock.now += 4
        q.reserve(k, 5)


def test_a_request_larger_than_the_budget_and_a_refund():
    q, k = Quotas(Clock()), key(tpm=50)
    with pytest.raises(QuotaExceededError, match="exceeds") as e:
        q.reserve(k, 51)
    assert e.value.retry_after_s == 60.0
    q.reserve(k, 50)
    q.settle(k, 50, 0)  # a failed request gives its reservation back
    q.reserve(k, 50)


def test_a_clock_stepping_back_refills_nothing():
    clock, k = Clock(), key(rpm=1)
    q = Quotas(clock)
    with q.admit(k):
        pass
    clock.now -= 1000
    with pytest.raises(QuotaExceededError), q.admit(k):
        pass
    clock.now += 1060  # a minute after the first request: refilled, not drained by the step back
    with q.admit(k):
        pass
