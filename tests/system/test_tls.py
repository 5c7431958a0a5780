"""TLS on the bus: services and clients reach a mutual-TLS nats-server; anyone else is refused."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import nats
import pytest
import trustme

from droidmesh.shared.client import MeshClient
from droidmesh.shared.launch import start_nats, start_service

pytestmark = [pytest.mark.system, pytest.mark.security]


@pytest.fixture
def tls_nats(tmp_path: Path):
    """A nats-server that requires TLS and a client certificate signed by its CA."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("droidmesh-client")
    files = {"ca": tmp_path / "ca.pem", "server": tmp_path / "server.pem", "client": tmp_path / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    proc, url = start_nats(store_dir=str(tmp_path / "js"), extra=[
        "--tlsverify", "--tlscert", str(files["server"]), "--tlskey", str(files["server"]),
        "--tlscacert", str(files["ca"])])
    yield url, files
    proc.stop()


def _context(ca: Path | None, cert: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert:
        ctx.load_cert_chain(str(cert))
    return ctx


async def _refused(url: str, **options) -> bool:
    """True when the connection attempt fails (no retries)."""
    try:
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, **options)
    except Exception:
        return True
    await nc.close()
    return False


def test_services_and_clients_talk_over_mutual_tls_and_others_are_refused(tls_nats):
    """A broker configured with the CA and its certificate serves lookups to a client that
    also presents one; a plain client, one without a certificate and one from another CA
    are refused by the server."""
    url, f = tls_nats
    broker = start_service("cache_broker", {}, url, env={
        "OMP_NUM_THREADS": "1", "DM_NATS_TLS_CA": str(f["ca"]), "DM_NATS_TLS_CERT": str(f["client"]),
        "DM_NATS_TLS_KEY": str(f["client"])})
    try:
        async def run() -> None:
            client = await MeshClient.connect(url, tls=_context(f["ca"], f["client"]))
            reply = await client.lookup([1, 2, 3], "no-such-model")
            assert reply.holder is None  # answered by the broker, over TLS both ways
            await client.bus.close()

            assert not await _refused(url, tls=_context(f["ca"], f["client"]))  # the helper can say no
            assert await _refused(url)  # plain text
            assert await _refused(url, tls=_context(f["ca"], None))  # TLS, but no client certificate
            other = trustme.CA()
            stranger = other.issue_cert("stranger")
            pem = Path(str(f["ca"]).replace("ca.pem", "stranger.pem"))
            stranger.private_key_and_cert_chain_pem.write_to_path(str(pem))
            assert await _refused(url, tls=_context(f["ca"], pem))  # a certificate from another CA

        asyncio.run(run())
    finally:
        broker.stop()
