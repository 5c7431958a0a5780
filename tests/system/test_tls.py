"""TLS on the bus: services and clients reach a mutual-TLS nats-server; anyone else is refused; the
deployment's own configuration (infra/nats/nats-tls.conf + infra/secrets/generate.sh) works as shipped."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
import trustme

from droidmesh.shared.mesh.client import MeshClient
from droidmesh.shared.service.launch import start_nats, start_service
from droidmesh.shared.service.settings import BusSettings

pytestmark = [pytest.mark.system, pytest.mark.security]
INFRA = Path(__file__).resolve().parents[2] / "infra"


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


async def _plain_text_refused(url: str, user: str, password: str) -> bool:
    """True when the server asks for TLS and a plain-text CONNECT with a right password gets no PONG."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        info = json.loads((await asyncio.wait_for(reader.readline(), 3)).decode().removeprefix("INFO "))
        writer.write(f"CONNECT {json.dumps({'user': user, 'pass': password, 'verbose': False})}\r\nPING\r\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 3)  # b"" once the server hangs up, or an -ERR
        return info.get("tls_required") is True and b"PONG" not in answer
    finally:
        writer.close()


@pytest.fixture
def deployed_nats(tmp_path: Path):
    """nats-server run with infra/nats/nats-tls.conf (its certificate paths pointed at generate.sh's output
    instead of /etc/droidmesh/tls) and the generated role passwords; yields its tls:// URL and the secrets dir."""
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed")
    secrets = tmp_path / "secrets"
    subprocess.run(["bash", str(INFRA / "secrets" / "generate.sh"), str(secrets)], check=True, capture_output=True, timeout=60)
    conf_dir = tmp_path / "nats"
    conf_dir.mkdir()
    shutil.copy(INFRA / "nats" / "nats-auth.conf", conf_dir)
    conf, n = re.subn(r'"/etc/droidmesh/tls/([\w.-]+)"', lambda m: f'"{secrets / "tls" / m.group(1)}"',
                      (INFRA / "nats" / "nats-tls.conf").read_text())
    assert n == 3
    (conf_dir / "nats-tls.conf").write_text(conf)
    env = dict(line.split("=", 1) for line in (secrets / "nats.env").read_text().splitlines() if line)
    proc, url = start_nats(store_dir=str(tmp_path / "js"), conf=conf_dir / "nats-tls.conf", env=env)
    yield url.replace("nats://", "tls://"), secrets
    proc.stop()


def test_the_deployment_tls_conf_and_generated_secrets_work_as_shipped(deployed_nats, tmp_path):
    """With nats-tls.conf and generate.sh's secrets, a broker configured as compose configures it (tls:// URL,
    CA, user, password file) serves an admin's lookup over TLS and `droidmesh ask` logs in as client with
    --user/--password/--tls-ca; plain text, a wrong password and a client not trusting the CA are refused."""
    url, secrets = deployed_nats
    ca = secrets / "tls" / "ca.pem"
    password = {role: (secrets / "passwords" / role).read_text().strip() for role in ("client", "admin")}
    broker = start_service("cache_broker", {}, url, env={
        "OMP_NUM_THREADS": "1", "DM_NATS_USER": "broker", "DM_NATS_PASSWORD_FILE": str(secrets / "passwords" / "broker"),
        "DM_NATS_TLS_CA": str(ca)})
    try:
        async def run() -> None:
            admin = BusSettings(nats_url=url, nats_user="admin", nats_password_file=str(secrets / "passwords" / "admin"),
                                nats_tls_ca=str(ca))
            client = await MeshClient.connect(None, **admin.nats_options())
            reply = await client.lookup([1, 2, 3], "no-such-model")
            assert reply.holder is None  # the broker answered, both over TLS with their role passwords
            await client.bus.close()

            login = {"user": "client", "password": password["client"]}
            assert not await _refused(url, tls=_context(ca, None), **login)  # the helper can say no
            assert await _plain_text_refused(url, **login)
            assert await _refused(url, tls=_context(ca, None), user="client", password=password["admin"])  # wrong password
            assert await _refused(url, tls=_context(None, None), **login)  # the server's certificate is not trusted

        asyncio.run(run())
    finally:
        broker.stop()

    context = tmp_path / "context.txt"
    context.write_text("a small context")
    ask = [sys.executable, "-m", "droidmesh.shared.tools.cli.main", "ask", "--nats", url, "--user", "client", "--password",
           password["client"], "--receiver", "qa", "--context", str(context), "--question", "what?"]
    out = subprocess.run([*ask, "--tls-ca", str(ca), "--timeout", "2"], capture_output=True, text=True, timeout=60)
    # connected, logged in and allowed to ask: only the receiver is missing
    assert out.returncode == 1 and "cannot connect" not in out.stderr and "NoResponders" in out.stderr, out.stderr
    out = subprocess.run([*ask, "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in out.stderr, out.stderr  # without --tls-ca: not trusted
