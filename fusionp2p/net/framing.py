"""Length-prefixed frames on a byte stream, with a size limit and a deadline per read.

    frame = version:u8 | kind:u8 | length:u32 (network order) | payload[length]

``write_frame`` and ``read_frame`` are inverses (tested as a pair). A reader names the
largest payload it accepts, so a peer cannot make it allocate more.
"""

from __future__ import annotations

import asyncio
import struct
from enum import IntEnum

from fusionp2p.errors import PeerUnreachableError, ProtocolError

__all__ = ["FRAME_VERSION", "HEADER", "FrameKind", "read_frame", "write_frame"]

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


async def read_frame(
    reader: asyncio.StreamReader, *, max_payload: int, timeout: float
) -> tuple[FrameKind, bytes]:
    """Reads one frame.

    Raises:
        ProtocolError: bad version, unknown kind or a payload larger than ``max_payload``.
        PeerUnreachableError: the stream ended or the frame did not arrive within ``timeout``.
    """
    try:
        async with asyncio.timeout(timeout):
            header = await reader.readexactly(HEADER.size)
            version, kind, length = HEADER.unpack(header)
            if version != FRAME_VERSION:
                raise ProtocolError(f"frame version {version}, expected {FRAME_VERSION}")
            try:
                frame_kind = FrameKind(kind)
            except ValueError:
                raise ProtocolError(f"unknown frame kind {kind}") from None
            if length > max_payload:
                raise ProtocolError(f"{frame_kind.name} frame of {length} bytes > limit {max_payload}")
            payload = await reader.readexactly(length) if length else b""
    except asyncio.IncompleteReadError as e:
        raise PeerUnreachableError(f"stream closed after {len(e.partial)} bytes of a frame") from e
    except TimeoutError as e:
        raise PeerUnreachableError(f"no frame within {timeout:.1f} s") from e
    except ConnectionError as e:
        raise PeerUnreachableError(f"stream broke: {e}") from e
    return frame_kind, payload
