"""A client of the mesh: ask a receiver, or have a sender prefill a context (used by the CLI,
the demo, the benchmarks and the system tests)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from droidmesh.shared.bus import Bus, NatsBus
from droidmesh.shared.errors import DroidMeshError
from droidmesh.shared.wire import schemas, subjects


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
        return cls(await NatsBus.connect(url, "droidmesh-client", "0.1.0", **options))

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

    async def ask(self, receiver: str, context: str, question: str, *, max_new_tokens: int = 32,
                  mode: schemas.Mode = "auto", timeout: float = 60.0, request_id: str | None = None,
                  attempt_s: float | None = None, ttft_slo_ms: float = 0.0) -> schemas.GenerateReply:
        req = schemas.GenerateRequest(request_id=request_id or uuid.uuid4().hex[:12], context=context,
                                      question=question, max_new_tokens=max_new_tokens, mode=mode,
                                      deadline=time.time() + timeout, ttft_slo_ms=ttft_slo_ms)
        return await self._call(subjects.receiver_generate(receiver), req, schemas.GenerateReply, timeout, attempt_s)

    async def sender_generate(self, sender: str, context: str, question: str, *, max_new_tokens: int = 32,
                              timeout: float = 60.0) -> schemas.GenerateReply:
        req = schemas.GenerateRequest(request_id=uuid.uuid4().hex[:12], context=context, question=question,
                                      max_new_tokens=max_new_tokens, deadline=time.time() + timeout)
        return await self._call(subjects.sender_generate(sender), req, schemas.GenerateReply, timeout)

    async def prefill(self, sender: str, context: str, *, timeout: float = 60.0) -> schemas.PrefillReply:
        req = schemas.PrefillRequest(request_id=uuid.uuid4().hex[:12], context=context)
        return await self._call(subjects.sender_prefill(sender), req, schemas.PrefillReply, timeout)

    async def lookup(self, token_ids: list[int], fingerprint_id: str, timeout: float = 5.0) -> schemas.LookupReply:
        req = schemas.LookupRequest(token_ids=token_ids, fingerprint_id=fingerprint_id)
        return await self._call(subjects.BROKER_LOOKUP, req, schemas.LookupReply, timeout)

    async def close(self) -> None:
        await self.bus.close()
