"""The sender's side of the bulk protocol (`answer.answer`, `answer.answer_async`): what a pull is
charged against the pull budget, and where its encoding runs. Fakes only: a dict of tensors, a
hold that counts."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.transport import answer, codecs
from droidmesh.shared.wire.schemas import PullItem, PullRequest

STORED = {(l, k): torch.randn(1, 2, 16, 8) for l in range(4) for k in "KV"}  # [1, kvh, T, hd]
ITEM_BYTES = 2 * 16 * 8 * 4


class Hold:
    """A pull budget of `budget` bytes, as the store's hold keeps it."""

    def __init__(self, budget: int):
        self.budget, self.charged, self.peak, self.released = budget, 0, 0, False

    def charge(self, nbytes: int) -> None:
        if self.charged + nbytes > self.budget:
            raise TransferError(f"sender busy: {nbytes} more would pass the pull budget of {self.budget}")
        self.charged += nbytes
        self.peak = max(self.peak, self.charged)

    def refund(self, nbytes: int) -> None:
        self.charged -= nbytes

    def release(self) -> None:
        self.released = True


def _request(codec: str = "raw", tokens: int = 0, layers: int = 4) -> PullRequest:
    return PullRequest(context_id="ctx", items=[PullItem(l, k) for l in range(layers) for k in "KV"], codec=codec,
                       tokens=tokens)


def _lookup(context_id: str, layer: int, kind: str) -> torch.Tensor | None:
    return STORED.get((layer, kind))


class Spy:
    """Wraps a codec's encode: counts calls and records the thread each ran on."""

    def __init__(self, monkeypatch, cls):
        self.threads: list[int] = []
        real = cls.encode

        def encode(codec, t, params):
            self.threads.append(threading.get_ident())
            return real(codec, t, params)

        monkeypatch.setattr(cls, "encode", encode)


