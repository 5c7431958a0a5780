"""One sender login flooding the cache broker with events each within every cap: a real nats-server
with per-role users and a real broker process; the honest sender, the flooding sender and the
receiver's lookups are plain NATS clients under their own logins (`shared/tools/bench/broker_flood.py`).
The flood is bounded in events and seconds; what is asserted is where the broker ends up, not how
fast it got there."""

from __future__ import annotations

import asyncio

import pytest

from droidmesh.shared.tools.bench.broker_flood import FLOOD, HONEST, Flood, run_against, secured_nats, start_broker

pytestmark = [pytest.mark.system, pytest.mark.security]

BUDGET = 16 << 20  # the flooding sender's index bytes: well under what its flood would hold
# ~300 MB of events of 2^18 token ids over 40 context ids: unbudgeted, ~13 MB of broker memory each
FLOOD_SPEC = Flood(seconds=120, events=300, rate=20, tokens=1 << 18, contexts=40)  # ~15 s at 20 a second
# as environment, so a broker without these settings still runs the flood (and fails what it must)
ENV = {"DM_CACHE_BROKER_MAX_SENDER_INDEX_BYTES": str(BUDGET), "DM_CACHE_BROKER_OVER_BUDGET_LOG_S": "5"}


def test_an_in_cap_flood_from_one_sender_neither_bloats_the_broker_nor_expires_the_honest_sender(tmp_path):
    """After the flood the honest sender was never expired and its context is found; the broker's
    index holds at most the flooder's byte budget (its oldest holders gave way), its memory grew by
    far less than the flood would hold, and the flooder's excess was counted and logged a few
    times, not once per event."""
    with secured_nats(tmp_path) as (url, passwords):
        broker = start_broker(url, passwords, {}, ENV)
        try:
            # heartbeats every 2 s: expiry after 6 s without one, a margin for a busy machine
            figs = asyncio.run(run_against(url, passwords, broker, FLOOD_SPEC, heartbeat_s=2.0, recover_s=60))
            alive = broker.popen.poll() is None
        finally:
            broker.stop()  # its every line read: the counts below are exact
    over_lines = [e for e in broker.events("sender_over_budget") if e.get("sender") == FLOOD]
    assert alive, broker.tail()
    assert figs.flood_events == FLOOD_SPEC.events
    assert not [e for e in broker.events("sender_expired") if e.get("sender_id") == HONEST]
    assert figs.recovered_after_s is not None, "the honest context was not found after the flood"
    assert figs.index_bytes is not None and figs.index_bytes <= BUDGET + (1 << 20), figs  # + the honest holder
    assert figs.rss_peak_mb - figs.rss_before_mb < 200, figs.as_dict()
    over = sum(figs.over_budget.values())
    assert over > 0 and figs.over_budget.get('reason="evicted"', 0) > 0, figs.over_budget
    assert 0 < len(over_lines) < over / 10, (len(over_lines), figs.over_budget)
