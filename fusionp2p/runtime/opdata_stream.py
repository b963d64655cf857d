"""Streaming OpData to one peer: one long-lived stream, a window of unacknowledged messages.

The receiver answers every OpData in order, ACK or ERROR; an ACK carries its *credit*:
the bytes it will take in flight from this sender (its free inbound budget for us). The
sender keeps writing while the bytes it has in flight fit that credit (one message at a
time always may go, however large), up to ``max_unacked`` messages, and never waits for a
round trip per message, so a link's RTT is hidden once the window covers it. When the
receiver is slow it stops reading, its credit shrinks and the sender stops: back-pressure.

A stream that sat idle is reopened before the next message (servers close idle streams);
a stream that breaks while messages are unacknowledged, a refusal, or no acknowledgement
within the deadline is reported through ``on_error`` (resending could duplicate).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import DeadlineError, FusionP2PError, PeerUnreachableError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.records import CONTROL_REPLY_BYTES, CREDIT, EXEC_PROTOCOL, message_prefix
from fusionp2p.records.limits import MAX_UNACKED
from fusionp2p.runtime.executor import Message

__all__ = ["INITIAL_CREDIT", "OpDataSender"]

logger = logging.getLogger(__name__)

INITIAL_CREDIT = 16 << 20  # before the first ACK says otherwise


class OpDataSender:
    """Sends OpData to ``peer_id`` in order; ``on_done(bytes)`` once per message (acknowledged,
    or dropped after a failure), ``on_error(reason)`` once, on the first failure."""

    def __init__(
        self,
        transport: Transport,
        peer_id: str,
        *,
        timeout: float,
        on_done: Callable[[int], Awaitable[None]],
        on_error: Callable[[str], Awaitable[None]],
        max_unacked: int = MAX_UNACKED,
        reopen_after: float = 10.0,
    ) -> None:
        self.transport = transport
        self.peer_id = peer_id
        self.timeout = timeout
        self.max_unacked = max_unacked
        self.reopen_after = reopen_after
        self._on_done = on_done
        self._on_error = on_error
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._unacked: collections.deque[int] = collections.deque()
        self._in_flight = 0
        self._credit = INITIAL_CREDIT
        self._changed = asyncio.Condition()
        self._stream: FrameStream | None = None
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._last_used = 0.0
        self._outstanding = 0  # put and not yet done
        self._queued_bytes = 0  # put and not yet written
        self._waiting = 0  # tasks waiting on ``_changed``
        self.failure: str | None = None

    @property
    def in_flight_bytes(self) -> int:
        """Bytes written and not yet acknowledged."""
        return self._in_flight

    @property
    def queued_bytes(self) -> int:
        """Bytes of the messages waiting to be written."""
        return self._queued_bytes

    async def put(self, message: Message) -> None:
        """Queues ``message``; it is written as soon as the window allows."""
        if self._writer is None:
            self._writer = asyncio.create_task(
                self._write_loop(), name=f"fusionp2p.opdata-to-{self.peer_id[:8]}"
            )
        self._outstanding += 1
        self._queued_bytes += len(message.body)
        await self._queue.put(message)

    async def _done(self, size: int) -> None:
        self._outstanding -= 1
        await self._on_done(size)
        if self._waiting:  # someone waits for the window or the drain: wake them
            async with self._changed:
                self._changed.notify_all()

    async def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            await self._on_error(reason)
        unacked, self._unacked = list(self._unacked), collections.deque()
        self._in_flight = 0
        for size in unacked:  # they will never be acknowledged
            await self._done(size)
        async with self._changed:
            self._changed.notify_all()

    def _window_open(self, size: int) -> bool:
        if self.failure is not None or not self._unacked:
            return True
        return len(self._unacked) < self.max_unacked and self._in_flight + size <= self._credit

    async def _write_loop(self) -> None:
        while True:
            message = await self._queue.get()
            size = len(message.body)
            written = False
            try:
                if not self._window_open(size):  # wait only when the window is closed
                    await self._wait(functools.partial(self._window_open, size), self.timeout)
                if self.failure is None:
                    stream = await self._ready_stream()
                    self._queued_bytes -= size
                    self._unacked.append(size)
                    self._in_flight += size
                    written = True  # from here on, an ACK or a failure accounts for it
                    prefix = message_prefix(message.header)
                    await stream.send_parts(FrameKind.DATA, prefix, message.body, timeout=self.timeout)
                    self._last_used = time.monotonic()
                    continue
            except TimeoutError:
                await self._fail(
                    f"stage peer {self.peer_id[:12]} granted no credit for {self.timeout:.0f} s "
                    f"({len(self._unacked)} messages, {self._in_flight} bytes unacknowledged)"
                )
            except FusionP2PError as e:
                await self._fail(f"sending to {self.peer_id[:12]}: {e}")
            if not written:  # dropped after a failure: it will never be acknowledged
                self._queued_bytes -= size
                await self._done(size)

    async def _ready_stream(self) -> FrameStream:
        idle = time.monotonic() - self._last_used > self.reopen_after
        if self._stream is not None and (
            self._reader is None or self._reader.done() or (idle and not self._unacked)
        ):
            await self._drop_stream()
        if self._stream is None:
            self._stream = await self.transport.open(self.peer_id, EXEC_PROTOCOL, timeout=self.timeout)
            self._reader = asyncio.create_task(self._read_loop(self._stream))
            self._last_used = time.monotonic()
        return self._stream

    async def _drop_stream(self) -> None:
        stream, reader = self._stream, self._reader
        self._stream = self._reader = None
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
        if stream is not None:
            await stream.close()

    async def _read_loop(self, stream: FrameStream) -> None:
        while True:
            try:
                kind, payload = await stream.recv(max_payload=CONTROL_REPLY_BYTES, timeout=self.timeout)
            except DeadlineError:
                if self._unacked:
                    return await self._fail(
                        f"stage peer {self.peer_id[:12]} acknowledged nothing for {self.timeout:.0f} s"
                    )
                continue
            except FusionP2PError as e:
                if self._unacked:
                    await self._fail(
                        f"stream to {self.peer_id[:12]} broke with {len(self._unacked)} unacknowledged: {e}"
                    )
                return
            if not self._unacked:
                return await self._fail(f"stage peer {self.peer_id[:12]} answered a message never sent")
            size = self._unacked.popleft()
            self._in_flight -= size
            self._last_used = time.monotonic()
            if kind is FrameKind.ACK and len(payload) == CREDIT.size:
                (self._credit,) = CREDIT.unpack(payload)
                await self._done(size)
                continue
            await self._done(size)
            reason = payload.decode(errors="replace") if kind is FrameKind.ERROR else f"a {kind.name} frame"
            return await self._fail(f"stage peer {self.peer_id[:12]} refused an OpData: {reason}")

    async def drained(self) -> None:
        """Waits until every message put was acknowledged (or dropped after a failure)."""
        await self._wait(lambda: self._outstanding == 0, None)

    async def _wait(self, condition: Callable[[], bool], timeout: float | None) -> None:
        self._waiting += 1
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(condition), timeout)
        finally:
            self._waiting -= 1

    async def aclose(self) -> None:
        """Stops writing; ends the stream (END) and the tasks. Never raises."""
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(BaseException):
                await self._writer
        if self._stream is not None:
            with contextlib.suppress(PeerUnreachableError):
                await self._stream.send(FrameKind.END, timeout=DEFAULT_TIMEOUTS.courtesy)
        await self._drop_stream()
