"""Sandbox processes (`shared/transport/sandbox/`): each ucx or nixl connection is served by a
process of its own that maps only the contexts its pulls were granted, while they last, and whose
death costs only that connection."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import structlog
import torch

from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.transport.sandbox import host
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.transport.ucx import ops, runtime, server, wireup
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.channels import UcxWelcome
from droidmesh.shared.wire.sandbox import SandboxServed
from droidmesh.shared.wire.schemas import PullItem, PullRequest

CHANNELS = ["ucx", pytest.param("nixl", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("nixl_cu12") is None, reason="needs NIXL"))]
ITEMS = [PullItem(0, "K"), PullItem(0, "V")]


def _contexts() -> dict[str, dict[tuple[int, str], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {cid: {(0, k): torch.randn(1, 2, 33, 8, generator=g) for k in "KV"} for cid in ("a", "b")}


async def _server(transport: str, issuer: TokenIssuer) -> tuple[object, str, dict]:
    """A server of contexts "a" and "b", each placed on its own as a sender stores it."""
    held = _contexts()
    server = make_server(transport, lambda c, l, k: held.get(c, {}).get((l, k)),
                         lambda req: issuer.verify(req.context_id, req.token))
    for ctx in held.values():
        ctx.update(zip(ctx, server.place(list(ctx.values())), strict=True))
    return server, await server.start(), held


def _memfds(pid: int) -> set[str]:
    """The KV memfds (`memfd.place`'s, by inode) that process `pid` maps now."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[4] for line in f if "droidmesh-kv" in line}


def _inodes(ctx: dict[tuple[int, str], torch.Tensor]) -> set[str]:
    from droidmesh.shared.transport import memfd

    found = memfd.placed(next(iter(ctx.values())))
    assert found is not None
    return {str(os.fstat(found[0].fd).st_ino)}


@pytest.mark.parametrize("transport", CHANNELS)
def test_a_connections_sandbox_maps_only_what_its_pull_was_granted(transport):
    """Mid-pull, the connection's sandbox (a process other than the server's) maps at most context
    "a"'s memfd, never "b"'s; two connections get two sandboxes; once pulls end their mappings go."""
    issuer = TokenIssuer(ttl_s=60)

    async def run() -> tuple[list[set[str]], set[str], set[int], dict]:
        server, address, held = await _server(transport, issuer)
        seen: list[set[str]] = []
        pids: set[int] = set()

        def during(item, t) -> None:
            for sandbox in server.sandboxes._live:  # type: ignore[attr-defined]  # the pool under test
                pids.add(sandbox.pid)
                seen.append(_memfds(sandbox.pid))

        clients = [make_client(transport), make_client(transport)]
        try:
            for client in clients:
                into = [torch.empty(1, 2, 33, 8) for _ in ITEMS]
                await client.pull(address, PullRequest(context_id="a", items=ITEMS, token=issuer.issue("a")[0]), into,
                                  during, 30)
                # bitwise: the channel copies the stored bytes
                assert all(torch.equal(t, held["a"][(it.layer, it.kind)]) for it, t in zip(ITEMS, into, strict=True))
            after: set[str] = set()
            for _ in range(200):  # a nixl sandbox unmaps on the NixlDone it is sent after the pull: bounded wait
                after = set().union(*(_memfds(s.pid) for s in server.sandboxes._live))  # type: ignore[attr-defined]
                if not after:
                    break
                await asyncio.sleep(0.01)
            return seen, after, pids, held
        finally:
            for client in clients:
                await client.close()
            await server.close()

    seen, after, pids, held = asyncio.run(run())
    assert len(pids) == 2 and os.getpid() not in pids
    assert seen and all(s <= _inodes(held["a"]) for s in seen), seen
    if transport == "nixl":  # mid-pull (reads done, NixlDone not yet sent) its grant is mapped; a ucx
        assert any(seen), seen  # sandbox unmaps once its sends complete, before the receiver sees an item
    assert not any(s & _inodes(held["b"]) for s in seen)
    assert after == set()


@pytest.mark.parametrize("transport", CHANNELS)
def test_a_sandbox_that_dies_costs_only_its_connection(transport):
    """SIGSEGV to one connection's sandbox (what a library crash is): that connection's next pull
    gets a fresh connection and sandbox or fails as a TransferError; another connection's pulls,
    and the server, go on; the death is counted."""
    issuer = TokenIssuer(ttl_s=60)

    async def run() -> tuple[int, int]:
        server, address, held = await _server(transport, issuer)
        clients = [make_client(transport), make_client(transport)]

        async def pull(client) -> bool:
            into = [torch.empty(1, 2, 33, 8) for _ in ITEMS]
            try:
                await client.pull(address, PullRequest(context_id="b", items=ITEMS, token=issuer.issue("b")[0]), into,
                                  lambda *a: None, 30)
            except Exception as e:
                assert type(e).__name__ == "TransferError", e
                return False
            # bitwise: the channel copies the stored bytes
            return all(torch.equal(t, held["b"][(it.layer, it.kind)]) for it, t in zip(ITEMS, into, strict=True))

        try:
            for client in clients:
                assert await pull(client)
            before = host.died_total
            victim = sorted(server.sandboxes._live, key=lambda s: s.pid)[0]  # type: ignore[attr-defined]
            os.kill(victim.pid, signal.SIGSEGV)
            await asyncio.wait_for(victim.proc.wait(), 30)
            results = [await pull(client) for client in clients]  # one of these lost its sandbox
            assert all(await asyncio.gather(*(pull(c) for c in clients)))  # and after, both pull again
            return results.count(True), host.died_total - before
        finally:
            for client in clients:
                await client.close()
            await server.close()

    ok, died = asyncio.run(run())
    assert ok >= 1 and died == 1


def test_a_ucx_hello_with_a_refused_pull_learns_no_address():
    """A hello whose pull is refused gets the error, no worker address, and starts no sandbox."""
    issuer = TokenIssuer(ttl_s=60)

    async def run() -> tuple[UcxWelcome, int]:
        server, address, _ = await _server("ucx", issuer)
        try:
            host_, port = address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host_, int(port))
            request = schemas.encode(PullRequest(context_id="a", items=ITEMS, token="1.forged.0"))
            writer.write(wireup.hello(7, b"\x01" * 40, request))
            welcome = await asyncio.wait_for(wireup.read_welcome(reader), 30)
            writer.close()
            return welcome, server.sandboxes.live()  # type: ignore[attr-defined]
        finally:
            await server.close()

    welcome, live = asyncio.run(run())
    assert welcome.error and welcome.error.startswith("unauthorized") and welcome.address == b"" and live == 0


