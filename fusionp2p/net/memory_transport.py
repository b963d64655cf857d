"""``MemoryTransport``: in-process streams for unit tests, with the framing and limits
every transport has (``FrameStream``, stream gates, rejection logs)."""

from __future__ import annotations

import asyncio

from fusionp2p.errors import PeerUnreachableError
from fusionp2p.net.limits import StreamGate
from fusionp2p.net.transport import FrameStream, StreamHandler, Transport, rejection_log, run_handler

__all__ = ["MemoryTransport"]


class _MemoryWriter:
    """The writing half of an in-memory stream: feeds the other side's reader."""

    def __init__(self, peer_reader: asyncio.StreamReader) -> None:
        self._peer_reader = peer_reader
        self._closed = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.close()

    def write(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise ConnectionResetError("stream is closed")
        self._peer_reader.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._peer_reader.feed_eof()

    async def wait_closed(self) -> None:
        return None


class MemoryTransport(Transport):
    """In-process transport: every MemoryTransport sharing one ``hub`` dict can reach the others."""

    def __init__(self, peer_id: str, hub: dict[str, MemoryTransport]) -> None:
        self._peer_id = peer_id
        self._hub = hub
        self._handlers: dict[str, tuple[StreamHandler, StreamGate | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._rejections = rejection_log()
        hub[peer_id] = self

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def open(self, peer_id: str, protocol: str, *, timeout: float) -> FrameStream:
        remote = self._hub.get(peer_id)
        if remote is None or protocol not in remote._handlers:
            raise PeerUnreachableError(f"no {protocol} handler at {peer_id[:12]}")
        near_reader, far_reader = asyncio.StreamReader(), asyncio.StreamReader()
        near = FrameStream(peer_id, near_reader, _MemoryWriter(far_reader))  # type: ignore[arg-type]
        far = FrameStream(self._peer_id, far_reader, _MemoryWriter(near_reader))  # type: ignore[arg-type]
        handler, gate = remote._handlers[protocol]
        task = asyncio.create_task(run_handler(handler, far, protocol, gate, remote._rejections))
        remote._tasks.add(task)
        task.add_done_callback(remote._tasks.discard)
        return near

    async def serve(self, protocol: str, handler: StreamHandler, *, gate: StreamGate | None = None) -> None:
        self._handlers[protocol] = (handler, gate)

    async def stop_serving(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)

    async def aclose(self) -> None:
        self._handlers.clear()
        self._hub.pop(self._peer_id, None)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
