"""Every bulk channel (real UCX, NIXL and shm in one process, and in-process) keeps one contract:
order, integrity checks, refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import threading

import msgspec
import pytest
import torch

from droidmesh.shared.errors import IntegrityError, TransferError
from droidmesh.shared.transport import codecs, registry
from droidmesh.shared.transport.bulk import make_client, make_server
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire.schemas import PullItem, PullRequest

TENSORS = {(l, k): torch.randn(1, 2, 33, 8) for l in range(3) for k in "KV"} | {(1, "E"): torch.randn(1, 33, 16)}
CHANNELS = ["inproc", "ucx", "nixl", "shm"]


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _buffers(items: list[PullItem]) -> list[torch.Tensor]:
    return [torch.empty((1, 33, 16) if it.kind == "E" else (1, 2, 33, 8)) for it in items]


async def _session(transport, issuer, body, lookup=None, pin=None, stored=None):
    """`body(client, address)` against a server of `lookup`, or of context "ctx" holding `stored`
    ((layer, kind) -> tensor) placed as a sender places what it stores, or `TENSORS` as they are."""
    placed: dict = {}
    if stored is not None:
        lookup = lambda c, l, k: placed.get((l, k)) if c == "ctx" else None  # noqa: E731
    server = make_server(transport, lookup or (lambda c, l, k: TENSORS.get((l, k)) if c == "ctx" else None),
                         lambda req: issuer.verify(req.context_id, req.token), pin=pin)
    if stored is not None:
        placed.update(zip(stored, server.place(list(stored.values())), strict=True))
    address = await server.start()
    client = make_client(transport)
    try:
        return await body(client, address)
    finally:
        await client.close()
        await server.close()


def _pull_one(token: str, context: str = "ctx"):
    items = [PullItem(0, "K")]

    async def body(client, address):
        await client.pull(address, PullRequest(context_id=context, items=items, token=token), _buffers(items),
                          lambda *a: None, 10)

    return body


@pytest.mark.parametrize("transport", CHANNELS)
def test_items_arrive_in_request_order_and_intact(transport):
    """E first, then K/V by layer, each equal to the sender's tensor, in the caller's buffers."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    items = [PullItem(1, "E")] + [PullItem(l, k) for l in (0, 2) for k in "KV"]
    into = _buffers(items)
    got: list[tuple[PullItem, torch.Tensor]] = []

    async def body(client, address):
        return await client.pull(address, PullRequest(context_id="ctx", items=items, token=token), into,
                                 lambda it, t: got.append((it, t)), 10)

    nbytes = asyncio.run(_session(transport, issuer, body))
    assert [it for it, _ in got] == items
    assert all(t is buf for (_, t), buf in zip(got, into, strict=True))
    assert all(torch.equal(t, TENSORS[(it.layer, it.kind)]) for it, t in got)  # bitwise: the channel copies the stored bytes
    assert nbytes == sum(t.numel() * 4 for _, t in got)


@pytest.mark.parametrize("transport", CHANNELS)
def test_expired_token_is_refused(transport):
    """A token past its expiry is refused by the sender (TransferError naming unauthorized)."""
    clock = Clock()
    issuer = TokenIssuer(ttl_s=5, clock=clock)
    token, _ = issuer.issue("ctx")
    clock.t = 10
    with pytest.raises(TransferError, match="unauthorized: grant expired"):
        asyncio.run(_session(transport, issuer, _pull_one(token)))


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize("forge", ["missing", "tampered", "other-context", "other-sender"])
def test_forged_grants_are_refused(transport, forge):
    """On every channel a pull with no token, a tampered MAC, another context's token or another
    sender's token is refused as unauthorized, and no byte is delivered."""
    issuer = TokenIssuer(ttl_s=60)
    good, _ = issuer.issue("ctx")
    token = {"missing": "", "tampered": good[:-4] + "0000", "other-context": issuer.issue("other")[0],
             "other-sender": TokenIssuer(ttl_s=60).issue("ctx")[0]}[forge]
    delivered: list[PullItem] = []

    async def body(client, address):
        items = [PullItem(0, "K")]
        await client.pull(address, PullRequest(context_id="ctx", items=items, token=token), _buffers(items),
                          lambda it, t: delivered.append(it), 10)

    with pytest.raises(TransferError, match="unauthorized"):
        asyncio.run(_session(transport, issuer, body))
    assert delivered == []


