"""How peers open byte streams to each other.

``Transport`` is the small interface the rest of fusionp2p uses: ``open`` a stream to a
peer for a protocol name, ``serve`` a protocol with a handler. Three implementations:

- ``P2PTransport``: long-lived libp2p binary streams through hivemind's p2pd (the real one);
- ``RateLimitedTransport``: wraps another transport and paces every outgoing byte with a
  token bucket (a user's upload cap; tests use it to create a link of known rate);
- ``MemoryTransport`` (``memory_transport.py``): in-process streams for unit tests.

Every stream is a ``FrameStream``: the same framing and limits on every transport.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2
from hivemind.utils.multiaddr import Multiaddr

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import (
    FRAME_VERSION,
    HEADER,
    FrameKind,
    read_exactly,
    read_frame,
    read_header,
    skip_exactly,
    write_frame,
    write_frame_nowait,
)
from fusionp2p.net.limits import RejectionLog, StreamGate

__all__ = [
    "ByteMeter",
    "FrameStream",
    "P2PTransport",
    "RateLimitedTransport",
    "StreamHandler",
    "TokenBucket",
    "Transport",
    "rejection_log",
    "run_handler",
]

logger = logging.getLogger(__name__)
_PACE_CHUNK = 64 << 10
_COURTESY = DEFAULT_TIMEOUTS.courtesy  # the ERROR frame that says why a stream is refused
_FINISH = DEFAULT_TIMEOUTS.courtesy / 4  # reading what the refused sender still sends


class TokenBucket:
    """Paces bytes to ``rate`` bytes/s with a burst of at most ``burst`` bytes."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else min(_PACE_CHUNK, rate * 0.05)
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self, nbytes: int) -> None:
        """Waits until ``nbytes`` may go out; larger-than-burst requests go into debt."""
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)


_DRAIN_ABOVE = 256 << 10


def _needs_drain(writer: asyncio.StreamWriter) -> bool:
    """Whether a write should wait for the buffer to drain (a small write into an empty
    buffer needs no await; an in-memory writer has no transport and always drains)."""
    transport = getattr(writer, "transport", None)
    return transport is None or transport.is_closing() or transport.get_write_buffer_size() > _DRAIN_ABOVE


@dataclass
class ByteMeter:
    """Bytes of frames (headers included) sent and received on a transport's streams."""

    sent: int = 0
    received: int = 0


class FrameStream:
    """One bidirectional stream of frames to ``remote`` (a base58 PeerID)."""

    def __init__(
        self,
        remote: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        bucket: TokenBucket | None = None,
        meter: ByteMeter | None = None,
    ) -> None:
        self.remote = remote
        self._reader = reader
        self._writer = writer
        self._bucket = bucket
        self._meter = meter

    async def send(
        self,
        kind: FrameKind,
        payload: bytes | bytearray | memoryview = b"",
        *,
        timeout: float = DEFAULT_TIMEOUTS.frame,
    ) -> None:
        """Sends one frame, paced by this stream's token bucket if it has one.

        Raises:
            PeerUnreachableError: the stream broke or the send passed ``timeout``.
        """
        await self.send_parts(kind, payload, timeout=timeout)

    async def send_parts(
        self, kind: FrameKind, *parts: bytes | bytearray | memoryview, timeout: float = DEFAULT_TIMEOUTS.frame
    ) -> None:
        """Sends one frame whose payload is ``parts`` one after the other (see ``send``)."""
        if self._meter is not None:
            self._meter.sent += HEADER.size + sum(len(memoryview(p).cast("B")) for p in parts)
        try:
            if self._bucket is None and not _needs_drain(self._writer):
                write_frame_nowait(self._writer, kind, *parts)  # the common small frame: no await
                return
            async with asyncio.timeout(timeout):
                if self._bucket is None:
                    await write_frame(self._writer, kind, *parts)
                else:
                    joined = parts[0] if len(parts) == 1 else b"".join(bytes(p) for p in parts)
                    await self._send_paced(kind, memoryview(joined).cast("B"), self._bucket)
        except TimeoutError as e:
            raise PeerUnreachableError(f"send to {self.remote[:12]} passed {timeout:.1f} s") from e
        except ConnectionError as e:
            raise PeerUnreachableError(f"stream to {self.remote[:12]} broke: {e}") from e

    async def _send_paced(self, kind: FrameKind, view: memoryview, bucket: TokenBucket) -> None:
        await bucket.acquire(HEADER.size)
        self._writer.write(HEADER.pack(FRAME_VERSION, int(kind), len(view)))
        for offset in range(0, len(view), _PACE_CHUNK):
            piece = view[offset : offset + _PACE_CHUNK]
            await bucket.acquire(len(piece))
            self._writer.write(piece)
            await self._writer.drain()
        await self._writer.drain()

    async def recv(
        self, *, max_payload: int, timeout: float, stall_timeout: float | None = None
    ) -> tuple[FrameKind, bytes | bytearray]:
        """Receives one frame (see ``read_frame`` for errors)."""
        kind, payload = await read_frame(
            self._reader, max_payload=max_payload, timeout=timeout, stall_timeout=stall_timeout
        )
        if self._meter is not None:
            self._meter.received += HEADER.size + len(payload)
        return kind, payload

    async def recv_header(self, *, timeout: float) -> tuple[FrameKind, int]:
        """The next frame's kind and declared length; its payload is still to be read."""
        header = await read_header(self._reader, timeout=timeout)
        if self._meter is not None:
            self._meter.received += HEADER.size
        return header

    async def recv_exactly(
        self, n: int, *, stall_timeout: float, min_rate: float | None = None
    ) -> bytes | bytearray:
        """``n`` more bytes of the current frame (see ``read_exactly``)."""
        data = await read_exactly(self._reader, n, stall_timeout=stall_timeout, min_rate=min_rate)
        if self._meter is not None:
            self._meter.received += n
        return data

    async def skip(self, n: int, *, stall_timeout: float) -> None:
        """Reads and drops ``n`` bytes of the current frame."""
        await skip_exactly(self._reader, n, stall_timeout=stall_timeout)

    async def finish(self, *, drain_bytes: int = 1 << 20, timeout: float = DEFAULT_TIMEOUTS.courtesy) -> None:
        """Ends a stream this side is refusing: stops writing, then reads and drops what the
        peer still sends (at most ``drain_bytes`` for ``timeout`` s) so that the last frame
        (an ERROR) is delivered instead of being lost to a reset; then closes. Never raises."""
        with contextlib.suppress(Exception):
            if self._writer.can_write_eof():
                self._writer.write_eof()
            async with asyncio.timeout(timeout):
                while drain_bytes > 0:
                    chunk = await self._reader.read(min(drain_bytes, 64 << 10))
                    if not chunk:
                        break
                    drain_bytes -= len(chunk)
        await self.close()

    async def close(self) -> None:
        """Closes the stream; never raises."""
        with contextlib.suppress(Exception):
            self._writer.close()
            await asyncio.wait_for(self._writer.wait_closed(), 2.0)


