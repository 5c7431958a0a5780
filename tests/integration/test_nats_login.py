"""A nats-server the launch helpers start (what every test, bench and local mesh runs) refuses an
anonymous connection and lets in whoever has its URL, which carries the login."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import nats
import pytest
from nats.errors import Error as NatsError

from droidmesh.shared.service.launch import start_nats, start_nats_cluster


async def _round_trip(url: str) -> bytes:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
    try:
        async def echo(msg) -> None:
            await msg.respond(msg.data)

        sub = await nc.subscribe("dm.test.echo", cb=echo)
        reply = await nc.request("dm.test.echo", b"ping", timeout=5)
        await sub.unsubscribe()
        return reply.data
    finally:
        await nc.close()


async def _anonymous(url: str) -> None:
    u = urlsplit(url)
    await nats.connect(f"nats://{u.hostname}:{u.port}", allow_reconnect=False, connect_timeout=5,
                       max_reconnect_attempts=0)


def _check(url: str) -> None:
    assert urlsplit(url).username == "admin" and urlsplit(url).password
    assert asyncio.run(_round_trip(url)) == b"ping"
    with pytest.raises(NatsError, match="Authorization Violation"):
        asyncio.run(_anonymous(url))
    wrong = url.replace(urlsplit(url).password or "", "not-the-password")
    with pytest.raises(NatsError, match="Authorization Violation"):
        asyncio.run(_round_trip(wrong))


def test_a_local_server_refuses_anonymous_clients(tmp_path):
    proc, url = start_nats(store_dir=str(tmp_path / "js"))
    try:
        _check(url)
    finally:
        proc.stop()


def test_a_restart_with_the_old_password_lets_the_old_url_in(tmp_path):
    proc, url = start_nats(store_dir=str(tmp_path / "js"))
    u = urlsplit(url)
    proc.stop()
    proc, again = start_nats(port=u.port, store_dir=str(tmp_path / "js"), password=u.password)
    try:
        assert again == url
        assert asyncio.run(_round_trip(url)) == b"ping"
    finally:
        proc.stop()


def test_a_cluster_node_refuses_anonymous_clients(tmp_path):
    cluster = start_nats_cluster(3, store_dir=str(tmp_path / "js"))
    try:
        _check(cluster.urls[0])
    finally:
        cluster.stop()
