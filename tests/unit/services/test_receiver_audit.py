"""The receiver's quality watch: when a pair's shadow agreement drops it fires once, with the rows to re-profile on."""

from __future__ import annotations

import pytest

from droidmesh.services.receiver.relay_watch import QualityWatch
from droidmesh.shared.wire.schemas import ProfileRow


def row(i: int) -> ProfileRow:
    return ProfileRow(context=f"c{i}", input="q", answers=[f"a{i}"])


def test_fires_once_when_the_window_mean_drops_below_the_threshold():
    """High agreement never fires; once the last 4 average below 0.5 (after >= 2 samples) it
    fires exactly once, holds the model and stays quiet until reset."""
    w = QualityWatch(window=4, min_samples=2, threshold=0.5)
    assert not any(w.observe("base", 1.0, row(i)) for i in range(6))
    fired = [w.observe("base", 0.1, row(10 + i)) for i in range(6)]
    assert fired == [False, False, True, False, False, False]  # window means 0.775, 0.55, 0.325, ...
    assert w.agreement("base") == pytest.approx(0.1) and w.held("base") and not w.held("other")
    w.reset("base")
    assert w.agreement("base") is None and not w.held("base")
    assert [w.observe("base", 0.1, row(20 + i)) for i in range(3)] == [False, True, False]


def test_rows_are_the_most_recent_and_bounded_and_chat_rows_are_skipped():
    """The watch keeps the last keep_rows rows per model; a shadow without a row (chat) counts its
    agreement only; models are independent."""
    w = QualityWatch(window=8, min_samples=8, threshold=0.5, keep_rows=3)
    for i in range(5):
        w.observe("base", 1.0, row(i))
    w.observe("base", 1.0, None)
    w.observe("other", 0.0, row(99))
    assert [r.context for r in w.rows("base")] == ["c2", "c3", "c4"]
    assert [r.context for r in w.rows("other")] == ["c99"] and w.rows("nobody") == []


def test_threshold_zero_never_fires_and_values_are_clamped():
    """threshold 0 turns the watch off; agreements outside [0, 1] are clamped, models are bounded."""
    off = QualityWatch(window=2, min_samples=1, threshold=0.0)
    assert not any(off.observe("m", 0.0, row(i)) for i in range(5))
    w = QualityWatch(window=2, min_samples=1, threshold=0.5, max_models=2)
    w.observe("a", 7.0, row(0))
    assert w.agreement("a") == 1.0
    w.observe("b", 1.0, row(1))
    w.observe("c", 1.0, row(2))
    assert w.agreement("a") is None  # the least recently seen model went


def test_a_relay_slower_than_its_predicted_own_prefill_counts_as_lost_time():
    """Relayed in 0.3 s where own prefill was predicted 0.1 s: 0.2 s lost, nothing saved, the request
    counted in its bucket; the faster one saves. (Counters only grow: a negative benefit once crashed the request.)"""
    from types import SimpleNamespace

    from droidmesh.services.receiver.relay_watch import count_relay
    from droidmesh.shared.kv import policy
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.service.metrics import Metrics

    s = SimpleNamespace(metrics=Metrics("receiver"))
    d = policy.Decision(ReusePlan.recompute(2, 4), "partial", predicted_s={policy.PREFILL_OPTION: 0.1}, predicted_ttft_s=0.05)
    count_relay(s, d, "treatment", "partial", policy.Online(1000, reused_tokens=999), 0.3)
    count_relay(s, d, "treatment", "partial", policy.Online(1000, reused_tokens=500), 0.04)
    value = s.metrics.registry.get_sample_value
    assert value("dm_relay_lost_seconds_total") == pytest.approx(0.2)
    assert value("dm_relay_saved_seconds_total") == pytest.approx(0.06)
    assert value("dm_relay_requests_total", {"bucket": "[0.95,1]", "outcome": "relayed"}) == 1
    assert value("dm_relay_requests_total", {"bucket": "<0.7", "outcome": "relayed"}) == 1
    assert value("dm_prediction_error_ratio_count") == 2