StreamHandler = Callable[[FrameStream], Awaitable[None]]


class Transport(abc.ABC):
    """Opens and serves frame streams between peers."""

    @property
    def bytes_sent(self) -> int:
        """Frame bytes sent on this transport's streams so far (0: it does not count)."""
        return 0

    @property
    def bytes_received(self) -> int:
        """Frame bytes received on this transport's streams so far (0: it does not count)."""
        return 0

    @property
    @abc.abstractmethod
    def peer_id(self) -> str:
        """This side's base58 PeerID."""

    @abc.abstractmethod
    async def open(self, peer_id: str, protocol: str, *, timeout: float) -> FrameStream:
        """Opens a stream to ``peer_id`` for ``protocol``.

        Raises:
            PeerUnreachableError: the peer could not be reached within ``timeout``.
        """

    @abc.abstractmethod
    async def serve(self, protocol: str, handler: StreamHandler, *, gate: StreamGate | None = None) -> None:
        """Calls ``handler`` with each incoming stream of ``protocol`` (closed afterwards);
        with a ``gate``, a stream over its per-peer or total count is refused instead."""

    async def connect(self, peer_id: str, maddrs: Sequence[str], *, timeout: float) -> None:  # noqa: B027
        """Dials ``peer_id`` at ``maddrs`` so that ``open`` can reach it (a no-op where not needed).

        Raises:
            PeerUnreachableError: the peer could not be dialled within ``timeout``.
        """

    async def stop_serving(self, protocol: str) -> None:  # noqa: B027 - optional hook
        """Stops answering ``protocol`` (so another handler may serve it later)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Stops serving; open streams are closed by their users."""


async def run_handler(
    handler: StreamHandler,
    stream: FrameStream,
    protocol: str,
    gate: StreamGate | None,
    rejections: RejectionLog,
) -> None:
    """Serves one inbound ``stream`` of ``protocol`` with ``handler``, if ``gate`` lets its
    sender in: a protocol error gets an ERROR frame and one logged line, any other
    failure a log line; the stream is always closed, and the server serves on."""
    refused = gate.enter(stream.remote) if gate is not None else None
    try:
        if refused is not None:
            rejections.reject(f"{protocol} stream refused", f"from {stream.remote}: {refused}")
            with contextlib.suppress(Exception):
                await stream.send(FrameKind.ERROR, f"refused: {refused}".encode(), timeout=_COURTESY)
            await stream.finish(timeout=_FINISH)
            return
        await handler(stream)
    except ProtocolError as e:  # a malformed stream: tell the sender why, log one line, serve on
        rejections.reject(f"{protocol} frame rejected", f"from {stream.remote}: {e}")
        with contextlib.suppress(Exception):
            await stream.send(FrameKind.ERROR, str(e).encode()[:2000], timeout=_COURTESY)
        await stream.finish(timeout=_FINISH)
    except PeerUnreachableError as e:
        logger.debug("%s stream from %s ended: %s", protocol, stream.remote, e)
    except Exception as e:  # a bad peer must never take the server down
        logger.warning("%s handler for %s failed: %s: %s", protocol, stream.remote, type(e).__name__, e)
    finally:
        if gate is not None and refused is None:
            gate.leave(stream.remote)
        await stream.close()


