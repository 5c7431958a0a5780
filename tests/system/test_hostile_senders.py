"""Hostile and unlucky senders against a real receiver: frozen past the reuse timeout then
resumed, killed, frozen while unrelated requests arrive, and trickling its bytes over a slow link.
Real nats-server, broker, sender and receiver processes on the ci tier; readiness and progress from
logs, replies and the link's byte counter, never sleeps."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.launch import Proc, free_port, start_nats
from droidmesh.shared.tools.bench import netns
from droidmesh.shared.wire import schemas
from tests.system.conftest import start_together, until_indexed, words

pytestmark = [pytest.mark.system, pytest.mark.fault]

CONTEXT = words(1500)
THREADS = {"OMP_NUM_THREADS": "1"}
# A short reuse timeout so a freeze outlasts it quickly; the breaker opens after 2 failures.
# The receiver holds nothing of its own (else a repeat would reuse its own KV, not the hostile sender's).
RECEIVER_ARGS = {"model_id": "receiver", "default_group": [1, 2], "reuse_timeout_s": 1.0, "breaker_failures": 2,
                 "breaker_cooldown_s": 60.0, "hold": False}


def _mesh(services: list[Proc], url: str, model_dir, receiver_args: dict | None = None, sender_args: dict | None = None,
          sender_wrap: list[str] | None = None, env: dict[str, str] | None = None) -> tuple[Proc, Proc]:
    """Broker, sender and receiver (the sender holds the receiver's own weights: every path gives the same tokens)."""
    env = {**THREADS, **(env or {})}
    _, sender, receiver = start_together(url, [
        ("cache_broker", {}, {"env": env}),
        ("sender", {"model_path": model_dir, "model_id": "sender", "e_layers": [1], **(sender_args or {})},
         {"env": env, "wrap": sender_wrap}),
        ("receiver", {"model_path": model_dir, **(receiver_args or RECEIVER_ARGS)}, {"env": env}),
    ], services)
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

    def __init__(self, client: MeshClient, k: int = 3, timeout: float = 60) -> None:
        self.client, self.stop, self.timeout = client, asyncio.Event(), timeout
        self.replies: list[schemas.GenerateReply] = []
        self.tasks = [asyncio.create_task(self._one(i)) for i in range(k)]

    async def _one(self, k: int) -> None:
        i = 0
        while not self.stop.is_set():
            self.replies.append(await self.client.ask("receiver", CONTEXT, f" q{k}-{i}", max_new_tokens=2,
                                                       timeout=self.timeout))
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


@pytest.mark.parametrize("transport", ["ucx", "shm"])
def test_sender_frozen_past_the_timeout_then_resumed(nats, services, tiny_pair, tiny_models, transport):
    """SIGSTOP a sender under a request stream until pulls time out, then SIGCONT: the receiver
    stays alive and every request is answered (fallbacks while frozen)."""
    url = nats[1]
    sender, receiver = _mesh(services, url, tiny_pair[1], {**RECEIVER_ARGS, "breaker_failures": 1000, "transport": transport},
                             {"transport": transport})

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


@pytest.mark.parametrize("transport", ["ucx", "shm"])
def test_full_prefill_answered_while_another_requests_sender_is_frozen(nats, services, tiny_pair, tiny_models, transport):
    """While the sender is frozen and a reuse request waits on it, an unrelated full-prefill request is answered first."""
    url = nats[1]
    sender, receiver = _mesh(services, url, tiny_pair[1], {**RECEIVER_ARGS, "reuse_timeout_s": 60.0, "transport": transport},
                             {"transport": transport})

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


# -- a trickling sender -------------------------------------------------------------------------
# The sender in a network namespace of its own, behind a veth pair to this host. The sender's
# outbound side of the link carries its NATS traffic at full speed and everything else (the UCX
# wireup and bulk payloads) at TRICKLE_KBIT: bytes keep arriving, far too slowly for a pull of
# CONTEXT (~2 MB on the ci tier: E of layer 1 and the reused layers' K/V, ~40 s at that rate) to
# finish within the receiver's reuse timeout. NATS, the broker, the receiver and this test's client
# stay on the host, on the veth's host address.
NS, HOST_DEV, NS_DEV = "dm-trickle", "dmtrk-host", "dmtrk-snd"
HOST_IP, SND_IP = "10.78.0.1", "10.78.0.2"
TRICKLE_KBIT = 400
UCX_TCP = {"UCX_TLS": "tcp,self"}  # over the veth: a shared-memory transport would bypass the shaped link
BUDGET_S = 30.0  # each request's budget: shorter than a whole pull at TRICKLE_KBIT


def _sh(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True)


def _remove_link() -> None:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)  # takes the veth pair with it
    subprocess.run(["ip", "link", "del", HOST_DEV], capture_output=True)


