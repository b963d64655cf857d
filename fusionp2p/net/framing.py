"""Length-prefixed frames on a byte stream, with a size limit and a deadline per read.

    frame = version:u8 | kind:u8 | length:u32 (network order) | payload[length]

``write_frame`` and ``read_frame`` are inverses (tested as a pair). A reader names the
largest payload it accepts, so a peer cannot make it allocate more; a server that must
look at a message's own header first reads the frame header (``read_header``), then
the payload in pieces (``read_exactly``) once it knows what the sender may send.
"""

from __future__ import annotations

import asyncio
import math
import struct
from enum import IntEnum

from fusionp2p.errors import DeadlineError, PeerUnreachableError, ProtocolError

__all__ = [
    "FRAME_VERSION",
    "HEADER",
    "FrameKind",
    "read_exactly",
    "read_frame",
    "read_header",
    "skip_exactly",
    "write_frame",
    "write_frame_nowait",
]

FRAME_VERSION = 1
HEADER = struct.Struct("!BBI")
_CHUNK = 64 << 10


class FrameKind(IntEnum):
    """What a frame carries; each protocol uses a subset."""

    PING = 1
    PONG = 2
    DATA = 3
    END = 4
    ACK = 5
    ERROR = 6


def write_frame_nowait(
    writer: asyncio.StreamWriter, kind: FrameKind, *parts: bytes | bytearray | memoryview
) -> None:
    """Writes one frame whose payload is ``parts`` one after the other (no joining copy)
    into the stream's buffer."""
    views = [memoryview(p).cast("B") for p in parts]
    writer.write(HEADER.pack(FRAME_VERSION, int(kind), sum(v.nbytes for v in views)))
    for view in views:
        for offset in range(0, len(view), _CHUNK):
            writer.write(view[offset : offset + _CHUNK])


async def write_frame(
    writer: asyncio.StreamWriter, kind: FrameKind, *parts: bytes | bytearray | memoryview
) -> None:
    """``write_frame_nowait``, then waits until the stream buffer drains."""
    write_frame_nowait(writer, kind, *parts)
    await writer.drain()


async def read_header(reader: asyncio.StreamReader, *, timeout: float) -> tuple[FrameKind, int]:
    """Reads one frame header: its kind and the payload length it declares (not read yet).

    Raises:
        ProtocolError: bad version or unknown kind.
        DeadlineError: no header arrived within ``timeout`` (the stream may be fine).
        PeerUnreachableError: the stream ended.
    """
    try:
        async with asyncio.timeout(timeout):
            header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        raise PeerUnreachableError(f"stream closed after {len(e.partial)} bytes of a frame") from e
    except TimeoutError as e:
        raise DeadlineError(f"no frame within {timeout:.1f} s") from e
    except ConnectionError as e:
        raise PeerUnreachableError(f"stream broke: {e}") from e
    version, kind, length = HEADER.unpack(header)
    if version != FRAME_VERSION:
        raise ProtocolError(f"frame version {version}, expected {FRAME_VERSION}")
    try:
        return FrameKind(kind), length
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


async def read_exactly(
    reader: asyncio.StreamReader, n: int, *, stall_timeout: float, min_rate: float | None = None
) -> bytes | bytearray:
    """Reads ``n`` bytes of a frame in chunks; each chunk must arrive within ``stall_timeout``
    (a slow link may take long in all, a stalled sender is dropped) and, with ``min_rate``
    (bytes/s), the whole within ``stall_timeout + n / min_rate`` (a sender dripping bytes
    just fast enough not to stall cannot hold a large buffer for long). A payload larger
    than one chunk comes back as a writable ``bytearray`` (tensors are decoded from it in
    place).

    Raises:
        PeerUnreachableError: the stream ended, stalled or was too slow.
    """
    buf = bytearray(n) if n > _CHUNK else None
    view = memoryview(buf) if buf is not None else None
    done = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + stall_timeout + n / min_rate if min_rate else math.inf
    try:
        while done < n:
            async with asyncio.timeout(min(stall_timeout, max(0.0, deadline - loop.time()))):
                chunk = await reader.readexactly(min(_CHUNK, n - done))
            if view is None:
                return chunk
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
    except asyncio.IncompleteReadError as e:
        raise PeerUnreachableError(f"stream closed after {done + len(e.partial)} of {n} bytes") from e
    except TimeoutError as e:
        if loop.time() >= deadline:
            raise PeerUnreachableError(
                f"frame too slow: {done} of {n} bytes in {stall_timeout + n / (min_rate or 1):.1f} s "
                f"(at least {min_rate:.0f} B/s)"
            ) from e
        raise PeerUnreachableError(
            f"frame stalled: no byte for {stall_timeout:.1f} s after {done} of {n}"
        ) from e
    except ConnectionError as e:
        raise PeerUnreachableError(f"stream broke: {e}") from e
    if buf is None:
        return b""
    return buf


async def skip_exactly(reader: asyncio.StreamReader, n: int, *, stall_timeout: float) -> None:
    """Reads and drops ``n`` bytes (a rejected body), holding at most one chunk in memory."""
    remaining = n
    while remaining:
        step = min(_CHUNK, remaining)
        await read_exactly(reader, step, stall_timeout=stall_timeout)
        remaining -= step


async def read_frame(
    reader: asyncio.StreamReader, *, max_payload: int, timeout: float, stall_timeout: float | None = None
) -> tuple[FrameKind, bytes | bytearray]:
    """Reads one frame: its header within ``timeout``, its payload (checked against
    ``max_payload`` before a byte of it is read) with ``stall_timeout`` per chunk.

    Raises:
        ProtocolError: bad version, unknown kind or a payload larger than ``max_payload``.
        PeerUnreachableError: the stream ended, or the frame did not arrive in time.
    """
    frame_kind, length = await read_header(reader, timeout=timeout)
    if length > max_payload:
        raise ProtocolError(f"{frame_kind.name} frame of {length} bytes > limit {max_payload}")
    if not length:
        return frame_kind, b""
    return frame_kind, await read_exactly(reader, length, stall_timeout=stall_timeout or timeout)
