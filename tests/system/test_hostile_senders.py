"""Hostile and unlucky senders against a real receiver: frozen past the reuse timeout then
resumed, killed, and frozen while unrelated requests arrive. Real nats-server, broker, sender and
receiver processes on the ci tier; readiness and progress from logs and replies, never sleeps."""

from __future__ import annotations

import asyncio
import signal

import pytest

from droidmesh.shared.client import MeshClient
from droidmesh.shared.launch import Proc, start_service
from tests.system.conftest import until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.fault]

CONTEXT = words(1500)
THREADS = {"OMP_NUM_THREADS": "1"}
# A short reuse timeout so a freeze outlasts it quickly; the breaker opens after 2 failures.
RECEIVER_ARGS = {"model_id": "receiver", "default_group": [1, 2], "reuse_timeout_s": 1.0, "breaker_failures": 2,
                 "breaker_cooldown_s": 60.0}


def _mesh(services: list[Proc], url: str, model_dir, receiver_args: dict | None = None) -> tuple[Proc, Proc]:
    """Broker, sender and receiver (the sender holds the receiver's own weights: every path gives the same tokens)."""
    services.append(start_service("cache_broker", {}, url, env=THREADS))
    sender = start_service("sender", {"model_path": model_dir, "model_id": "sender", "e_layers": [1]}, url, env=THREADS)
    services.append(sender)
    receiver = start_service("receiver", {"model_path": model_dir, **(receiver_args or RECEIVER_ARGS)}, url,
                             env=THREADS)
    services.append(receiver)
    return sender, receiver


async def _log_line(proc: Proc, needle: str, after: int = 0, timeout: float = 60) -> None:
    """Return once `proc` logged its (after+1)-th line containing `needle`."""
    def seen() -> None:
        count = [0]

        def pred(line: str) -> bool:
            count[0] += needle in line
            return count[0] > after

        proc.wait_for(pred, timeout, needle)

    await asyncio.to_thread(seen)


class Stream:
    """`k` clients asking in a loop until stopped; every reply is kept (a lost request raises)."""

    def __init__(self, client: MeshClient, k: int = 3) -> None:
        self.client, self.replies, self.stop = client, [], asyncio.Event()
        self.tasks = [asyncio.create_task(self._one(i)) for i in range(k)]

    async def _one(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            self.replies.append(await self.client.ask("receiver", CONTEXT, f" q{k}-{i}", max_new_tokens=2, timeout=60))
            i += 1

    async def until(self, n: int) -> None:
        while len(self.replies) < n:
            await asyncio.wait(self.tasks, timeout=0.05)
            for t in self.tasks:
                if t.done():
                    t.result()  # a lost request fails the test here, not by timing out later

    async def finish(self) -> list:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        return self.replies


def test_sender_frozen_past_the_timeout_then_resumed(nats, services, tiny_pair, tiny_models):
    """SIGSTOP a sender under a request stream until pulls time out, then SIGCONT: the receiver
    stays alive and every request is answered (fallbacks while frozen)."""
    url = nats[1]
    sender, receiver = _mesh(services, url, tiny_pair[1], {**RECEIVER_ARGS, "breaker_failures": 1000})

    async def run() -> list:
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            stream = Stream(client)
            await stream.until(3)
            for _ in range(2):  # two freezes: a pull cut at the timeout, resumed, and cut again
                sender.popen.send_signal(signal.SIGSTOP)
                seen = len(receiver.events("reuse_fallback"))
                await _log_line(receiver, '"reuse_fallback"', after=seen + 2)
                sender.popen.send_signal(signal.SIGCONT)
                await stream.until(len(stream.replies) + 6)
            return await stream.finish()
        finally:
            sender.popen.send_signal(signal.SIGCONT)
            await client.close()

    replies = asyncio.run(run())
    assert receiver.popen.poll() is None, receiver.tail()
    assert all(len(r.token_ids) == 2 for r in replies)
    assert "fallback" in {r.path for r in replies}


def test_sender_killed_is_bypassed_and_its_circuit_opens(nats, services, tiny_pair, tiny_models):
    """SIGKILL the sender under a request stream: every request is answered (fallback), and the
    receiver opens the dead holder's circuit, so later requests skip it (reason holder_open_circuit)."""
    url = nats[1]
    sender, receiver = _mesh(services, url, tiny_pair[1])

    async def run() -> list:
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            stream = Stream(client)
            await stream.until(3)
            sender.kill()
            await _log_line(receiver, '"holder_circuit_open"')
            await stream.until(len(stream.replies) + 6)
            return await stream.finish()
        finally:
            await client.close()

    replies = asyncio.run(run())
    assert receiver.popen.poll() is None, receiver.tail()
    assert all(len(r.token_ids) == 2 for r in replies)
    assert any(r.fallback_reason and "holder_open_circuit" in r.fallback_reason for r in replies[-6:]), \
        [(r.path, r.fallback_reason) for r in replies[-6:]]


def test_full_prefill_answered_while_another_requests_sender_is_frozen(nats, services, tiny_pair, tiny_models):
    """While the sender is frozen and a reuse request waits on it, an unrelated full-prefill request is answered first."""
    url = nats[1]
    sender, receiver = _mesh(services, url, tiny_pair[1], {**RECEIVER_ARGS, "reuse_timeout_s": 60.0})

    async def run():
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            sender.popen.send_signal(signal.SIGSTOP)
            stalled = asyncio.create_task(client.ask("receiver", CONTEXT, " stalled", max_new_tokens=2, timeout=90))
            other = await client.ask("receiver", words(50, offset=3), " other", max_new_tokens=2, mode="full_prefill",
                                     timeout=90)
            stalled_done = stalled.done()
            sender.popen.send_signal(signal.SIGCONT)
            return other, stalled_done, await stalled
        finally:
            sender.popen.send_signal(signal.SIGCONT)
            await client.close()

    other, stalled_done, stalled = asyncio.run(run())
    assert other.path == "full_prefill" and not stalled_done
    assert len(stalled.token_ids) == 2 and receiver.popen.poll() is None