@pytest.mark.parametrize("transport", CHANNELS)
def test_layout_mismatch_and_corruption_are_integrity_errors(transport, monkeypatch):
    """A tensor whose shape differs from the receiver's buffer, or (where bytes cross a wire) whose
    bytes do not match the header checksum, raises IntegrityError."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    wrong = {(0, "K"): torch.randn(1, 2, 32, 8)}
    with pytest.raises(IntegrityError, match="does not match the expected layout"):
        asyncio.run(_session(transport, issuer, _pull_one(token), lookup=lambda c, l, k: wrong.get((l, k))))
    if transport in ("shm", "nixl"):
        return  # no stream, no checksum: the sender's own sealed / registered memory, copied by the kernel or NIC

    module = importlib.import_module(registry.channel(transport).server.partition(":")[0])  # where the server answers
    name = "answer_async" if hasattr(module, "answer_async") else "answer"
    real = getattr(module, name)

    def corrupted(served):
        headers = [msgspec.structs.replace(h, checksum="0" * 16) for h in served.response.headers]
        return served._replace(response=msgspec.structs.replace(served.response, headers=headers))

    async def corrupt_async(*a, **kw):
        return corrupted(await real(*a, **kw))

    monkeypatch.setattr(module, name, corrupt_async if name == "answer_async" else lambda *a: corrupted(real(*a)))
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        asyncio.run(_session(transport, issuer, _pull_one(issuer.issue("ctx")[0])))  # a grant is single use


@pytest.mark.parametrize("transport", CHANNELS)
def test_unknown_context_is_refused(transport):
    """Pulling a context the sender does not hold is a TransferError, not a hang."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("gone")
    with pytest.raises(TransferError, match="does not hold gone"):
        asyncio.run(_session(transport, issuer, _pull_one(token, "gone")))


# -- hostile peers: nothing allocates from a peer's word, limits hold ---------------------------
def _stored_context(tokens: int = 33, layers: int = 3):
    """A CacheStore holding one context "ctx" of `layers` layers and E of layer 1."""
    from droidmesh.shared.holding.store import CacheStore
    from droidmesh.shared.kv.blocks import CapturedContext, KVBlock
    from droidmesh.shared.model.adapter import random_model
    from tests.conftest import FAMILIES

    fp = random_model("llama", **FAMILIES["llama"]).fingerprint
    kv = tuple(KVBlock(l, torch.randn(1, 2, tokens, 8), torch.randn(1, 2, tokens, 8)) for l in range(layers))
    store = CacheStore(budget_bytes=1 << 24)
    store.put("ctx", CapturedContext(tuple(range(tokens)), fp, "m", kv, {1: torch.randn(1, tokens, 16)}))
    return store


