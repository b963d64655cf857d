"""The coordinator's planning queue: one job planned at a time, the lightest waiting next.

A request joins the queue once its model was built (fake) and measured
(``coordination.trace_budget``); its weight is that size. Whoever waits, the lightest
model is planned next (ties: first come), so a stranger's heavy requests cannot hold an
honest small one back by more than the one trace in progress (itself bounded by the
operator's time budget). A full queue takes a newcomer only in place of a heavier
request, which is refused with a reason; each data owner holds at most one place
(``Coordinator.submit`` checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fusionp2p.errors import LimitError

__all__ = ["PlanningQueue"]


@dataclass(order=True)
class _Entry:
    weight: int
    seq: int
    turn: asyncio.Future[None] = field(compare=False)


class PlanningQueue:
    """Hands out turns one at a time; at most ``capacity`` wait (lightest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._waiting: list[_Entry] = []
        self._busy = False
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def turn(self, weight: int) -> AsyncIterator[None]:
        """Waits for this request's turn (``weight``: its model's bytes) and holds it.

        Raises:
            LimitError: the queue is full of lighter requests, or a lighter one took this
                one's place while it waited.
        """
        if self._busy or self._waiting:
            await self._wait(_Entry(weight, next(self._seq), asyncio.get_running_loop().create_future()))
        else:
            self._busy = True
        try:
            yield
        finally:
            self._hand_on()

    async def _wait(self, entry: _Entry) -> None:
        if len(self._waiting) >= self.capacity:
            heaviest = max(self._waiting)
            if entry > heaviest:
                raise LimitError(f"{len(self._waiting)} jobs are waiting to be planned; submit again later")
            self._waiting.remove(heaviest)
            heaviest.turn.set_exception(
                LimitError("a job with a smaller model took this one's place; submit again later")
            )
        self._waiting.append(entry)
        try:
            await asyncio.shield(entry.turn)
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif entry.turn.done() and entry.turn.exception() is None:
                self._hand_on()  # the turn came as this request was cancelled: pass it on
            raise

    def _hand_on(self) -> None:
        if self._waiting:
            lightest = min(self._waiting)
            self._waiting.remove(lightest)
            lightest.turn.set_result(None)
        else:
            self._busy = False
