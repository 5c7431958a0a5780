"""One answer as it is decoded: stop sequences, and streamed chunks in order (used by the receiver).

Threads: `on_token` runs on the torch thread (the engine calls it after each chosen token); it
decodes incrementally (`text.TextStream`) and, when the request has a `stream_subject`, hands each
new `GenerateChunk` to the event loop with `loop.call_soon_threadsafe(queue.put_nowait, ...)`.
Callbacks scheduled that way run in the order they were scheduled, and ONE publisher task per
request drains the queue, so chunks are published in index order. A publish that fails is logged
and counted, never raised: the final GenerateReply carries the whole text anyway. `close` (on the
loop, after decoding) flushes the held-back text as a last chunk and waits until every chunk has
been handed to the bus, so no chunk is published after the reply; `abort` drops what is queued.
"""

from __future__ import annotations

import asyncio

import structlog
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.model.text import TextStream
from droidmesh.shared.wire import schemas

log = structlog.get_logger("receiver")


class AnswerStream:
    def __init__(self, bus: Bus, tokenizer: object, req: schemas.GenerateRequest) -> None:
        self.bus, self.request_id, self.subject = bus, req.request_id, req.stream_subject
        self.text = TextStream(tokenizer, req.sampling.stop)
        self.tokens = 0  # tokens seen by on_token (all attempts)
        self.published = 0  # chunks handed to the bus
        self.failed = 0  # chunks whose publish raised
        self._index = 0  # next chunk's index (written on the torch thread, then on the loop after decoding)
        self._pending: list[int] = []  # token ids not yet carried by a chunk
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[schemas.GenerateChunk | None] = asyncio.Queue()
        self._task = self._loop.create_task(self._publish()) if self.subject else None

    def on_token(self, token_id: int) -> bool:
        """The engine's per-token callback (torch thread): False once a stop sequence occurred."""
        self.tokens += 1
        self._pending.append(token_id)
        delta, stopped = self.text.push(token_id)
        if delta:
            self._chunk(delta)
        return not stopped

    def _chunk(self, delta: str) -> None:
        ids, self._pending = self._pending, []
        if self._task is None:
            return
        chunk = schemas.GenerateChunk(request_id=self.request_id, index=self._index, text=delta, token_ids=ids)
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
        return self.text.text

    def abort(self) -> None:
        """The request failed: stop publishing (chunks still queued are dropped)."""
        if self._task is not None:
            self._task.cancel()

    async def _publish(self) -> None:
        while (chunk := await self._queue.get()) is not None:
            try:
                await self.bus.publish(self.subject, schemas.encode(chunk))
                self.published += 1
            except Exception as e:  # the client completes from the reply; the request goes on
                self.failed += 1
                if self.failed == 1:
                    log.warning("chunk_publish_failed", request_id=self.request_id, index=chunk.index, error=repr(e))