def test_a_zero_copy_pull_larger_than_the_pull_budget_is_served_and_charged_nothing(monkeypatch):
    """Raw items sent where they lie make no copy: a budget far below the plan's bytes refuses nothing."""
    hold = Hold(budget=ITEM_BYTES // 2)
    served = answer.answer(_request(), _lookup, None, lambda _: hold)
    assert not served.response.error and len(served.payloads) == 8
    assert hold.peak == 0
    served.release()
    assert hold.released


def test_a_layered_plans_raw_layers_are_charged_nothing_and_its_quantized_ones_their_bytes():
    """The layered codec sends a raw layer's items as they lie: a plan of raw layers larger than
    the budget is served; its int8 layers are charged their encodings."""
    hold = Hold(budget=ITEM_BYTES // 2)
    raw_layers = _request("layered", layers=4)
    raw_layers.codec_params.update(codecs.layers_param(["raw"] * 4))
    served = bulk_answer(raw_layers, hold)
    assert not served.response.error and hold.peak == 0
    hold = Hold(budget=1 << 30)
    mixed = _request("layered", layers=4)
    mixed.codec_params.update(codecs.layers_param(["raw", "raw", "int8", "raw"]))
    served = bulk_answer(mixed, hold)
    assert not served.response.error
    assert hold.charged == sum(p.numel() for p, h in zip(served.payloads, served.response.headers, strict=True)
                               if h.layer == 2) > 0


def bulk_answer(request: PullRequest, hold: Hold) -> answer.Served:
    return answer.answer(request, _lookup, None, lambda _: hold)


def test_copies_past_the_pull_budget_are_refused_before_anything_is_encoded(monkeypatch):
    """A prefix pull copies every item (a slice of K / V); their bytes together pass the budget, so
    the pull is refused before the first copy is made, and its hold released."""
    spy = Spy(monkeypatch, codecs.RawCodec)
    hold = Hold(budget=3 * ITEM_BYTES)
    served = answer.answer(_request(tokens=8), _lookup, None, lambda _: hold)
    assert "pull budget" in served.response.error and served.payloads == []
    assert spy.threads == [] and hold.released


def test_a_pull_is_charged_the_bytes_its_copies_take_until_released():
    """int8 copies every item: the charge is each item's encoded bound, refunded only by release."""
    hold = Hold(budget=1 << 30)
    served = answer.answer(_request("int8", layers=2), _lookup, None, lambda _: hold)
    assert not served.response.error
    assert hold.charged == sum(p.numel() for p in served.payloads) > 0  # int8's bound is exact for a kind
    served.release()
    assert hold.released


def test_answer_async_encodes_off_the_loop_and_a_free_pull_on_it(monkeypatch):
    """Quantizing runs on a worker thread; raw bytes whose checksums are known are answered on the
    loop's own thread (nothing to hand off). Both answers equal the blocking `answer`'s."""
    spy_int8, spy_raw = Spy(monkeypatch, codecs.Int8Codec), Spy(monkeypatch, codecs.RawCodec)

    async def both():
        loop_thread = threading.get_ident()
        quantized = await answer.answer_async(_request("int8", layers=1), _lookup, None)
        answer.answer(_request(layers=1), _lookup, None)  # the raw checksums, now known
        raw = await answer.answer_async(_request(layers=1), _lookup, None)
        return loop_thread, quantized, raw

    loop_thread, quantized, raw = asyncio.run(both())
    assert spy_int8.threads and all(t != loop_thread for t in spy_int8.threads)
    assert spy_raw.threads[-2:] == [loop_thread] * 2
    want = answer.answer(_request("int8", layers=1), _lookup, None)
    assert quantized.response == want.response
    assert all(torch.equal(a, b) for a, b in zip(quantized.payloads, want.payloads, strict=True))  # bitwise: same kernel, same input
    assert not raw.response.error and all(h.checksum for h in raw.response.headers)


def test_a_cancelled_answer_releases_its_hold_only_once_the_encode_is_done(monkeypatch):
    """The receiver went while its pull was being encoded: the hold (which keeps the stored tensors
    the thread reads) is released after the thread finishes, not while it still reads them, and
    the cancel returns then."""
    gate, started = threading.Event(), threading.Event()
    real = codecs.Int8Codec.encode

    def slow(codec, t, params):
        started.set()
        gate.wait(10)
        return real(codec, t, params)

    monkeypatch.setattr(codecs.Int8Codec, "encode", slow)
    hold = Hold(budget=1 << 30)

    async def cancel_midway():
        task = asyncio.ensure_future(answer.answer_async(_request("int8", layers=1), _lookup, None, lambda _: hold))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()
        await asyncio.sleep(0.05)
        released_while_encoding = hold.released or task.done()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task  # returns once the encode is done
        return released_while_encoding

    assert asyncio.run(cancel_midway()) is False
    assert hold.released


def test_a_codec_error_on_the_worker_thread_is_a_refusal_and_releases_the_hold(monkeypatch):
    """An encode that raises a protocol error on the worker thread: the pull is refused (the
    one-line answer), its hold released."""
    def fail(codec, t, params):
        raise IntegrityError("int8: cannot encode this")

    monkeypatch.setattr(codecs.Int8Codec, "encode", fail)
    hold = Hold(budget=1 << 30)
    served = asyncio.run(answer.answer_async(_request("int8", layers=1), _lookup, None, lambda _: hold))
    assert "cannot encode this" in served.response.error and served.payloads == [] and hold.released


class _Failing:
    """A codec that sends items as they lie, but whose encode fails (a protocol error)."""

    name = "test-failing"

    def sends_own_bytes(self, t, params):
        return True

    def encode(self, t, params):
        raise IntegrityError("test-failing: cannot encode")

    def decode(self, payload, header, out):
        raise AssertionError("never sent")

    def max_nbytes(self, shape, dtype, params):
        return codecs.nbytes_of(shape, dtype)


def test_an_error_encoding_on_the_loop_is_a_refusal_and_releases_the_hold():
    """A pull with nothing to hand off is encoded on the loop; an error there refuses the pull and
    releases its hold, as on the thread."""
    codecs.register(_Failing())
    try:
        hold = Hold(budget=1 << 30)
        served = asyncio.run(answer.answer_async(_request("test-failing", layers=1), _lookup, None, lambda _: hold,
                                                 checksums=False))
    finally:
        codecs.unregister("test-failing")
    assert "cannot encode" in served.response.error and served.payloads == [] and hold.released
