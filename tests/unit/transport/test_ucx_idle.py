"""An idle UCX connection waits for its peer's next request with pauses, not a busy loop
(`ops.wait_for_message`; a fake endpoint and a recorded `asyncio.sleep`, no UCX, no clock)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ucxx")

from droidmesh.shared.transport.ucx import ops  # noqa: E402


class FakeEndpoint:
    """Probes find a message after `arrives` probes; `fail_after` probes raise an endpoint error."""

    def __init__(self, arrives: int | None = None, fail_after: int | None = None) -> None:
        self.probes, self.arrives, self.fail_after, self.closed = 0, arrives, fail_after, False
        self._tags = {"msg_recv": 7}
        self._ctx = self
        self.worker = self
        self._ep = self

    def tag_probe(self, tag):
        self.probes += 1
        return type("Probe", (), {"matched": self.arrives is not None and self.probes >= self.arrives})()

    def raise_on_error(self):
        if self.fail_after is not None and self.probes >= self.fail_after:
            raise RuntimeError("endpoint error")


def run(ep: FakeEndpoint, monkeypatch) -> list[float]:
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(s):
        pauses.append(s)
        await real_sleep(0)

    monkeypatch.setattr(ops, "IDLE_SPIN_S", 0.0)  # straight to the pauses: nothing here is timed
    monkeypatch.setattr(ops.asyncio, "sleep", sleep)
    asyncio.run(ops.wait_for_message(ep))
    return pauses


def test_an_idle_wait_pauses_longer_and_longer_up_to_the_cap(monkeypatch):
    ep = FakeEndpoint(arrives=40)
    pauses = run(ep, monkeypatch)
    assert ep.probes == 40 and len(pauses) == 39
    assert all(p > 0 for p in pauses), "a busy loop (sleep(0)) after the spin"
    assert pauses == sorted(pauses) and max(pauses) == ops.IDLE_PAUSE_S and pauses[0] < ops.IDLE_PAUSE_S


def test_a_waiting_message_returns_at_once(monkeypatch):
    ep = FakeEndpoint(arrives=1)
    assert run(ep, monkeypatch) == [] and ep.probes == 1


def test_a_closed_or_failed_endpoint_ends_the_wait(monkeypatch):
    ep = FakeEndpoint()
    ep.closed = True
    assert run(ep, monkeypatch) == [] and ep.probes == 0
    ep = FakeEndpoint(fail_after=3)
    run(ep, monkeypatch)
    assert ep.probes == 3
