"""One answer as it is decoded: stop sequences, and streamed chunks in order (used by the receiver).

Threads: `on_token` runs on the torch thread (the engine calls it after each chosen token); it
decodes incrementally (`text.TextStream`) and, when the request has a `stream_subject`, hands each
new `GenerateChunk` to the event loop with `loop.call_soon_threadsafe(queue.put_nowait, ...)`.
Callbacks scheduled that way run in the order they were scheduled, and ONE publisher task per
request drains the queue, so chunks are published in index order. A publish that fails is logged
and counted, never raised: the final GenerateReply carries the whole text anyway. `close` (on the
loop, after decoding) flushes the held-back text as a last chunk and waits until every chunk has
been handed to the bus, so no chunk is published after the reply; `abort` drops what is queued.

A stream nobody listens to any more stops decoding (`ListenerWatch`): the client that asked
closed its stream inbox (it left, or its connection died), so every further token is wasted
work that holds the compute thread and a queue slot. The request then fails `client_gone`
(its log line says `cancelled` with the tokens decoded) instead of being answered.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import structlog

from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.text import TextStream
from droidmesh.shared.wire import schemas
from droidmesh.shared.wire.generation import GenerateChunk, GenerateRequest

log = structlog.get_logger("receiver")
NO_RESPONDERS = "503"  # the NATS status of a message with a reply subject that reached no subscriber


class ClientGoneError(DroidMeshError):
    """A streamed request's listener left; decoding stopped early and no answer is sent."""

    code = "client_gone"


class ListenerWatch:
    """Notices a stream whose listener has gone, with nothing but NATS itself: each chunk is
    published with a reply subject under one subscription of this receiver's own inbox, and the
    server answers a message that reached no subscriber with a no-responders status on that reply
    subject. So the first chunk after a client closed its stream inbox (or lost its connection,
    when it could not have sent anything) marks the stream gone; no message from the client and no
    permission beyond the receiver's own inbox is needed. One subscription per receiver process."""

    def __init__(self, nc: Any, prefix: str) -> None:
        self._nc, self._prefix = nc, prefix
        self._streams: dict[str, AnswerStream] = {}  # reply subject -> its stream, while it runs
        self._ids = itertools.count()

    @classmethod
    async def open(cls, bus: Bus) -> ListenerWatch | None:
        """A watch over `bus`'s NATS connection; None on a bus without one (in-process, tests)."""
        nc = getattr(bus, "nc", None)
        if nc is None:
            return None
        watch = cls(nc, nc.new_inbox())
        await nc.subscribe(f"{watch._prefix}.*", cb=watch._on_status)
        return watch

    def enroll(self, stream: AnswerStream) -> str:
        reply = f"{self._prefix}.{next(self._ids)}"
        self._streams[reply] = stream
        return reply

    def leave(self, reply: str) -> None:
        self._streams.pop(reply, None)

    async def publish(self, subject: str, data: bytes, reply: str) -> None:
        await self._nc.publish(subject, data, reply=reply)

    async def _on_status(self, msg: Any) -> None:
        if (msg.headers or {}).get("Status") == NO_RESPONDERS:
            stream = self._streams.get(msg.subject)
            if stream is not None:
                stream.listener_gone()


class AnswerStream:
    def __init__(self, bus: Bus, tokenizer: object, req: GenerateRequest,
                 watch: ListenerWatch | None = None) -> None:
        self.bus, self.request_id, self.subject = bus, req.request_id, req.stream_subject
        self.text = TextStream(tokenizer, req.sampling.stop)
        self.tokens = 0  # tokens seen by on_token (all attempts)
        self.published = 0  # chunks handed to the bus
        self.failed = 0  # chunks whose publish raised
        self.gone = False  # the stream's listener left: decoding stops at the next token
        self._index = 0  # next chunk's index (written on the torch thread, then on the loop after decoding)
        self._pending: list[int] = []  # token ids not yet carried by a chunk
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[GenerateChunk | None] = asyncio.Queue()
        self._task = self._loop.create_task(self._publish()) if self.subject else None
        self._watch = watch if self.subject else None
        self._reply = self._watch.enroll(self) if self._watch is not None else ""

    def on_token(self, token_id: int) -> bool:
        """The engine's per-token callback (torch thread): False once a stop sequence occurred or
        the stream's listener left."""
        self.tokens += 1
        self._pending.append(token_id)
        delta, stopped = self.text.push(token_id)
        if delta:
            self._chunk(delta)
        return not stopped and not self.gone

    def listener_gone(self) -> None:
        """(loop) Nobody receives this stream any more: stop decoding and publishing."""
        if not self.gone:
            self.gone = True
            log.info("stream_listener_gone", request_id=self.request_id, tokens=self.tokens)

    def _chunk(self, delta: str) -> None:
        ids, self._pending = self._pending, []
        if self._task is None:
            return
        chunk = GenerateChunk(request_id=self.request_id, index=self._index, text=delta, token_ids=ids)
        self._index += 1
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    async def close(self) -> str:
        """After decoding (on the loop): flush the held-back text, wait for every chunk to be
        published; return the final text (ending before any stop sequence)."""
        delta = self.text.finish()
        if delta:
            self._chunk(delta)
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, None)  # after every chunk scheduled above
            await self._task
        self._leave()
        return self.text.text

    def abort(self) -> None:
        """The request failed: stop publishing (chunks still queued are dropped)."""
        if self._task is not None:
            self._task.cancel()
        self._leave()

    def _leave(self) -> None:
        if self._watch is not None:
            self._watch.leave(self._reply)

    async def _publish(self) -> None:
        while (chunk := await self._queue.get()) is not None:
            if self.gone:
                continue  # nobody would receive it
            try:
                data = schemas.encode(chunk)
                if self._watch is not None:
                    await self._watch.publish(self.subject, data, self._reply)
                else:
                    await self.bus.publish(self.subject, data)
                self.published += 1
            except Exception as e:  # the client completes from the reply; the request goes on
                self.failed += 1
                if self.failed == 1:
                    log.warning("chunk_publish_failed", request_id=self.request_id, index=chunk.index, error=repr(e))