def rejection_log() -> RejectionLog:
    """A transport's log of refused streams and frames (one line per kind, rate-limited)."""
    return RejectionLog(logger, "protocol error")


class P2PTransport(Transport):
    """Binary libp2p streams through a hivemind P2P instance (usually ``dht.replicate_p2p()``)."""

    def __init__(self, p2p: P2P, meter: ByteMeter | None = None) -> None:
        """``meter`` counts what is sent (shared by the handles of one process: its own by default)."""
        self._p2p = p2p
        self._protocols: list[str] = []
        self._rejections = rejection_log()
        self._meter = meter if meter is not None else ByteMeter()

    @property
    def peer_id(self) -> str:
        return self._p2p.peer_id.to_base58()

    @property
    def bytes_sent(self) -> int:
        return self._meter.sent

    @property
    def bytes_received(self) -> int:
        return self._meter.received

    async def open(self, peer_id: str, protocol: str, *, timeout: float) -> FrameStream:
        try:
            reader, writer = await asyncio.wait_for(self._stream_open(peer_id, protocol), timeout)
        except Exception as e:
            raise PeerUnreachableError(f"cannot open {protocol} to {peer_id[:12]}: {e!r}") from e
        return FrameStream(peer_id, reader, writer, meter=self._meter)

    async def _stream_open(
        self, peer_id: str, protocol: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # hivemind's P2P.call_binary_stream_handler leaks its daemon connection when the
        # remote refuses the protocol; this is the same request, closing it on failure.
        client = self._p2p._client.control
        reader, writer = await client.daemon_connector.open_connection()
        try:
            request = p2pd_pb2.Request(
                type=p2pd_pb2.Request.STREAM_OPEN,
                streamOpen=p2pd_pb2.StreamOpenRequest(
                    peer=PeerID.from_base58(peer_id).to_bytes(), proto=[protocol]
                ),
            )
            await write_pbmsg(writer, request)
            response = p2pd_pb2.Response()
            await read_pbmsg_safe(reader, response)
            raise_if_failed(response)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def connect(self, peer_id: str, maddrs: Sequence[str], *, timeout: float) -> None:
        addrs = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs]  # the daemon wants no /p2p/<id> part
        try:
            await asyncio.wait_for(self._p2p._client.connect(PeerID.from_base58(peer_id), addrs), timeout)
        except Exception as e:
            raise PeerUnreachableError(f"cannot dial {peer_id[:12]} at {list(maddrs)[:2]}: {e!r}") from e

    async def serve(self, protocol: str, handler: StreamHandler, *, gate: StreamGate | None = None) -> None:
        async def on_stream(info, reader, writer) -> None:
            stream = FrameStream(info.peer_id.to_base58(), reader, writer, meter=self._meter)
            await run_handler(handler, stream, protocol, gate, self._rejections)

        await self._p2p.add_binary_stream_handler(protocol, on_stream)
        self._protocols.append(protocol)

    async def stop_serving(self, protocol: str) -> None:
        if protocol in self._protocols:
            self._protocols.remove(protocol)
            with contextlib.suppress(Exception):
                await self._p2p.remove_binary_stream_handler(protocol)

    async def aclose(self) -> None:
        for protocol in list(self._protocols):
            await self.stop_serving(protocol)


class RateLimitedTransport(Transport):
    """Paces every outgoing byte of ``inner`` to ``bytes_per_second`` (one shared bucket)."""

    def __init__(self, inner: Transport, bytes_per_second: float) -> None:
        self._inner = inner
        self.bucket = TokenBucket(bytes_per_second)

    @property
    def peer_id(self) -> str:
        return self._inner.peer_id

    @property
    def bytes_sent(self) -> int:
        return self._inner.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._inner.bytes_received

    async def open(self, peer_id: str, protocol: str, *, timeout: float) -> FrameStream:
        stream = await self._inner.open(peer_id, protocol, timeout=timeout)
        stream._bucket = self.bucket
        return stream

    async def connect(self, peer_id: str, maddrs: Sequence[str], *, timeout: float) -> None:
        await self._inner.connect(peer_id, maddrs, timeout=timeout)

    async def serve(self, protocol: str, handler: StreamHandler, *, gate: StreamGate | None = None) -> None:
        async def paced(stream: FrameStream) -> None:
            stream._bucket = self.bucket
            await handler(stream)

        await self._inner.serve(protocol, paced, gate=gate)

    async def stop_serving(self, protocol: str) -> None:
        await self._inner.stop_serving(protocol)

    async def aclose(self) -> None:
        await self._inner.aclose()
