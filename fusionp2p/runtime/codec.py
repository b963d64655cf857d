"""The exec protocol's messages, and the client side of its streams.

    frame payload = header_len:u16 | header (an OpData or ExecControl record) | body

Every message gets one reply frame: ACK, ERROR (a UTF-8 reason) or DATA (a fetch, itself
a message). A server reads a message in three steps (``read_message_header`` and then the
body, see ``service.py``) so that it can refuse a body before it holds a byte of it.
``ExecClient`` is one request/reply stream to one peer, reopened when it sat idle longer
than a server keeps idle streams open.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time

from fusionp2p.errors import PeerUnreachableError, ProtocolError, RecordError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.records import MAX_RECORD_BYTES, ExecControl, OpData, decode_record

__all__ = [
    "CONTROL_REPLY_BYTES",
    "CREDIT",
    "EXEC_PROTOCOL",
    "ExecClient",
    "ExecHeader",
    "decode_header",
    "message_parts",
    "pack_message",
    "read_message_header",
    "unpack_message",
]

EXEC_PROTOCOL = "/fusionp2p/exec/2"
CONTROL_REPLY_BYTES = 4 << 10  # an ACK or an ERROR reason
CREDIT = struct.Struct("!Q")  # an OpData ACK's payload: bytes the receiver takes in flight from this sender
STEP_REPLY = struct.Struct("!dI")  # a step ACK's payload: seconds computed, most micro-batches held at once
_LEN = struct.Struct("!H")
ExecHeader = OpData | ExecControl


def message_parts(
    header: ExecHeader, body: bytes | bytearray | memoryview = b""
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """A message as (length-prefixed header, body): written one after the other, no copy of the body."""
    wire = header.to_wire()
    return _LEN.pack(len(wire)) + wire, body


def pack_message(header: ExecHeader, body: bytes = b"") -> bytes:
    prefix, _ = message_parts(header)
    return prefix + body


def decode_header(data: bytes | bytearray) -> ExecHeader:
    """Raises ProtocolError unless ``data`` is an OpData or ExecControl record."""
    try:
        header = decode_record(data)
    except RecordError as e:
        raise ProtocolError(f"bad message header: {e}") from e
    if not isinstance(header, (OpData, ExecControl)):
        raise ProtocolError(f"a {header.KIND!r} record is not an exec message")
    return header


def unpack_message(payload: bytes | bytearray) -> tuple[ExecHeader, bytes | bytearray]:
    """Splits a whole message and decodes its header.

    Raises:
        ProtocolError: too short, a header that is not an OpData or ExecControl record, or
            a body whose length disagrees with the header.
    """
    if len(payload) < _LEN.size:
        raise ProtocolError(f"message of {len(payload)} bytes has no header")
    (size,) = _LEN.unpack_from(payload)
    if _LEN.size + size > len(payload):
        raise ProtocolError(f"header of {size} bytes in a message of {len(payload)}")
    header = decode_header(payload[_LEN.size : _LEN.size + size])
    body = payload[_LEN.size + size :]
    if len(body) != header.body_bytes:
        raise ProtocolError(f"body of {len(body)} bytes, header says {header.body_bytes}")
    return header, body


async def read_message_header(stream: FrameStream, frame_length: int, *, stall_timeout: float) -> ExecHeader:
    """Reads the header of a message whose DATA frame declared ``frame_length`` bytes;
    the body (``header.body_bytes``, checked against the frame) is left unread.

    Raises:
        ProtocolError: the header is too long, malformed, or disagrees with the frame.
        PeerUnreachableError: the stream ended or stalled.
    """
    if frame_length < _LEN.size:
        raise ProtocolError(f"message of {frame_length} bytes has no header")
    (size,) = _LEN.unpack(await stream.recv_exactly(_LEN.size, stall_timeout=stall_timeout))
    if size > MAX_RECORD_BYTES or _LEN.size + size > frame_length:
        raise ProtocolError(
            f"message header of {size} bytes (limit {MAX_RECORD_BYTES}, frame {frame_length})"
        )
    header = decode_header(await stream.recv_exactly(size, stall_timeout=stall_timeout))
    if frame_length - _LEN.size - size != header.body_bytes:
        raise ProtocolError(
            f"{header.KIND} declares a body of {header.body_bytes} bytes, the frame carries "
            f"{frame_length - _LEN.size - size}"
        )
    return header


class ExecClient:
    """Requests to one peer's exec protocol over one stream, one at a time.

    The stream is opened on first use and reopened after it sat idle ``reopen_after``
    seconds (servers close idle streams), or after it broke.
    """

    def __init__(
        self, transport: Transport, peer_id: str, *, timeout: float, reopen_after: float = 10.0
    ) -> None:
        self.transport = transport
        self.peer_id = peer_id
        self.timeout = timeout
        self.reopen_after = reopen_after
        self._stream: FrameStream | None = None
        self._last_used = 0.0
        self._lock = asyncio.Lock()

    async def request(
        self, header: ExecHeader, body: bytes = b"", *, max_reply: int = CONTROL_REPLY_BYTES
    ) -> tuple[FrameKind, bytes | bytearray]:
        """Sends one message and returns the reply frame (ACK or DATA).

        Raises:
            ProtocolError: the peer answered ERROR (its reason is in the message), or a
                reply over ``max_reply`` bytes.
            PeerUnreachableError: the stream could not be opened, broke, or no reply came
                within the timeout.
        """
        async with self._lock:
            if self._stream is not None and time.monotonic() - self._last_used > self.reopen_after:
                await self._drop()
            if self._stream is None:
                self._stream = await self.transport.open(self.peer_id, EXEC_PROTOCOL, timeout=self.timeout)
            stream = self._stream
            try:
                await stream.send(FrameKind.DATA, pack_message(header, body), timeout=self.timeout)
                kind, reply = await stream.recv(max_payload=max_reply, timeout=self.timeout)
            except (PeerUnreachableError, ProtocolError):
                await self._drop()
                raise
            finally:
                self._last_used = time.monotonic()
        if kind is FrameKind.ERROR:
            raise ProtocolError(
                f"peer {self.peer_id[:12]} refused {header.KIND} "
                f"{getattr(header, 'command', '')}: {reply.decode(errors='replace')}"
            )
        if kind not in (FrameKind.ACK, FrameKind.DATA):
            await self._drop()
            raise ProtocolError(f"peer {self.peer_id[:12]} answered {kind.name} to {header.KIND}")
        return kind, reply

    async def _drop(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.close()

    async def aclose(self) -> None:
        """Ends the stream politely (END) and closes it; never raises."""
        async with self._lock:
            if self._stream is not None:
                with contextlib.suppress(Exception):  # the peer may be gone already
                    await self._stream.send(FrameKind.END, timeout=2.0)
                await self._drop()
