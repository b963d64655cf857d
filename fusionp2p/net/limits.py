"""Bounds on what remote peers can make this process hold: streams, bytes, log lines.

- ``StreamGate`` counts concurrent inbound streams per remote peer and in total (every
  protocol a peer serves goes through one gate);
- ``InboundBudget`` reserves the bytes of a message body before it is read, per remote
  peer and in total, and releases them once the message is processed;
- ``RejectionLog`` logs one line per kind of rejection per interval, so a flood of bad
  input cannot flood the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from fusionp2p.config import format_bytes
from fusionp2p.errors import LimitError

__all__ = ["InboundBudget", "RejectionLog", "Reservation", "StreamGate"]


class StreamGate:
    """Admits at most ``per_peer`` concurrent streams from one remote peer and ``total`` in all.

    Peers for which ``privileged`` is true (a running job's owner and neighbours) are held
    to their own per-peer limit only, so strangers who fill the total cannot cut a job off.
    """

    def __init__(self, *, per_peer: int, total: int) -> None:
        self.per_peer = per_peer
        self.total = total
        self.privileged: Callable[[str], bool] = lambda remote: False
        self._open: Counter[str] = Counter()

    def enter(self, remote: str) -> str | None:
        """Counts a new stream from ``remote``; the reason it is refused, or None."""
        if self._open[remote] >= self.per_peer:
            return f"{self._open[remote]} streams from this peer already open (limit {self.per_peer})"
        if sum(self._open.values()) >= self.total and not self.privileged(remote):
            return f"{self.total} inbound streams already open (limit)"
        self._open[remote] += 1
        return None

    def leave(self, remote: str) -> None:
        """Uncounts a stream admitted by ``enter``."""
        self._open[remote] -= 1
        if self._open[remote] <= 0:
            del self._open[remote]

    def open_streams(self, remote: str | None = None) -> int:
        return sum(self._open.values()) if remote is None else self._open[remote]


class Reservation:
    """Bytes held against an ``InboundBudget`` until ``release()`` (idempotent)."""

    def __init__(self, budget: InboundBudget | None, remote: str, nbytes: int) -> None:
        self._budget = budget
        self.remote = remote
        self.nbytes = nbytes

    def release(self) -> None:
        if self._budget is not None:
            budget, self._budget = self._budget, None
            budget._release(self.remote, self.nbytes)


class InboundBudget:
    """Bytes of inbound message bodies held in memory, per remote peer and in total.

    A body is admitted when it fits both budgets, or when nothing else is held (so one
    message larger than a budget, which the protocol's own size checks allowed, still
    makes progress). Otherwise the reader waits, and so its sender: back-pressure.
    """

    def __init__(self, *, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self._held: Counter[str] = Counter()
        self._released = asyncio.Event()  # set (and replaced) whenever bytes are released

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def free_for(self, remote: str) -> int:
        """Bytes ``remote`` could send now without waiting (what its credit is)."""
        return max(0, min(self.per_peer - self._held[remote], self.total - self.held))

    def _fits(self, remote: str, nbytes: int) -> bool:
        held, mine = self.held, self._held[remote]
        return (held == 0 or held + nbytes <= self.total) and (mine == 0 or mine + nbytes <= self.per_peer)

    async def reserve(self, remote: str, nbytes: int, *, timeout: float) -> Reservation:
        """Waits until ``nbytes`` from ``remote`` fit.

        Raises:
            LimitError: they did not fit within ``timeout``.
        """
        if nbytes <= 0:
            return Reservation(None, remote, 0)
        if self._fits(remote, nbytes):  # the common case: no deadline to arm
            self._held[remote] += nbytes
            return Reservation(self, remote, nbytes)
        try:
            async with asyncio.timeout(timeout):
                while not self._fits(remote, nbytes):
                    await self._released.wait()
        except TimeoutError:
            raise LimitError(
                f"inbound memory budget: {format_bytes(nbytes)} more did not fit within {timeout:.0f} s "
                f"({format_bytes(self._held[remote])} held for this peer, limit "
                f"{format_bytes(self.per_peer)}; {format_bytes(self.held)} in all, limit "
                f"{format_bytes(self.total)})"
            ) from None
        self._held[remote] += nbytes
        return Reservation(self, remote, nbytes)

    def _release(self, remote: str, nbytes: int) -> None:
        self._held[remote] -= nbytes
        if self._held[remote] <= 0:
            del self._held[remote]
        released, self._released = self._released, asyncio.Event()
        released.set()


class RejectionLog:
    """Logs a rejection at most once per ``interval`` per reason, counting the ones it held back."""

    def __init__(self, logger: logging.Logger, prefix: str, *, interval: float = 5.0) -> None:
        self._logger = logger
        self._prefix = prefix
        self._interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def reject(self, reason: str, detail: str) -> bool:
        """Logs (or counts) one rejection; always returns False, for ``return log.reject(...)``."""
        now = time.monotonic()
        last, suppressed = self._last.get(reason, (-1e9, 0))
        if now - last >= self._interval:
            more = f" (+{suppressed} similar)" if suppressed else ""
            self._logger.warning("%s: %s: %s%s", self._prefix, reason, detail, more)
            self._last[reason] = (now, 0)
        else:
            self._last[reason] = (last, suppressed + 1)
        if len(self._last) > 1024:  # reasons are few; never let hostile input grow this
            self._last.clear()
        return False
