"""`bench vllm`'s decode A/B (shared/tools/bench/vllm_reuse.py `decode_ab`): two live engines
measured a round each in turn, so a host that slows down over the run slows both alike. Fake
engines on a fake clock: each request takes its tokens' time times a factor that grows with
every request the host has served."""

from __future__ import annotations

from typing import Any

import pytest

from droidmesh.shared.tools.bench.vllm_reuse import _decode_rate, decode_ab

PREFILL_S = 1.0


class Host:
    """`drift`: each request slows the next by this share; `jitter`: prefills vary by this share."""

    def __init__(self, drift: float, jitter: float = 0.0):
        self.drift, self.jitter, self.factor, self.order = drift, jitter, 1.0, []


class FakeEngine:
    """`stats`: each answer carries its own decode time (`decode_s`, as vLLM's request stats give
    it), else only the whole call's seconds."""

    def __init__(self, name: str, tokens_per_s: float, host: Host, stats: bool = False, prefill_s: float = PREFILL_S):
        self.name, self.rate, self.host, self.stats, self.prefill_s = name, tokens_per_s, host, stats, prefill_s

    def ask(self, rid: str, prompt: list[int], *, max_tokens: int, **kw: Any) -> dict[str, Any]:
        self.host.order.append(self.name)
        decode = (max_tokens - 1) / self.rate * self.host.factor
        seconds = self.prefill_s * (1 + self.host.jitter * (len(self.host.order) % 3)) * self.host.factor + decode
        self.host.factor *= 1.0 + self.host.drift
        return {"id": rid, "request_id": rid, "tokens": [0] * max_tokens, "seconds": seconds,
                "decode_s": decode if self.stats and max_tokens > 1 else None}

    def events(self, event: str, request_id: str) -> list[dict[str, Any]]:
        return []


def test_the_engines_take_turns_and_a_drifting_host_does_not_bias_the_ratio():
    host = Host(drift=0.02)  # 2 % slower after every request: 64 requests, 3.5x by the end
    got = decode_ab(FakeEngine("alone", 10.0, host), FakeEngine("connector", 11.0, host), "t", [1, 2, 3], 32, 8)
    # a warm-up round, then 8; each round is a (1-token, 32-token) pair per engine, the order swapped each round
    assert host.order[::2] == ["alone", "connector"] + ["connector", "alone", "alone", "connector"] * 4
    assert got["rounds"] == 8 and len(got["rates"]["a"]) == len(got["rates"]["b"]) == 8
    assert got["ratio"] == pytest.approx(1.1, abs=0.01)
    assert got["ratio_lo"] <= got["ratio"] <= got["ratio_hi"]


def test_an_answers_own_decode_time_is_used_without_a_second_prefill():
    """With vLLM's request stats (`decode_s`) one generate per round and engine is asked, and the
    prefill's jitter (30 % from call to call here) does not reach the rate: the interval is tight."""
    host = Host(drift=0.0, jitter=0.3)
    got = decode_ab(FakeEngine("alone", 10.0, host, stats=True), FakeEngine("connector", 11.0, host, stats=True),
                    "t", [1, 2, 3], 32, 8)
    assert len(host.order) == 2 * 9
    assert got["rates"]["a"] == pytest.approx([10.0] * 8) and got["rates"]["b"] == pytest.approx([11.0] * 8)
    assert got["ratio_lo"] == pytest.approx(1.1) and got["ratio_hi"] == pytest.approx(1.1)


def test_one_engine_after_the_other_would_have_read_the_drift_as_the_connectors():
    """What the turns correct: the same host and engines measured all of one, then all of the
    other (`_decode_rate` per engine, as the bench did) put the 10 % faster engine at ~0.85x."""
    host = Host(drift=0.02)
    alone = _decode_rate(FakeEngine("alone", 10.0, host), "a", [1, 2, 3], 32, 8)
    mine = _decode_rate(FakeEngine("connector", 11.0, host), "c", [1, 2, 3], 32, 8)
    assert mine / alone < 0.9


def test_with_ttft_each_turn_times_the_miss_too_and_the_drift_cancels():
    """The miss's TTFT from the same turns: a one-token answer first in each engine's turn; an
    engine whose prefill takes 4 % longer reads 1.04 on a host that drifts 2 % a request."""
    host = Host(drift=0.02)
    got = decode_ab(FakeEngine("alone", 10.0, host, stats=True),
                    FakeEngine("connector", 10.0, host, stats=True, prefill_s=1.04 * PREFILL_S), "t", [1, 2, 3], 32, 8,
                    ttft=True)
    assert len(host.order) == 2 * 2 * 9  # per round and engine: the one-token answer, then the generate
    assert got["ttft"]["ratio"] == pytest.approx(1.04, abs=0.01)
    assert got["ttft"]["ratio_lo"] <= got["ttft"]["ratio"] <= got["ttft"]["ratio_hi"]
    assert len(got["ttft"]["seconds"]["a"]) == len(got["ttft"]["seconds"]["b"]) == 8
    assert got["ratio"] == pytest.approx(1.0, abs=0.01)  # the decode rates are equal
    assert "ttft" not in decode_ab(FakeEngine("a", 10.0, host), FakeEngine("b", 10.0, host), "u", [1], 4, 2)


class SpinningHost(Host):
    """A fake clock where an engine's processes spin for `tail_s` after its last answer: a turn
    of the other engine that starts within it prefills `penalty` slower."""

    def __init__(self, tail_s: float, penalty: float):
        super().__init__(drift=0.0)
        self.now, self.tail_s, self.penalty, self.last = 0.0, tail_s, penalty, ("", -1e9)

    def sleep(self, s: float) -> None:
        self.now += s


class SpinningEngine(FakeEngine):
    def ask(self, rid: str, prompt: list[int], *, max_tokens: int, **kw: Any) -> dict[str, Any]:
        host = self.host
        assert isinstance(host, SpinningHost)
        other, ended = host.last
        slow = host.penalty if other not in ("", self.name) and host.now - ended < host.tail_s else 0.0
        out = super().ask(rid, prompt, max_tokens=max_tokens, **kw)
        out["seconds"] += slow * self.prefill_s
        host.now += out["seconds"]
        host.last = (self.name, host.now)
        return out


def test_a_pause_before_each_turn_keeps_the_other_engines_spin_out_of_its_miss():
    """Two equal engines; each spins 1 s after an answer, slowing a prefill that starts within it
    by 10 %. Without a pause the turn that follows the other engine pays it (every other round
    for each): the miss's ratio is 1.0 only on average, its interval wide. With `settle_s`
    past the spin, every turn starts quiet: 1.0, and the interval closes on it."""
    def run(settle_s: float) -> dict[str, Any]:
        host = SpinningHost(tail_s=1.0, penalty=0.1)
        a, b = SpinningEngine("a", 10.0, host, stats=True), SpinningEngine("b", 10.0, host, stats=True)
        return decode_ab(a, b, "t", [1], 8, 8, ttft=True, settle_s=settle_s, sleep=host.sleep)["ttft"]

    noisy, quiet = run(0.0), run(1.5)
    assert noisy["ratio_hi"] - noisy["ratio_lo"] > 0.1
    assert quiet["ratio"] == pytest.approx(1.0) and quiet["ratio_hi"] - quiet["ratio_lo"] == pytest.approx(0.0, abs=1e-9)
