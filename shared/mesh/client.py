"""A client of the mesh: ask a receiver (whole, or streamed chunk by chunk), list the receivers,
or have a sender prefill a context (used by the CLI, the gateway, the demo, the benchmarks and the
system tests)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from droidmesh.shared import __version__
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.mesh import discovery
from droidmesh.shared.mesh.bus import Bus, NatsBus
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.generation import GenerateChunk, GenerateRequest, Sampling
from droidmesh.shared.wire.hashing import PUBLIC, check_scope

MAX_BUFFERED_CHUNKS = 4096  # chunks held while an earlier index is missing (bounds a flooded inbox)


class MeshError(DroidMeshError):
    """A service answered with an ErrorReply."""

    def __init__(self, reply: schemas.ErrorReply):
        self.code = reply.code
        super().__init__(f"{reply.code}: {reply.message}")


class MeshClient:
    def __init__(self, bus: Bus):
        self.bus = bus

    @classmethod
    async def connect(cls, url: str, **options: Any) -> MeshClient:
        """A client on NATS at `url` (comma-separated servers); a user's replies go to its own
        inbox prefix, the only one NATS lets it read (see infra/nats/nats-auth.conf)."""
        if options.get("user"):
            options.setdefault("inbox_prefix", subjects.inbox_prefix(options["user"]))
        return cls(await NatsBus.connect(url, "droidmesh-client", __version__, **options))

    async def _call(self, subject: str, msg: schemas.Message, kind: type, timeout: float,
                    attempt_s: float | None = None) -> Any:
        """Request until answered or `timeout` passes. With `attempt_s`, a silent attempt (the
        server restarting, a responder gone) is retried with the same message: requests carry
        ids and services answer duplicates once, so retrying never does the work twice."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                data = await self.bus.request(subject, schemas.encode(msg), timeout=min(left, attempt_s or left))
                break
            except TimeoutError:
                if attempt_s is None or deadline - time.monotonic() <= 0:
                    raise
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))  # back off, then retry
        try:
            return schemas.decode(data, kind)
        except DroidMeshError:
            raise MeshError(schemas.decode(data, schemas.ErrorReply)) from None

    @staticmethod
    def _generate_request(context: str, question: str, *, max_new_tokens: int, mode: schemas.Mode, timeout: float,
                          request_id: str | None, ttft_slo_ms: float, sampling: Sampling | None,
                          chat: list[schemas.ChatMessage] | None, stream_subject: str = "",
                          scope: str = PUBLIC, n: int = 1) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id or uuid.uuid4().hex[:12], context=context, question=question,
            max_new_tokens=max_new_tokens, mode=mode, deadline=time.time() + timeout, ttft_slo_ms=ttft_slo_ms,
            sampling=sampling if sampling is not None else Sampling(), chat=chat,
            stream_subject=stream_subject, budget_s=timeout, scope=check_scope(scope), n=n)

    async def ask(self, receiver: str, context: str, question: str, *, max_new_tokens: int = 32,
                  mode: schemas.Mode = "auto", timeout: float = 60.0, request_id: str | None = None,
                  attempt_s: float | None = None, ttft_slo_ms: float = 0.0, sampling: Sampling | None = None,
                  chat: list[schemas.ChatMessage] | None = None, scope: str = PUBLIC, n: int = 1
                  ) -> schemas.GenerateReply:
        """One answer. A completions-style prompt is `context=prompt, question=""`; a chat passes
        `chat` (then context and question are ""). `scope`: whose cached contexts it may reuse
        (`shared.wire.hashing`; BadRequestError when malformed). `n` > 1: the reply's `samples`
        carry the answer's other samples."""
        req = self._generate_request(context, question, max_new_tokens=max_new_tokens, mode=mode, timeout=timeout,
                                     request_id=request_id, ttft_slo_ms=ttft_slo_ms, sampling=sampling, chat=chat,
                                     scope=scope, n=n)
        return await self._call(subjects.receiver_generate(receiver), req, schemas.GenerateReply, timeout, attempt_s)

    async def stream(self, receiver: str, context: str, question: str, *, max_new_tokens: int = 32,
                     mode: schemas.Mode = "auto", timeout: float = 60.0, request_id: str | None = None,
                     ttft_slo_ms: float = 0.0, sampling: Sampling | None = None,
                     chat: list[schemas.ChatMessage] | None = None, scope: str = PUBLIC
                     ) -> AsyncIterator[GenerateChunk | schemas.GenerateReply]:
        """`ask`, streamed: the answer's chunks in index order as they arrive, then exactly one
        GenerateReply (its text is the whole answer: indices skip only where a chunk was lost).
        An ErrorReply raises MeshError, no reply within `timeout` raises TimeoutError; the inbox is
        always unsubscribed (close the iterator, e.g. `contextlib.aclosing`, when leaving early).

        Chunks ride a fresh inbox; the reply rides the request's own inbox. The receiver publishes
        every chunk before its reply over one connection, and NATS keeps one publisher's order, so
        when the reply is in, every chunk has been delivered into this inbox: draining what is
        pending then loses none, without waiting.

        Closing the iterator early (or losing the connection) unsubscribes the inbox, and that is
        what cancels the request: the receiver publishes each chunk with a reply subject of its
        own, NATS answers a chunk nobody receives with "no responders", and the receiver stops
        decoding there (`services/receiver/answer_stream.py`). No cancel message is needed, so a
        client that died mid-stream cancels too."""
        inbox = await _Inbox.open(self.bus)
        try:
            req = self._generate_request(context, question, max_new_tokens=max_new_tokens, mode=mode,
                                         timeout=timeout, request_id=request_id, ttft_slo_ms=ttft_slo_ms,
                                         sampling=sampling, chat=chat, stream_subject=inbox.subject, scope=scope)
            order = _InOrder(req.request_id)
            call = asyncio.ensure_future(self._call(subjects.receiver_generate(receiver), req, schemas.GenerateReply,
                                                    timeout))
            try:
                while not call.done():
                    got = asyncio.ensure_future(inbox.get())
                    await asyncio.wait({got, call}, return_when=asyncio.FIRST_COMPLETED)
                    if got.done():
                        for chunk in order.add(got.result()):
                            yield chunk
                    else:
                        got.cancel()
                        await asyncio.gather(got, return_exceptions=True)
                reply = call.result()  # raises MeshError / TimeoutError
                for data in await inbox.drain():
                    for chunk in order.add(data):
                        yield chunk
                for chunk in order.rest():
                    yield chunk
                yield reply
            finally:
                if not call.done():
                    call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        finally:
            await inbox.close()

    async def receivers(self, window_s: float = 0.5) -> list[discovery.ReceiverModel]:
        """The receiver models answering discovery within `window_s` (blocks that long)."""
        nc = getattr(self.bus, "nc", None)
        if nc is None:
            raise DroidMeshError("receiver discovery needs a NATS bus")
        return await discovery.receivers(nc, window_s)

    async def sender_generate(self, sender: str, context: str, question: str, *, max_new_tokens: int = 32,
                              timeout: float = 60.0, scope: str = PUBLIC) -> schemas.GenerateReply:
        req = GenerateRequest(request_id=uuid.uuid4().hex[:12], context=context, question=question,
                              max_new_tokens=max_new_tokens, deadline=time.time() + timeout,
                              scope=check_scope(scope))
        return await self._call(subjects.sender_generate(sender), req, schemas.GenerateReply, timeout)

    async def prefill(self, sender: str, context: str, *, timeout: float = 60.0,
                      chat: list[schemas.ChatMessage] | None = None, scope: str = PUBLIC) -> schemas.PrefillReply:
        """Have `sender` cache `context`, or with `chat` (context "") the token prefix every chat
        opening with those messages shares (`schemas.PrefillRequest`), for requests of `scope`
        (and, when `public`, for every request)."""
        req = schemas.PrefillRequest(request_id=uuid.uuid4().hex[:12], context=context, chat=chat,
                                     scope=check_scope(scope))
        return await self._call(subjects.sender_prefill(sender), req, schemas.PrefillReply, timeout)

    async def lookup(self, token_ids: list[int], fingerprint_id: str, timeout: float = 5.0,
                     scope: str = PUBLIC) -> schemas.LookupReply:
        req = schemas.LookupRequest(token_ids=token_ids, fingerprint_id=fingerprint_id, scope=check_scope(scope))
        return await self._call(subjects.BROKER_LOOKUP, req, schemas.LookupReply, timeout)

    async def close(self) -> None:
        await self.bus.close()


