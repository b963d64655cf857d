"""Length-prefixed frames on a byte stream, with a size limit and a deadline per read.

    frame = version:u8 | kind:u8 | length:u32 (network order) | payload[length]

``write_frame`` and ``read_frame`` are inverses (tested as a pair). A reader names the
largest payload it accepts, so a peer cannot make it allocate more; a server that must
look at a message's own header first reads the frame header (``read_header``), then
the payload in pieces (``read_exactly``) once it knows what the sender may send.
"""

from __future__ import annotations

import asyncio
import struct
from enum import IntEnum

from fusionp2p.errors import PeerUnreachableError, ProtocolError

__all__ = [
    "FRAME_VERSION",
    "HEADER",
    "FrameKind",
    "read_exactly",
    "read_frame",
    "read_header",
    "skip_exactly",
    "write_frame",
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


async def write_frame(writer: asyncio.StreamWriter, kind: FrameKind, payload: bytes = b"") -> None:
    """Writes one frame and waits until the stream buffer drains."""
    writer.write(HEADER.pack(FRAME_VERSION, int(kind), len(payload)))
    view = memoryview(payload)
    for offset in range(0, len(view), _CHUNK):
        writer.write(view[offset : offset + _CHUNK])
    await writer.drain()


async def read_header(reader: asyncio.StreamReader, *, timeout: float) -> tuple[FrameKind, int]:
    """Reads one frame header: its kind and the payload length it declares (not read yet).

    Raises:
        ProtocolError: bad version or unknown kind.
        PeerUnreachableError: the stream ended or no header arrived within ``timeout``.
    """
    try:
        async with asyncio.timeout(timeout):
            header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        raise PeerUnreachableError(f"stream closed after {len(e.partial)} bytes of a frame") from e
    except TimeoutError as e:
        raise PeerUnreachableError(f"no frame within {timeout:.1f} s") from e
    except ConnectionError as e:
        raise PeerUnreachableError(f"stream broke: {e}") from e
    version, kind, length = HEADER.unpack(header)
    if version != FRAME_VERSION:
        raise ProtocolError(f"frame version {version}, expected {FRAME_VERSION}")
    try:
        return FrameKind(kind), length
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


async def read_exactly(reader: asyncio.StreamReader, n: int, *, stall_timeout: float) -> bytes:
    """Reads ``n`` bytes of a frame in chunks; each chunk must arrive within ``stall_timeout``
    (a slow link may take long in all, a stalled sender is dropped).

    Raises:
        PeerUnreachableError: the stream ended or stalled.
    """
    chunks = []
    remaining = n
    try:
        while remaining:
            async with asyncio.timeout(stall_timeout):
                chunk = await reader.readexactly(min(_CHUNK, remaining))
            chunks.append(chunk)
            remaining -= len(chunk)
    except asyncio.IncompleteReadError as e:
        raise PeerUnreachableError(
            f"stream closed after {n - remaining + len(e.partial)} of {n} bytes"
        ) from e
    except TimeoutError as e:
        raise PeerUnreachableError(
            f"frame stalled: no byte for {stall_timeout:.1f} s after {n - remaining} of {n}"
        ) from e
    except ConnectionError as e:
        raise PeerUnreachableError(f"stream broke: {e}") from e
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def skip_exactly(reader: asyncio.StreamReader, n: int, *, stall_timeout: float) -> None:
    """Reads and drops ``n`` bytes (a rejected body), holding at most one chunk in memory."""
    remaining = n
    while remaining:
        step = min(_CHUNK, remaining)
        await read_exactly(reader, step, stall_timeout=stall_timeout)
        remaining -= step


async def read_frame(
    reader: asyncio.StreamReader, *, max_payload: int, timeout: float, stall_timeout: float | None = None
) -> tuple[FrameKind, bytes]:
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