@pytest.mark.parametrize("transport", CHANNELS)
def test_a_prefix_pull_sends_only_the_tokens_asked_for(transport):
    """tokens=m: every header and payload is the first m tokens ([.., :m, ..]), the store's holds all released."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    store = _stored_context()
    items = [PullItem(1, "E"), PullItem(0, "K"), PullItem(0, "V"), PullItem(2, "K")]
    into = [torch.empty((1, 7, 16) if it.kind == "E" else (1, 2, 7, 8)) for it in items]

    async def body(client, address):
        return await client.pull(address, PullRequest(context_id="ctx", items=items, token=token, tokens=7), into,
                                 lambda *a: None, 10)

    nbytes = asyncio.run(_session(transport, issuer, body, lookup=store.tensor, pin=store.hold))
    assert nbytes == sum(b.numel() * 4 for b in into)
    for it, got in zip(items, into, strict=True):
        want = store.tensor("ctx", it.layer, it.kind)
        assert torch.equal(got, want[:, :7] if it.kind == "E" else want[:, :, :7])  # bitwise: the channel copies the stored bytes
    assert store.pull_bytes == 0 and store.orphaned_bytes == 0


@pytest.mark.parametrize("transport", CHANNELS)
@pytest.mark.parametrize("bad", ["too-many-tokens", "repeated", "too-many-items", "huge-layer", "long-codec"])
def test_hostile_requests_are_refused_before_any_lookup(transport, bad):
    """Repeated or too many items, layers or tokens out of range, oversize strings: refused as bad_message / transfer."""
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    k = PullItem(0, "K")
    req = {"too-many-tokens": lambda: PullRequest(context_id="ctx", items=[k], token=token, tokens=34),
           "repeated": lambda: PullRequest(context_id="ctx", items=[k] * 50, token=token),
           "too-many-items": lambda: PullRequest(context_id="ctx", items=[PullItem(l, "K") for l in range(4000)], token=token),
           "huge-layer": lambda: PullRequest(context_id="ctx", items=[PullItem(2**62, "K")], token=token),
           "long-codec": lambda: PullRequest(context_id="ctx", items=[k], token=token, codec="x" * 5000)}[bad]()

    async def body(client, address):
        await client.pull(address, req, _buffers(req.items)[:len(req.items)], lambda *a: None, 10)

    with pytest.raises(TransferError, match="bad_message|34 tokens|failed"):  # an error answer, or the connection closed
        asyncio.run(_session(transport, issuer, body))


def test_a_pull_that_never_drains_keeps_counting_against_the_store():
    """Tensors a pull holds stay in the store's budget after eviction, until the pull releases them."""
    from droidmesh.shared.errors import BadRequestError

    store = _stored_context()
    one = store.budget = store.nbytes
    ctx = store.get("ctx")
    hold = store.hold("ctx")
    with pytest.raises(BadRequestError, match="held by pulls still in flight"):
        store.put("other", _stored_context().get("ctx"))  # evicting ctx would free nothing: refused
    store.budget = 2 * one
    store.put("ctx", _stored_context().get("ctx"))  # replaced while held: the old tensors still count
    assert store.orphaned_bytes == one and store.nbytes + store.orphaned_bytes <= store.budget
    assert store.put("other", ctx) == ["ctx"]  # room comes from unpinned contexts only
    assert store.nbytes + store.orphaned_bytes == store.budget
    hold.release()
    assert store.orphaned_bytes == 0 and store.resident_bytes == one


def test_ucx_a_declared_oversize_request_ends_only_its_connection():
    """After a granted first pull, 16 bytes declaring a 256 MiB request: the connection's sandbox
    refuses it on the declared size (`ops.recv_frame` checks it before allocating) and the
    endpoint closes; the server keeps serving others."""
    import array

    issuer = TokenIssuer(ttl_s=60)
    first, again = issuer.issue("ctx")[0], issuer.issue("ctx")[0]

    async def body(client, address):
        await _pull_one(first)(client, address)  # wires the endpoint up
        ep = client._conns[address].ep  # the wired endpoint, spoken to by hand
        await ep.send(array.array("Q", [256 << 20]))
        await ep.send(array.array("Q", [0]))
        closed = False
        try:
            async with asyncio.timeout(20):  # a bound on a hang, not a timing claim
                await ep.recv(array.array("Q", [0]))
        except Exception:
            closed = True
        await _pull_one(again)(make_client("ucx"), address)  # the server still serves
        return closed

    assert asyncio.run(_session("ucx", issuer, body))


def test_nixl_control_listener_binds_only_the_configured_host():
    """The NIXL control socket listens on the configured host's address, not on every interface."""
    async def session():
        server = make_server("nixl", lambda c, l, k: None, None, host="127.0.0.1")
        await server.start()
        try:
            return {s.getsockname()[0] for s in server._listener._server.sockets}
        finally:
            await server.close()

    assert asyncio.run(session()) == {"127.0.0.1"}


_LISTEN_PROBE = """
import asyncio, json
import psutil
from droidmesh.shared.transport.bulk import make_server

async def session():
    server = make_server("ucx", lambda c, l, k: None, None, host="127.0.0.1")
    address = await server.start()
    try:
        return address, sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                                if c.status == psutil.CONN_LISTEN})
    finally:
        await server.close()

print("LISTEN " + json.dumps(asyncio.run(session())))
"""


