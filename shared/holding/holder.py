"""The holder role: keep captured contexts and let other processes pull them.

A sender holds what it prefills; a receiver holds what it computed by its own full prefill, so the
next request over the same text (to that model, or to one that has a pair config with it) reuses it
without a `prefill` command. Either way one `Holder` does the same things under one id:
  - `put`: store a context (`store.CacheStore`: byte budget, LRU eviction, pins by pulls), publish
    the evictions, and announce it: the availability event (token ids and all) to the broker, the
    bulk endpoint to receivers, which warm a connection from it;
  - `grant`: a single-use pull grant, only to readers of the context's model (`grants.py`);
  - heart-beats listing what is held, re-announcements when a broker says hello, and eviction
    events for everything at stop (`withdraw`).

One holder may hold contexts of several models (a receiver serving a base and its adapters from one
copy of the weights): each context is announced with its own model id and weights hash, and its
grants follow its own model's readers; the caller names it (a sender by `context_id`, a receiver
by `held_context_id`, which hashes the weights in: two models' caches of the same tokens are two
contexts). Touched on the event loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence

import structlog
import torch

from droidmesh.shared.errors import TransferError
from droidmesh.shared.holding import grants
from droidmesh.shared.holding.grants import Readers
from droidmesh.shared.holding.store import CacheStore
from droidmesh.shared.kv import policy
from droidmesh.shared.kv.blocks import CapturedContext, tensor_nbytes
from droidmesh.shared.mesh.bus import Bus
from droidmesh.shared.mesh.caller import user_of
from droidmesh.shared.model.device import dtype_name
from droidmesh.shared.service.metrics import Metrics
from droidmesh.shared.service.wrappers import event, rpc
from droidmesh.shared.transport.bulk import BulkServer
from droidmesh.shared.transport.tokens import TokenIssuer
from droidmesh.shared.wire import schemas, subjects
from droidmesh.shared.wire.channels import SenderEndpoint
from droidmesh.shared.wire.hashing import PUBLIC, common_prefix

log = structlog.get_logger("holder")
REANNOUNCE_GAP_S = 0.01  # 100 events/s: half the broker's default sender_events_per_s


@dataclasses.dataclass
class HeldModel:
    """A model whose contexts this holder keeps: its weights hash, who may read them, and the E
    layers the pair configs naming it as the sender may use (per receiver model)."""

    model_id: str
    sha256: str
    dtype: torch.dtype
    readers: Readers
    profiled_e: dict[str, set[int]] = dataclasses.field(default_factory=dict)

    def e_layers(self, configured: Sequence[int], num_layers: int) -> list[int]:
        """`configured` plus every group start and patch layer a profiled receiver may choose."""
        return sorted(l for l in set(configured).union(*self.profiled_e.values()) if 0 <= l < num_layers)


class Holder:
    """Contexts held under `holder_id` (a sender's id; a receiver's `holder_id`)."""

    def __init__(self, holder_id: str, bus: Bus, store: CacheStore, metrics: Metrics, *, grant_ttl_s: float,
                 heartbeat_s: float, authenticated: bool):
        self.id, self.bus, self.store, self.metrics = holder_id, bus, store, metrics
        self.heartbeat_s, self.authenticated = heartbeat_s, authenticated
        self.tokens = TokenIssuer(grant_ttl_s)
        self.models: dict[str, HeldModel] = {}
        self.transport: schemas.Transport = "ucx"  # set once the bulk server listens (`start`)
        self.address = ""
        # the bulk server's `place`: a context's tensors where its channel serves them from
        self.place: Callable[[list[torch.Tensor]], list[torch.Tensor]] = list
        metrics.store_bytes.set_function(lambda: self.store.resident_bytes)  # pulls' pinned tensors and copies too
        metrics.store_contexts.set_function(lambda: len(self.store.ids()))
        metrics.store_device_bytes.set_function(lambda: self.store.device_bytes)

    def add_model(self, model_id: str, sha256: str, dtype: torch.dtype, readers: Sequence[str] = ()) -> HeldModel:
        held = self.models[model_id] = HeldModel(model_id, sha256, dtype, Readers(model_id, tuple(readers)))
        return held

    async def start(self, server: BulkServer) -> None:
        """Listen on `server` (built over this holder's store), answer grants and broker hellos."""
        self.transport, self.address = server.transport, await server.start()
        self.place = server.place
        await grants.serve(self.bus, subjects.sender_grant(self.id),
                           lambda reply: rpc(schemas.GrantRequest, lambda req: self.grant(reply, req)))
        await self.bus.subscribe(subjects.BROKER_HELLO, event(schemas.BrokerHello, self.broker_hello))

    # -- holding ---------------------------------------------------------------------------
    async def put(self, cid: str, captured: CapturedContext) -> None:
        """Store `captured` (its tensors already `place`d) under `cid`, then announce it; the
        contexts evicted for room are withdrawn first."""
        for evicted in self.store.put(cid, captured):
            self.metrics.evictions.inc()
            await self.bus.publish(subjects.cache_evicted(self.id), schemas.encode(
                schemas.CacheEvicted(sender_id=self.id, context_id=evicted)))
        await self.announce(cid, captured)

    def event(self, cid: str, captured: CapturedContext, published_at: float | None = None) -> schemas.CacheAvailable:
        """The availability event of a held context, as the broker indexes and returns it."""
        held = self.models[captured.model_name]
        e_sizes = {tensor_nbytes(t) for t in captured.e.values()}
        return schemas.CacheAvailable(
            sender_id=self.id, model_id=held.model_id, model_sha256=held.sha256,
            fingerprint=schemas.fingerprint_to_wire(captured.fingerprint), fingerprint_id=captured.fingerprint.id,
            context_id=cid, token_ids=list(captured.token_ids), dtype=dtype_name(held.dtype),
            kv_nbytes=captured.kv_nbytes(), e_layers=sorted(captured.e), e_nbytes=max(e_sizes, default=0),
            transport=self.transport, address=self.address,
            published_at=time.time() if published_at is None else published_at, scope=captured.scope,
        )

    def match(self, token_ids: list[int], fingerprint_id: str, models: Collection[str], scope: str
              ) -> tuple[schemas.CacheAvailable | None, int]:
        """What the broker's lookup would find among this holder's own contexts, without asking it
        (nor waiting for it to index what was just held): the context sharing the longest prefix
        with `token_ids`, of `fingerprint_id`, of one of `models` ([] any), in `scope` or public."""
        best: tuple[str, CapturedContext] | None = None
        best_len = 0
        for cid, captured in self.store.items():
            if (captured.fingerprint.id != fingerprint_id or captured.scope not in (scope, PUBLIC)
                    or (models and captured.model_name not in models) or captured.model_name not in self.models):
                continue
            n = common_prefix(captured.token_ids, token_ids)
            if n > best_len or (n == best_len and n and best is not None and captured.scope == scope != best[1].scope):
                best, best_len = (cid, captured), n
        if best is None or best_len == 0:
            return None, 0
        return self.event(*best), best_len

    async def announce(self, cid: str, captured: CapturedContext) -> None:
        """Publish the availability event the broker indexes, and the endpoint receivers warm up on."""
        msg = self.event(cid, captured)
        # on this holder's own subjects: NATS lets it publish only under its own id
        await self.bus.publish(subjects.cache_available(self.id), schemas.encode(msg))
        # receivers warm their bulk connection from this one; the event above, with its token ids, is the broker's
        await self.bus.publish(subjects.sender_endpoint(self.id), schemas.encode(SenderEndpoint(
            sender_id=msg.sender_id, model_id=msg.model_id, fingerprint_id=msg.fingerprint_id, transport=msg.transport,
            address=msg.address, published_at=msg.published_at)))

    # -- pulls -----------------------------------------------------------------------------
    async def grant(self, reply: str, req: schemas.GrantRequest) -> schemas.GrantReply:
        """One pull of a held context, for the receiver that asked (the reply reaches only its
        inbox): a single-use grant that lapses after `grant_ttl_s`. Only for readers of the
        context's model (`grants.check`, by the inbox `reply` names), checked first: an asker that
        may not read learns nothing of what the store holds."""
        captured = self.store.get(req.context_id)
        held = self.models.get(captured.model_name) if captured is not None else None
        # an unknown context is checked against the first model's readers: the refusal reads the same
        readers = held.readers if held is not None else next(iter(self.models.values())).readers
        grants.check(readers, reply, authenticated=self.authenticated)
        if captured is None:
            raise TransferError(f"{self.id} does not hold context {req.context_id[:80]}")
        token, expires = self.tokens.issue(req.context_id, grantee=user_of(reply))
        return schemas.GrantReply(token=token, expires_at=expires)

    def authorize(self, req: schemas.PullRequest) -> str:
        return self.tokens.verify(req.context_id, req.token)

    # -- the broker ------------------------------------------------------------------------
    async def broker_hello(self, msg: schemas.BrokerHello) -> None:
        """A (re)started broker asks for the current holdings: re-announce every stored context
        (a hello naming another holder is not for us)."""
        if msg.sender_id and msg.sender_id != self.id:
            return
        for cid, captured in self.store.items():
            await self.announce(cid, captured)
            # paced under the broker's per-sender event budget, so a large store is indexed whole
            # instead of overflowing the queue the broker keeps for an over-budget sender
            await asyncio.sleep(REANNOUNCE_GAP_S)
        log.info("reannounced", holder_id=self.id, broker_id=msg.broker_id, contexts=len(self.store.ids()))
        # and a beat at once: a new broker serves a holder only once it heard it live
        await self.beat()

    async def beat(self) -> None:
        """One heartbeat: liveness and the held context ids. Its publish has a deadline (one
        interval): a beat that cannot go out is logged and the next one tried, never waited on."""
        msg = schemas.SenderHeartbeat(sender_id=self.id, model_id=next(iter(self.models), ""),
                                      context_ids=self.store.ids(), interval_s=self.heartbeat_s, sent_at=time.time())
        try:
            await asyncio.wait_for(self.bus.publish(subjects.sender_heartbeat(self.id), schemas.encode(msg)),
                                   self.heartbeat_s)
        except Exception as e:  # noqa: BLE001 - a lost beat costs liveness later, never the loop
            log.warning("heartbeat_failed", holder_id=self.id, error=f"{type(e).__name__}: {e}"[:200])

    async def heartbeat(self) -> None:
        """Forever: a beat every `heartbeat_s` (supervised by the service). A beat going out more
        than one interval late (a frozen process, a starved loop) is logged: the broker may have
        declared this holder dead meanwhile."""
        last: float | None = None
        while True:
            now = time.monotonic()
            if last is not None and now - last > 2 * self.heartbeat_s:
                log.warning("heartbeat_late", holder_id=self.id, late_s=round(now - last - self.heartbeat_s, 2))
            last = now
            await self.beat()
            await asyncio.sleep(self.heartbeat_s)

    async def withdraw(self) -> None:
        """Stopping: nobody should be sent here any more."""
        for cid in self.store.ids():
            await self.bus.publish(subjects.cache_evicted(self.id), schemas.encode(
                schemas.CacheEvicted(sender_id=self.id, context_id=cid)))

    # -- pair configs ----------------------------------------------------------------------
    def on_config(self, cfg: schemas.RecomputeConfig) -> bool:
        """A config naming a held model as the sender: its receiver model becomes a reader (the
        pair is declared, whatever weights it profiled), and, for these exact weights, the E
        layers its plans may use are kept from now on. True when it is for these weights."""
        held = self.models.get(cfg.sender_model)
        if held is None:
            return False
        if held.readers.pair(cfg.receiver_model):
            log.info("reader_paired", sender_model=cfg.sender_model, receiver_model=cfg.receiver_model)
        if cfg.sender_sha256 != held.sha256:
            return False
        held.profiled_e[cfg.receiver_model] = {l for p in (*cfg.frontier, cfg.chosen)
                                               for l in policy.plan_of(p.plan).e_layers}
        return True