class _InOrder:
    """Chunks of one request in index order: anything that is not a GenerateChunk of this request
    (peer data on an inbox), or repeats an index, is dropped; later indices wait for the gap."""

    def __init__(self, request_id: str) -> None:
        self.request_id, self.next, self.held = request_id, 0, dict[int, GenerateChunk]()

    def add(self, data: bytes) -> list[GenerateChunk]:
        try:
            chunk = schemas.decode(data, GenerateChunk)
        except DroidMeshError:
            return []
        if chunk.request_id != self.request_id or chunk.index < self.next or chunk.index in self.held \
                or len(self.held) >= MAX_BUFFERED_CHUNKS:
            return []
        self.held[chunk.index] = chunk
        ready = []
        while self.next in self.held:
            ready.append(self.held.pop(self.next))
            self.next += 1
        return ready

    def rest(self) -> list[GenerateChunk]:
        """What is still held once the reply is in (a chunk before them was lost), in order."""
        ready = [self.held[i] for i in sorted(self.held)]
        self.held.clear()
        return ready


class _Inbox:
    """A fresh subject to receive one stream on. Over NATS: `nc.new_inbox()` and a subscription
    without a callback (messages queue in the reader's order, see `MeshClient.stream`). On any
    other bus (the in-process one, tests): a unique `_INBOX.` subject and the bus's subscribe;
    draining first lets the bus deliver what it has in flight (`settle`), and the handler, which
    that bus cannot remove, is left on a subject nobody publishes to again."""

    def __init__(self, subject: str, get: Callable[[], Coroutine[Any, Any, bytes]],
                 drain: Callable[[], Coroutine[Any, Any, list[bytes]]],
                 close: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.subject, self.get, self.drain, self.close = subject, get, drain, close

    @classmethod
    async def open(cls, bus: Bus) -> _Inbox:
        nc = getattr(bus, "nc", None)
        if nc is not None:
            sub = await nc.subscribe(nc.new_inbox())

            async def get() -> bytes:
                return (await sub.next_msg(timeout=None)).data

            async def drain() -> list[bytes]:
                return [(await sub.next_msg(timeout=None)).data for _ in range(sub.pending_msgs)]

            async def close() -> None:
                try:
                    await sub.unsubscribe()
                except Exception:  # connection closed meanwhile: nothing left to unsubscribe from
                    pass

            return cls(sub.subject, get, drain, close)
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        async def deliver(data: bytes) -> None:
            queue.put_nowait(data)

        async def settle_and_drain() -> list[bytes]:
            settle = getattr(bus, "settle", None)
            if settle is not None:
                await settle()
            return [queue.get_nowait() for _ in range(queue.qsize())]

        async def nothing() -> None:
            return None

        subject = f"{subjects.INBOX_PREFIX}.{uuid.uuid4().hex}"
        await bus.subscribe(subject, deliver)
        return cls(subject, queue.get, settle_and_drain, nothing)
