"""Connection slots (`slots.py`): setup deadline, per-peer and global caps, which idle connection
makes room, busy connections kept, refusals counted and logged at a bounded rate; and the TCP
control listener that admits every ucx / nixl connection through them."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from droidmesh.shared.errors import ConfigError
from droidmesh.shared.transport import slots
from droidmesh.shared.transport.control import ControlListener
from droidmesh.shared.transport.slots import Slot, SlotEnded, SlotLimits, Slots

DEADLINE_S = 10.0  # the longest any wait here may take


class Conn:
    """A connection's task: admitted to `table`, then waiting on its slot until `go` is set (or
    busy, outside any wait, while `busy` is set); `ended` is how it ended."""

    def __init__(self, table: Slots, peer: str, grantee: str = ""):
        self.table, self.peer, self.grantee = table, peer, grantee
        self.go, self.busy = asyncio.Event(), asyncio.Event()
        self.slot: Slot | None = None
        self.admitted = asyncio.Event()
        self.task = asyncio.create_task(self._run())
        self.ended = ""

    async def _run(self) -> None:
        self.slot = self.table.admit(self.peer)
        self.admitted.set()
        if self.slot is None:
            self.ended = "refused"
            return
        try:
            while True:
                async with self.slot.waiting():
                    await self.go.wait()
                self.go.clear()
                self.slot.claim(self.grantee)  # a pull's grant names its grantee before it is served
                self.slot.pulled()
                await self.busy.wait()  # busy until the test lets it wait again
                self.busy.clear()
        except SlotEnded as e:
            self.ended = e.reason
        finally:
            self.table.release(self.slot)

    async def pull(self) -> None:
        """Complete one pull, then stay busy (outside any wait) until `idle()`."""
        self.go.set()
        for _ in range(100):  # bounded: a few loop turns suffice
            if not self.go.is_set():
                return
            await asyncio.sleep(0)
        raise AssertionError("the pull did not run")

    async def idle(self) -> None:
        """End its pull: it waits on its slot again."""
        self.busy.set()
        for _ in range(100):  # bounded: a few loop turns suffice
            if self.slot is not None and self.slot.idle:
                return
            await asyncio.sleep(0)
        raise AssertionError("it did not wait again")


async def open_conn(table: Slots, peer: str, grantee: str = "") -> Conn:
    c = Conn(table, peer, grantee)
    await asyncio.wait_for(c.admitted.wait(), DEADLINE_S)
    await asyncio.sleep(0)  # into its wait
    return c


async def ended(c: Conn) -> str:
    await asyncio.wait_for(asyncio.shield(c.task), DEADLINE_S)
    return c.ended


def run(coro):
    return asyncio.run(coro)


def test_limits_must_fit_together():
    for bad in ({"max_connections": 0}, {"per_peer": 0}, {"max_connections": 4, "per_peer": 5}, {"per_grantee": 0},
                {"setup_s": 0}, {"setup_s": 20, "idle_s": 10}):
        with pytest.raises(ConfigError):
            SlotLimits(**bad)
    assert SlotLimits().per_peer < SlotLimits().max_connections


def test_the_sender_config_carries_the_limits(tmp_path):
    """`--bulk-*` flags reach `SlotLimits`; limits that do not fit together are a ConfigError."""
    from droidmesh.services.sender.config import SenderConfig
    from droidmesh.shared.service import settings

    (tmp_path / "config.json").write_text("{}")
    env = {"DM_SENDER_MODEL_PATH": str(tmp_path)}
    cfg = settings.load(SenderConfig, "sender", ["--bulk-peer-connections", "8", "--bulk-setup-s", "3"], env)
    assert cfg.slot_limits() == SlotLimits(per_peer=8, setup_s=3)
    with pytest.raises(ConfigError, match="per_peer"):
        settings.load(SenderConfig, "sender", ["--bulk-max-connections", "4", "--bulk-peer-connections", "5"], env)


def test_a_connection_that_never_pulls_is_let_go_at_the_setup_deadline():
    async def go():
        table = Slots("t", SlotLimits(setup_s=0.05, idle_s=600))
        c = await open_conn(table, "a")
        assert await ended(c) == slots.SETUP_DEADLINE
        assert len(table) == 0 and table.counts[slots.SETUP_DEADLINE] == 1

    run(go())


def test_the_long_idle_timeout_applies_only_after_a_pull():
    async def go():
        table = Slots("t", SlotLimits(setup_s=5, idle_s=600))
        c = await open_conn(table, "a")
        assert c.slot is not None
        assert c.slot.wait_s(c.slot.opened + 1) == pytest.approx(4)  # what is left of the setup deadline
        await c.pull()
        assert c.slot.proven and c.slot.wait_s(c.slot.opened + 1000) == 600
        c.task.cancel()

    run(go())


def test_at_the_global_cap_the_least_recently_active_idle_connection_makes_room():
    async def go():
        table = Slots("t", SlotLimits(max_connections=3, per_peer=3, setup_s=600))
        a, b, c = [await open_conn(table, p) for p in "abc"]
        d = await open_conn(table, "d")
        assert d.slot is not None and await ended(a) == slots.EVICTED
        assert not b.task.done() and not c.task.done()
        assert sorted(table.held()) == ["b", "c", "d"] and table.counts[slots.EVICTED] == 1
        for x in (b, c, d):
            x.task.cancel()

    run(go())


def test_connections_that_never_pulled_make_room_before_proven_ones():
    async def go():
        table = Slots("t", SlotLimits(max_connections=2, per_peer=2, setup_s=600))
        honest = await open_conn(table, "h")
        await honest.pull()
        await honest.idle()  # back to waiting, proven: the oldest of the two
        idler = await open_conn(table, "x")
        newcomer = await open_conn(table, "n")
        assert newcomer.slot is not None and await ended(idler) == slots.EVICTED
        assert not honest.task.done()
        honest.task.cancel()
        newcomer.task.cancel()

    run(go())


def test_a_peer_at_its_cap_gives_up_its_own_oldest_idle_connection():
    async def go():
        table = Slots("t", SlotLimits(max_connections=8, per_peer=2, setup_s=600))
        other = await open_conn(table, "b")
        first, second = await open_conn(table, "a"), await open_conn(table, "a")
        third = await open_conn(table, "a")
        assert third.slot is not None and await ended(first) == slots.EVICTED_PEER
        assert table.held() == {"a": 2, "b": 1}
        assert not other.task.done() and not second.task.done()
        for x in (other, second, third):
            x.task.cancel()

    run(go())


def test_busy_connections_are_kept_and_a_newcomer_is_refused_when_all_are_busy():
    async def go():
        table = Slots("t", SlotLimits(max_connections=2, per_peer=2, setup_s=600))
        a, b = await open_conn(table, "a"), await open_conn(table, "b")
        await a.pull()
        await b.pull()  # both mid-pull: nothing may be taken
        with capture_logs() as logs:
            refused = [await open_conn(table, "c") for _ in range(3)]
        assert all(r.ended == "refused" for r in refused) and table.counts[slots.REFUSED] == 3
        lines = [l for l in logs if l["event"] == "t_connection_refused"]
        assert len(lines) == 1 and lines[0]["reason"] == slots.REFUSED  # rate-limited: one line for three
        assert slots.dropped()[("t", slots.REFUSED)] >= 3
        await a.idle()  # its pull is over: it waits again, and may be taken
        c = await open_conn(table, "c")
        assert c.slot is not None and await ended(a) == slots.EVICTED
        b.task.cancel()
        c.task.cancel()

    run(go())


def test_a_grantee_at_its_cap_gives_up_its_own_oldest_idle_connection_whatever_its_address():
    """One identity over many addresses (per-peer caps do not see it) holds at most `per_grantee`
    connections that pulled: its next first pull takes its own least recently active idle one."""
    async def go():
        table = Slots("t", SlotLimits(max_connections=8, per_peer=8, per_grantee=2, setup_s=600))
        mine = [await open_conn(table, f"10.0.0.{i}", grantee="receiver-qa") for i in range(3)]
        theirs = await open_conn(table, "10.0.1.1", grantee="receiver-docqa")
        for c in (*mine[:2], theirs):
            await c.pull()
            await c.idle()
        assert table.held_by_grantee() == {"receiver-qa": 2, "receiver-docqa": 1}
        await mine[2].pull()
        assert await ended(mine[0]) == slots.EVICTED_GRANTEE and table.counts[slots.EVICTED_GRANTEE] == 1
        assert table.held_by_grantee() == {"receiver-qa": 2, "receiver-docqa": 1}
        assert not theirs.task.done() and not mine[1].task.done()
        for c in (*mine[1:], theirs):
            c.task.cancel()

    run(go())


def test_a_grantee_with_every_connection_pulling_is_refused_and_others_are_not():
    async def go():
        table = Slots("t", SlotLimits(max_connections=8, per_peer=8, per_grantee=1, setup_s=600))
        busy = await open_conn(table, "a", grantee="g")
        await busy.pull()  # mid-pull: not to be taken
        second = await open_conn(table, "b", grantee="g")
        await second.pull()
        assert await ended(second) == slots.REFUSED_GRANTEE and table.counts[slots.REFUSED_GRANTEE] == 1
        other = await open_conn(table, "c", grantee="h")
        await other.pull()
        assert table.held_by_grantee() == {"g": 1, "h": 1} and len(table) == 2
        busy.task.cancel()
        other.task.cancel()

    run(go())


def test_a_connection_pulls_for_one_grantee_only():
    async def go():
        table = Slots("t", SlotLimits(max_connections=8, per_peer=8, setup_s=600))
        c = await open_conn(table, "a", grantee="g")
        await c.pull()
        await c.idle()
        c.grantee = "h"  # its next grant went to another user
        await c.pull()
        assert await ended(c) == slots.REFUSED_GRANTEE and table.held_by_grantee() == {} and len(table) == 0

    run(go())


def test_a_grant_names_whom_it_went_to():
    from droidmesh.shared.transport.tokens import TokenIssuer

    issuer = TokenIssuer(ttl_s=10)
    mine, _ = issuer.issue("ctx", grantee="receiver-qa")
    anyone, _ = issuer.issue("ctx")
    assert issuer.verify("ctx", mine) == "receiver-qa" and issuer.verify("ctx", anyone) == ""


def test_closing_the_server_cancels_a_waiting_connection_as_a_cancellation():
    async def go():
        table = Slots("t", SlotLimits(setup_s=600))
        c = await open_conn(table, "a")
        c.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(c.task, DEADLINE_S)
        assert c.ended == "" and len(table) == 0

    run(go())


# -- the TCP control listener (ucx, nixl) ------------------------------------------------------
async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, slot: Slot) -> None:
    """Per line: wait for it on the slot, echo it, count it as a pull."""
    while True:
        async with slot.waiting():
            line = await reader.readline()
        if not line:
            return
        writer.write(line)
        await writer.drain()
        slot.pulled()


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), DEADLINE_S) == b""


def test_the_listener_admits_a_newcomer_past_idle_connections_from_one_address():
    """Idle connections up to the cap from 127.0.0.1 do not lock out the next one: its oldest
    idle one is closed, the newcomer is served; a silent one goes at the setup deadline."""
    async def go():
        listener = ControlListener("t", _echo, SlotLimits(max_connections=4, per_peer=3, setup_s=600))
        address, _ = await listener.start("127.0.0.1", 0)
        host, port = address.split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        try:
            for _ in range(1000):  # bounded: until the server has admitted all three
                if len(listener.slots) == 3:
                    break
                await asyncio.sleep(0.01)
            assert len(listener.slots) == 3
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"hello\n")
            assert await asyncio.wait_for(reader.readline(), DEADLINE_S) == b"hello\n"
            assert await _closed(idle[0][0])
            assert listener.slots.counts[slots.EVICTED_PEER] == 1 and listener.slots.held() == {"127.0.0.1": 3}
            writer.close()
        finally:
            for _, w in idle:
                w.close()
            await listener.close()

    run(go())


def test_the_listener_lets_a_silent_connection_go_at_the_setup_deadline():
    async def go():
        listener = ControlListener("t", _echo, SlotLimits(setup_s=0.05))
        address, _ = await listener.start("127.0.0.1", 0)
        host, port = address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert await _closed(reader)
            assert listener.slots.counts[slots.SETUP_DEADLINE] == 1
        finally:
            writer.close()
            await listener.close()

    run(go())


def test_closing_the_listener_under_a_live_connection_ends_it_without_an_error_logged():
    """A sender stopping while a connection's handler waits (SIGTERM mid-wireup): its task is
    cancelled and ends quietly. Python 3.11's stream server asks a finished connection task for
    its exception without checking whether it was cancelled, so a task that ended cancelled
    reaches the loop's exception handler (a traceback in the sender's log) unless the task
    ends itself."""
    errors: list[dict] = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        entered = asyncio.Event()

        async def waits(reader, writer, slot):
            entered.set()
            await asyncio.Event().wait()  # until cancelled

        listener = ControlListener("t", waits, SlotLimits(setup_s=600))
        address, _ = await listener.start("127.0.0.1", 0)
        host, port = address.split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        try:
            await asyncio.wait_for(entered.wait(), DEADLINE_S)
        finally:
            await listener.close()
            writer.close()
        for _ in range(10):  # the stream server's done-callback runs on a later loop iteration
            await asyncio.sleep(0)

    run(go())
    assert errors == [], errors