async def _until(done, what: str) -> None:
    """Wait for `done()` (the 30 s bound a hang: they are no timing claim)."""
    try:
        async with asyncio.timeout(30):
            while not done():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"waited 30 s for {what}")


def _send_failures(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] in ("ucx_send_failed", "ucx_connection_dropped") and e["log_level"] == "warning"]


async def _pull_then_close(issuer: TokenIssuer, timeout_s: float, closed: asyncio.Event | None = None):
    """One pull of ITEMS from a ucx server of `_server`'s contexts, the receiver closing its
    connection at once after it (then setting `closed`), until the sender has ended that
    connection: (the pull's result or error, its buffers, what the server held)."""
    srv, address, held = await _server("ucx", issuer)
    client = make_client("ucx")
    try:
        into = [torch.empty(1, 2, 33, 8) for _ in ITEMS]
        (outcome,) = await asyncio.gather(client.pull(address, PullRequest(context_id="a", items=ITEMS,
                                                                           token=issuer.issue("a")[0]),
                                                      into, lambda *a: None, timeout_s), return_exceptions=True)
        await client.close()  # at once: the sandbox's report of its sends may not have reached the server
        if closed is not None:
            closed.set()
        await _until(lambda: srv.sandboxes.live() == 0, "the connection ends")  # type: ignore[attr-defined]
        return outcome, into, held
    finally:
        await client.close()
        await srv.close()