def test_ucx_server_listens_only_on_the_configured_host():
    """Every socket the UCX server's process listens on (its wireup socket, UCX's own tcp transport)
    is on the configured loopback host, none on a wildcard or another interface. In a process of
    its own: UCX's devices are restricted when the first server initialises ucxx, and a test run
    earlier in this process may have initialised it already."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LISTEN_PROBE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("LISTEN ")), None)
    assert line is not None, out.stderr[-2000:]
    address, listening = json.loads(line.removeprefix("LISTEN "))
    listening = {(ip, port) for ip, port in listening}
    assert ("127.0.0.1", int(address.rsplit(":", 1)[1])) in listening
    assert {ip for ip, _ in listening} == {"127.0.0.1"}


def test_poisoned_kv_pulled_over_a_channel_is_an_integrity_error(receiver, prompt):
    """NaN KV with a valid checksum, pulled over inproc into the receiver's prefix buffers, fails the engine's read (fallback)."""
    from droidmesh.shared.errors import IntegrityError
    from droidmesh.shared.holding.store import CacheStore
    from droidmesh.shared.kv.capture import capture_prefill
    from droidmesh.shared.kv.partial import prefill
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.device import dtype_name
    from droidmesh.shared.transport.pull import pull_into, pull_items, source_for
    from droidmesh.shared.wire import schemas

    ctx, q = prompt
    cap = capture_prefill(receiver, ctx + [7, 7, 7])  # the holder's context is longer than the reusable prefix
    v = cap.kv[3].v.clone()
    v[0, 0, 1, 2] = float("nan")
    kv = list(cap.kv)
    kv[3] = dataclasses.replace(kv[3], v=v)
    cap = dataclasses.replace(cap, kv=tuple(kv))
    store = CacheStore(budget_bytes=1 << 28)
    store.put("ctx", cap)
    issuer = TokenIssuer(ttl_s=60)
    holder = schemas.CacheAvailable(
        sender_id="s", model_id="m", model_sha256="", fingerprint=schemas.fingerprint_to_wire(cap.fingerprint),
        fingerprint_id=cap.fingerprint.id, context_id="ctx", token_ids=list(cap.token_ids), dtype=dtype_name(receiver.dtype),
        kv_nbytes=cap.kv_nbytes(), e_layers=[], e_nbytes=0, transport="inproc", address="", published_at=0.0)
    plan = ReusePlan.full_reuse()

    async def pull():
        server = make_server("inproc", store.tensor, lambda req: issuer.verify(req.context_id, req.token), pin=store.hold)
        address = await server.start()
        source = source_for(msgspec.structs.replace(holder, address=address), ctx + q)
        try:
            n = await pull_into(make_client("inproc"), msgspec.structs.replace(holder, address=address),
                                pull_items(plan, receiver.num_layers), receiver, source, 10, token=issuer.issue("ctx")[0])
        finally:
            await server.close()
        return source, n

    source, n = asyncio.run(pull())
    m = len(ctx)
    assert len(source.token_ids) == m and n == 2 * receiver.num_layers * tuple_numel(receiver.kv_shape(m)) * 4
    with pytest.raises(IntegrityError, match="layer 3 V: values out of range"):
        prefill(receiver, ctx + q, plan, source)


def tuple_numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_malformed_bytes_from_a_holder_mean_fallback_not_a_bad_request(receiver, prompt):
    """A channel that raises `BadMessageError` (what the nixl and shm clients raise on a peer's
    malformed frame) surfaces from `pull_into` as a `TransferError`, a `ReuseError`: the receiver
    falls back to its own prefill instead of answering its client that the request was bad."""
    from droidmesh.shared.errors import BadMessageError, ReuseError
    from droidmesh.shared.kv.plan import ReusePlan
    from droidmesh.shared.model.device import dtype_name
    from droidmesh.shared.transport.pull import pull_into, pull_items
    from droidmesh.shared.wire import schemas

    class Hostile:
        transport = "inproc"

        async def pull(self, *args, **kwargs):
            raise BadMessageError("frame header: 7 items announced, 2 asked for")

    ctx, _ = prompt
    fp = receiver.fingerprint
    holder = schemas.CacheAvailable(
        sender_id="s", model_id="m", model_sha256="", fingerprint=schemas.fingerprint_to_wire(fp), fingerprint_id=fp.id,
        context_id="ctx", token_ids=list(ctx), dtype=dtype_name(receiver.dtype), kv_nbytes=0, e_layers=[], e_nbytes=0,
        transport="inproc", address="x", published_at=0.0)
    with pytest.raises(TransferError, match="sender s sent a malformed reply") as raised:
        asyncio.run(pull_into(Hostile(), holder, pull_items(ReusePlan.full_reuse(), receiver.num_layers), receiver,
                              None, 10, token="t"))
    assert isinstance(raised.value, ReuseError)


# -- a pull's encoding never stalls the sender ---------------------------------------------------
class _GatedCodec:
    """raw bytes, copied; each encode first waits (at most GATE_S) for `gate`, which the test sets
    from the event loop: it is set in time only if the loop runs while the encode waits."""

    name = "test-gated"
    GATE_S = 20.0

    def __init__(self):
        self.started, self.gate = threading.Event(), threading.Event()
        self.saw: list[bool] = []

    def encode(self, t, params):
        self.started.set()
        self.saw.append(self.gate.wait(self.GATE_S))
        return codecs.payload_view(t).clone(), {}

    def decode(self, payload, header, out):
        codecs.RawCodec().decode(payload, header, out)

    def max_nbytes(self, shape, dtype, params):
        return codecs.nbytes_of(shape, dtype)


@pytest.fixture
def gated():
    codec = _GatedCodec()
    codecs.register(codec)
    yield codec
    codecs.unregister(codec.name)


@pytest.mark.parametrize("transport", ["ucx", "nixl"])
def test_while_a_pull_is_encoded_the_sender_serves_other_pulls(transport, gated):
    """A pull whose encoding takes a while (quantizing, copying device memory to the host) does not
    hold the sender's event loop: another receiver's pull is granted and served meanwhile, and the
    first then completes intact."""
    issuer = TokenIssuer(ttl_s=60)
    (slow_token, _), (fast_token, _) = issuer.issue("ctx"), issuer.issue("ctx")
    items = [PullItem(0, "K")]
    slow_into, fast_into = _buffers(items), _buffers(items)

    async def body(client, address):
        other = make_client(transport)
        try:
            slow = asyncio.ensure_future(client.pull(
                address, PullRequest(context_id="ctx", items=items, token=slow_token, codec=gated.name),
                slow_into, lambda *a: None, 60))
            await asyncio.to_thread(gated.started.wait, 30)
            await other.pull(address, PullRequest(context_id="ctx", items=items, token=fast_token), fast_into,
                             lambda *a: None, 30)
        finally:
            gated.gate.set()  # whatever happened, the encode goes on (a failed pull fails the test now)
            await other.close()
        await slow

    asyncio.run(_session(transport, issuer, body))
    assert gated.saw == [True]
    for got in (slow_into[0], fast_into[0]):
        assert torch.equal(got, TENSORS[(0, "K")])  # bitwise: both channels copy the stored bytes


class _LoopGatedDecode:
    """raw bytes, copied; each decode first asks the receiving loop to set an event and waits for it
    (at most GATE_S): set in time only if the loop runs while the decode waits."""

    name = "test-loop-gated-decode"
    GATE_S = 5.0

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.saw: list[bool] = []

    def encode(self, t, params):
        return codecs.payload_view(t).clone(), {}

    def decode(self, payload, header, out):
        ran = threading.Event()
        self.loop.call_soon_threadsafe(ran.set)
        self.saw.append(ran.wait(self.GATE_S))
        codecs.RawCodec().decode(payload, header, out)

    def max_nbytes(self, shape, dtype, params):
        return codecs.nbytes_of(shape, dtype)


@pytest.mark.parametrize("transport", ["ucx", "nixl"])
def test_a_receiver_decodes_landed_items_off_its_loop(transport):
    """A landed item is decoded on a decoding thread, not on the receiving loop: a receiver's other
    requests (its token streams, NATS) go on while a plan is dequantized."""
    codec = _LoopGatedDecode()
    codecs.register(codec)
    issuer = TokenIssuer(ttl_s=60)
    token, _ = issuer.issue("ctx")
    items = [PullItem(0, "K"), PullItem(1, "V")]
    into = _buffers(items)

    async def body(client, address):
        codec.loop = asyncio.get_running_loop()
        await client.pull(address, PullRequest(context_id="ctx", items=items, token=token, codec=codec.name), into,
                          lambda *a: None, 30)

    try:
        asyncio.run(_session(transport, issuer, body))
    finally:
        codecs.unregister(codec.name)
    assert codec.saw == [True] * len(items)
    assert all(torch.equal(t, TENSORS[(it.layer, it.kind)]) for it, t in zip(items, into, strict=True))  # bitwise: copied bytes
