"""The profiler's queue: a bounded number of requests held, limits per requester, one profile at a
time, operators first.

A request past a limit is refused at once (`OverloadedError`, wire code `overloaded`) instead of
waiting until its asker times out, so a receiver flooding re-profiles gets busy replies while an
operator's request still gets its place and its turn:

* at most `size` requests are held (the one running and those waiting), all requesters together;
  receivers' requests never take the last place, which is kept for an operator;
* the receivers of one model hold at most `per_receiver` (a model's receivers are one requester:
  NATS cannot tell two processes of one user apart);
* waiting operators' requests run before waiting receivers' (first come, first served within
  each), so an operator waits at most for the one profile running.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import Counter
from collections.abc import AsyncIterator

from droidmesh.services.profiler.checks import Requester
from droidmesh.shared.errors import OverloadedError


class Admission:
    """Used on the service's event loop only (no locking)."""

    def __init__(self, size: int, per_receiver: int):
        self.size, self.per_receiver = size, per_receiver
        self.held: Counter[str] = Counter()  # requester name -> requests held (running or waiting)
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # (operators first, arrival, turn)
        self._arrival = itertools.count()
        self._running = False

    def admit(self, who: Requester) -> None:
        """Take a place for `who`, or raise `OverloadedError` saying which limit it is past."""
        total = sum(self.held.values())
        room = self.size if who.operator else self.size - 1
        if total >= room:
            raise OverloadedError(f"profiler busy: {total} requests held, its queue holds {self.size} (the last place "
                                  "is kept for operators); retry later")
        if not who.operator and self.held[who.name] >= self.per_receiver:
            raise OverloadedError(f"profiler busy: the {who.name} already hold {self.held[who.name]} re-profile "
                                  f"request(s), the limit per receiver model; retry later")
        self.held[who.name] += 1

    @contextlib.asynccontextmanager
    async def slot(self, who: Requester) -> AsyncIterator[None]:
        """Admit `who` (or raise at once), wait for its turn, and run the block as the only one."""
        self.admit(who)
        try:
            await self._turn(who)
            try:
                yield
            finally:
                self._pass_turn()
        finally:
            self.held[who.name] -= 1
            if not self.held[who.name]:
                del self.held[who.name]

    async def _turn(self, who: Requester) -> None:
        if not self._running and not self._waiting:
            self._running = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (0 if who.operator else 1, next(self._arrival), turn)
        heapq.heappush(self._waiting, entry)
        try:
            await turn
        except BaseException:  # cancelled (the service stopping): give up the place, or the turn just handed over
            if turn.done() and not turn.cancelled():
                self._pass_turn()
            elif entry in self._waiting:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def _pass_turn(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self._running = False