def test_a_shadow_runs_a_layer_at_a_time_and_never_while_a_request_is_in_the_receiver(receiver, prompt, monkeypatch):
    """A request arriving mid-shadow pauses it between layers; the shadow resumes when the receiver is
    idle and still answers exactly the receiver's own greedy tokens (agreement 1 with them)."""
    import asyncio
    from types import SimpleNamespace

    from droidmesh.services.receiver import relay_watch as audit
    from droidmesh.shared.service.metrics import Metrics
    from tests.conftest import reference_greedy

    monkeypatch.setattr(audit, "SHADOW_POLL_S", 0.0)
    ctx, q = prompt
    served = reference_greedy(receiver, ctx + q, 4)
    calls: list[int] = []  # requests in the receiver at each torch call the shadow made

    async def run_torch(fn, *args):
        calls.append(s.inflight)
        if len(calls) == 3:
            s.inflight = 1  # a request arrives after the shadow's third step
        return fn(*args)

    s = SimpleNamespace(inflight=0, run_torch=run_torch, model=receiver, eos_token_id=None, shadow_agreements=[],
                        shadow_lock=asyncio.Lock(),
                        watch=QualityWatch(window=4, min_samples=2, threshold=0.0), metrics=Metrics("receiver"),
                        cfg=SimpleNamespace(quality_threshold=0.0, reprofile=False))

    async def main() -> int:
        shadow = asyncio.get_running_loop().create_task(audit.shadow(s, "r1", "base", "", "", ctx + q, served))
        while len(calls) < 3 and not shadow.done():
            await asyncio.sleep(0)
        for _ in range(20):  # the request is served meanwhile; the shadow must not step
            await asyncio.sleep(0)
        paused_at = len(calls)
        s.inflight = 0
        await shadow
        return paused_at

    paused_at = asyncio.run(main())
    assert paused_at == 3 and set(calls) == {0}
    assert len(calls) == receiver.num_layers + 3  # one step per layer, then 3 decode steps, then the end
    assert s.shadow_agreements == [1.0]


def test_a_holder_on_a_same_host_channel_is_same_host_topology():
    """shm and inproc holders, and loopback addresses, are the audit's same_host stratum; others remote."""
    from droidmesh.services.receiver.reply import _topology
    from droidmesh.shared.wire import schemas

    def holder(transport: str, address: str) -> schemas.CacheAvailable:
        fp = schemas.Fingerprint("llama", 2, 8, 2, 2, 4, "{}", "v")
        return schemas.CacheAvailable(sender_id="s", model_id="m", model_sha256="x", fingerprint=fp, fingerprint_id="f",
                                      context_id="c", token_ids=[1], dtype="float32", kv_nbytes=[1, 1], e_layers=[0],
                                      e_nbytes=1, transport=transport, address=address, published_at=0.0)

    assert _topology(holder("shm", "/run/dm/sender.sock")) == "same_host"
    assert _topology(holder("ucx", "127.0.0.1:4000")) == "same_host"
    assert _topology(holder("ucx", "10.0.0.7:4000")) == "remote"


def test_shadows_run_one_at_a_time(receiver, prompt, monkeypatch):
    """Two shadows queued together never interleave their steps: the second starts after the first ends."""
    import asyncio
    from types import SimpleNamespace

    from droidmesh.services.receiver import relay_watch as audit
    from droidmesh.shared.service.metrics import Metrics
    from tests.conftest import reference_greedy

    monkeypatch.setattr(audit, "SHADOW_POLL_S", 0.0)
    ctx, q = prompt
    served = reference_greedy(receiver, ctx + q, 3)
    stepped: list[object] = []  # which generation each torch call advanced (held: ids stay unique)

    async def run_torch(fn, steps, *args):
        stepped.append(steps)
        await asyncio.sleep(0)  # the other shadow gets the loop between steps
        return fn(steps, *args)

    s = SimpleNamespace(inflight=0, run_torch=run_torch, model=receiver, eos_token_id=None, shadow_agreements=[],
                        shadow_lock=asyncio.Lock(), watch=QualityWatch(window=4, min_samples=2, threshold=0.0),
                        metrics=Metrics("receiver"), cfg=SimpleNamespace(quality_threshold=0.0, reprofile=False))

    async def main() -> None:
        await asyncio.gather(audit.shadow(s, "r1", "base", "", "", ctx + q, served),
                             audit.shadow(s, "r2", "base", "", "", ctx + q, served))

    asyncio.run(main())
    order = [0 if g is stepped[0] else 1 for g in stepped]
    assert stepped[-1] is not stepped[0] and order == sorted(order)
    assert s.shadow_agreements == [1.0, 1.0]