def _trickled_bytes() -> int:
    """Bytes the sender's namespace has sent through the trickling class so far (tc's counter)."""
    out = subprocess.run(["ip", "netns", "exec", NS, "tc", "-s", "class", "show", "dev", NS_DEV],
                         check=True, capture_output=True, text=True).stdout
    found = re.search(r"class htb 1:20 .*\n\s*Sent (\d+) bytes", out)
    assert found, out
    return int(found.group(1))


def _build_link(nats_port: int) -> None:
    """The namespace, the veth pair and the sender side's qdisc: htb with NATS (to `nats_port`) in a fast class and
    everything else in a TRICKLE_KBIT class with a short queue (packets of one MTU: an even trickle)."""
    ns = ["ip", "netns", "exec", NS]
    _sh("ip", "netns", "add", NS)
    _sh(*ns, "ip", "link", "set", "lo", "up")
    _sh("ip", "link", "add", HOST_DEV, "type", "veth", "peer", "name", NS_DEV)
    _sh("ip", "link", "set", NS_DEV, "netns", NS)
    _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_DEV)
    _sh("ip", "link", "set", HOST_DEV, "up")
    _sh(*ns, "ip", "addr", "add", f"{SND_IP}/24", "dev", NS_DEV)
    _sh(*ns, "ip", "link", "set", NS_DEV, "gso_max_size", "1500", "up")
    tc = [*ns, "tc"]
    _sh(*tc, "qdisc", "add", "dev", NS_DEV, "root", "handle", "1:", "htb", "default", "20")
    _sh(*tc, "class", "add", "dev", NS_DEV, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
    _sh(*tc, "class", "add", "dev", NS_DEV, "parent", "1:", "classid", "1:20", "htb", "rate", f"{TRICKLE_KBIT}kbit",
        "ceil", f"{TRICKLE_KBIT}kbit")
    _sh(*tc, "qdisc", "add", "dev", NS_DEV, "parent", "1:20", "handle", "20:", "pfifo", "limit", "10")
    _sh(*tc, "filter", "add", "dev", NS_DEV, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
        "match", "ip", "dport", str(nats_port), "0xffff", "flowid", "1:10")


@pytest.fixture
def trickle(tmp_path) -> Iterator[tuple[str, list[str]]]:
    """(NATS url, command prefix running a process in the sender's namespace): the link above, NATS up on its host end."""
    why = netns.available()
    if why:
        pytest.skip(why)
    _remove_link()
    port = free_port()
    try:
        _build_link(port)
    except subprocess.CalledProcessError as e:  # root, but no namespaces, veth, htb or u32 here
        _remove_link()
        pytest.skip(f"cannot build the trickle link: {' '.join(e.cmd)}: {e.stderr.strip()}")
    nats_proc = None
    try:
        nats_proc, url = start_nats(port=port, store_dir=str(tmp_path / "js"), host=HOST_IP)
        yield url, ["ip", "netns", "exec", NS]
    finally:
        if nats_proc is not None:
            nats_proc.stop()
        _remove_link()


def _trickle_mesh(services: list[Proc], url: str, wrap: list[str], model_dir, reuse_timeout_s: float) -> tuple[Proc, Proc]:
    """Broker and receiver here, the sender in the namespace, UCX over TCP; the breaker never opens (every request pulls)."""
    return _mesh(services, url, model_dir, {**RECEIVER_ARGS, "reuse_timeout_s": reuse_timeout_s, "breaker_failures": 1000},
                 sender_args={"ucx_host": SND_IP}, sender_wrap=wrap, env=UCX_TCP)


async def _until_trickled(nbytes: int, pulling: asyncio.Task) -> None:
    """Return once the sender has trickled `nbytes` (a pull's payload is on the wire), while `pulling` still waits."""
    while _trickled_bytes() < nbytes:
        assert not pulling.done(), pulling.result()
        await asyncio.sleep(0.05)


async def _until_trickle_stops(timeout: float = 60) -> None:
    """Return once the link carried less than one packet in 2 s: the sender stopped sending (after the bytes the kernel
    had already taken from it drain); fail if it still sends after `timeout`."""
    deadline = time.monotonic() + timeout
    last = _trickled_bytes()
    while True:
        await asyncio.sleep(2)  # a sampling window for the byte counter, not a wait for readiness
        now = _trickled_bytes()
        if now - last < 1500:
            return
        assert time.monotonic() < deadline, f"the sender still sends ({now - last} B in 2 s) {timeout}s after the last request"
        last = now


def test_trickling_sender_is_cut_off_at_the_reuse_timeout(trickle, services, tiny_pair, tiny_models):
    """A sender trickling its bulk bytes under a request stream: each pull is cut at the reuse timeout and the sender's
    sends are aborted, every request is answered by fallback within its budget, the link goes quiet once the stream
    ends, and the receiver stays up and stops cleanly."""
    url, wrap = trickle
    sender, receiver = _trickle_mesh(services, url, wrap, tiny_pair[1], reuse_timeout_s=2.0)

    async def run() -> list:
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            stream = Stream(client, timeout=BUDGET_S)
            # A pull cut mid-trickle: the sender's send failed (cancelled). Later requests may fall back
            # sooner (a connect while the cut connection's socket buffer still drains misses its deadline).
            await _log_line(sender, '"ucx_send_failed"', timeout=BUDGET_S * 2)
            await stream.until(len(stream.replies) + 3)
            replies = await stream.finish()
            await _until_trickle_stops()
            return replies
        finally:
            await client.close()

    replies = asyncio.run(run())
    assert receiver.popen.poll() is None, receiver.tail()
    assert all(len(r.token_ids) == 2 and r.path == "fallback" and r.bytes_pulled == 0 for r in replies), \
        [(r.path, r.fallback_reason) for r in replies]
    assert all(r.stages_ms["done"] < BUDGET_S * 1e3 for r in replies)
    cut = [r for r in replies if re.search(r"pull from \S+ exceeded", r.fallback_reason or "")]
    assert cut, [r.fallback_reason for r in replies]  # pulls cut at the reuse timeout, not left to trickle
    # the sends end with the receiver's connection: its sandbox is ended (or UCX cancels them)
    assert all(e["error"].startswith(("cancelled", "UCXXCanceledError")) for e in sender.events("ucx_send_failed")), sender.tail()
    assert receiver.stop() == 0 and receiver.events("stopped"), receiver.tail()


def test_full_prefill_answered_while_a_trickling_pull_is_in_progress(trickle, services, tiny_pair, tiny_models):
    """While a reuse request's pull trickles in, an unrelated full-prefill request is answered first; the reuse request
    then falls back at its reuse timeout, within its budget."""
    url, wrap = trickle
    sender, receiver = _trickle_mesh(services, url, wrap, tiny_pair[1], reuse_timeout_s=10.0)

    async def run():
        client = await MeshClient.connect(url)
        try:
            await client.prefill("sender", CONTEXT)
            await until_indexed(client, tiny_models[1], CONTEXT)
            start = _trickled_bytes()
            pulling = asyncio.create_task(client.ask("receiver", CONTEXT, " pulling", max_new_tokens=2, timeout=BUDGET_S))
            await _until_trickled(start + 20_000, pulling)  # well past any wireup: the pull's payload is on the wire
            other = await client.ask("receiver", words(50, offset=3), " other", max_new_tokens=2, mode="full_prefill",
                                     timeout=BUDGET_S)
            return other, pulling.done(), await pulling
        finally:
            await client.close()

    other, pulling_done, pulled = asyncio.run(run())
    assert other.path == "full_prefill" and len(other.token_ids) == 2 and not pulling_done
    # the pull's deadline is the reuse timeout or what is left of the request's budget, if less; the
    # engine's wait for the layer ends at the same moment, and on a busy machine it may say so first
    assert pulled.path == "fallback" and re.search(r"exceeded (9\.\d+|10)s|did not arrive before the deadline",
                                                   pulled.fallback_reason or ""), pulled.fallback_reason
    assert len(pulled.token_ids) == 2 and pulled.stages_ms["done"] < BUDGET_S * 1e3
    assert receiver.popen.poll() is None, receiver.tail()