def test_a_ucx_receiver_closing_right_after_its_pull_completed_is_no_failed_send(monkeypatch):
    """A receiver that closes its connection as soon as its pull completed: the sandbox's report
    that its sends completed (which trails the receiver's last receive) is read only after the
    server has seen the connection end, as happens on a busy host. Not a failed send."""
    issuer = TokenIssuer(ttl_s=60)
    readers: list[asyncio.StreamReader] = []
    closed = asyncio.Event()
    serve, recv = server.UcxBulkServer._serve_connection, host.Sandbox.recv

    async def serve_connection(self, reader, writer, slot):
        readers.append(reader)
        return await serve(self, reader, writer, slot)

    async def late_recv(self, kind, deadline_s):
        if kind is SandboxServed:
            await closed.wait()
            await _until(lambda: readers[0].at_eof(), "the server reads the receiver's close")
            for _ in range(10):  # the lifeline's read task, then its done callbacks, each take a pass of the loop
                await asyncio.sleep(0)
        return await recv(self, kind, deadline_s)

    monkeypatch.setattr(server.UcxBulkServer, "_serve_connection", serve_connection)
    monkeypatch.setattr(host.Sandbox, "recv", late_recv)

    with structlog.testing.capture_logs() as logs:
        outcome, into, held = asyncio.run(_pull_then_close(issuer, 30, closed))
    assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(t, held["a"][(it.layer, it.kind)]) for it, t in zip(ITEMS, into, strict=True))  # bitwise: copied
    assert not _send_failures(logs), logs


def test_a_ucx_receiver_that_leaves_mid_pull_is_a_cancelled_send(monkeypatch):
    """A receiver that says hello with a granted pull of 8 MiB, takes the response, then aborts its
    endpoint and closes its connection without receiving the payload: the payload's send cannot
    complete, the sandbox is ended (after LEFT_S at most), and the send is logged as cancelled."""
    monkeypatch.setattr(server, "LEFT_S", 0.5)
    issuer = TokenIssuer(ttl_s=60)
    big = {(0, "K"): torch.randn(1, 2, 131072, 8)}  # far above any eager threshold: a rendezvous the receiver must pull

    async def run() -> None:
        srv = make_server("ucx", lambda c, l, k: big.get((l, k)) if c == "big" else None,
                          lambda req: issuer.verify(req.context_id, req.token))
        address = await srv.start()
        try:
            host_, port = address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host_, int(port))
            request = PullRequest(context_id="big", items=[PullItem(0, "K")], token=issuer.issue("big")[0])
            writer.write(wireup.hello(7, runtime.ucxx().get_worker_address().tobytes(), schemas.encode(request)))
            welcome = await asyncio.wait_for(wireup.read_welcome(reader), 30)
            assert not welcome.error, welcome.error
            ep = await wireup.endpoint_to(runtime.ucxx(), welcome.address, welcome.tag, 7, writer)
            response = schemas.decode(await asyncio.wait_for(ops.recv_frame(ep, schemas.MAX_MESSAGE_BYTES), 30),
                                      schemas.PullResponse)
            assert not response.error, response.error  # the pull is under way: its payload's send is posted
            ops.abort(ep)  # and the connection with it
            await _until(lambda: srv.sandboxes.live() == 0, "the connection ends")  # type: ignore[attr-defined]
        finally:
            await srv.close()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(run())
    failed = [e for e in _send_failures(logs) if e["event"] == "ucx_send_failed"]
    assert len(failed) == 1 and failed[0]["error"].startswith("cancelled"), logs
    assert not [e for e in _send_failures(logs) if e["event"] == "ucx_connection_dropped"], logs  # the receiver's doing


def test_a_sandbox_that_dies_on_its_own_mid_pull_is_a_crash_not_a_receiver_that_left(monkeypatch):
    """The sandbox crashes (killed here) while the receiver is still connected and pulling: the
    sender logs the sandbox's death, and does not blame the receiver for leaving, even when the
    receiver, its pull failed, closes its connection before the sender has seen the death."""
    issuer = TokenIssuer(ttl_s=60)
    recv = host.Sandbox.recv

    async def dying_recv(self, kind, deadline_s):
        if kind is SandboxServed:
            os.kill(self.pid, signal.SIGKILL)  # a crash in UCX, say
        return await recv(self, kind, deadline_s)

    monkeypatch.setattr(host.Sandbox, "recv", dying_recv)

    with structlog.testing.capture_logs() as logs:
        outcome, _, _ = asyncio.run(_pull_then_close(issuer, 10))
    assert isinstance(outcome, Exception)  # the receiver's pull failed: its sender's sandbox died
    warned = [(e["event"], e.get("reason", e.get("error", e.get("status")))) for e in logs if e["log_level"] == "warning"]
    assert ("sandbox_died", "signal SIGKILL") in warned and not [w for w in warned if w[0] == "ucx_send_failed"], warned
