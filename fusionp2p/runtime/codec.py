"""The client side of the exec protocol's streams, and reading a message header off one.

A message is laid out as ``records.exec`` says (header length, header record, body).
Every message gets one reply frame: ACK, ERROR (a UTF-8 reason) or DATA (a fetch, itself
a message). A server reads a message in three steps (``read_message_header`` and then the
body, see ``service.py``) so that it can refuse a body before it holds a byte of it.
``ExecClient`` is one request/reply stream to one peer, reopened when it sat idle longer
than a server keeps idle streams open.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import PeerUnreachableError, ProtocolError, RecordError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.records import (
    CONTROL_REPLY_BYTES,
    EXEC_PROTOCOL,
    MAX_RECORD_BYTES,
    ExecHeader,
    decode_exec_header,
    pack_message,
    split_message,
)
from fusionp2p.records.exec import MESSAGE_HEADER_LEN

__all__ = ["ExecClient", "read_message_header", "unpack_message"]


def unpack_message(payload: bytes | bytearray) -> tuple[ExecHeader, bytes | bytearray]:
    """A whole message's header and body (``records.split_message``).

    Raises:
        ProtocolError: the message is malformed.
    """
    try:
        return split_message(payload)
    except RecordError as e:
        raise ProtocolError(f"bad message: {e}") from e


async def read_message_header(stream: FrameStream, frame_length: int, *, stall_timeout: float) -> ExecHeader:
    """Reads the header of a message whose DATA frame declared ``frame_length`` bytes;
    the body (``header.body_bytes``, checked against the frame) is left unread.

    Raises:
        ProtocolError: the header is too long, malformed, or disagrees with the frame.
        PeerUnreachableError: the stream ended or stalled.
    """
    prefix = MESSAGE_HEADER_LEN.size
    if frame_length < prefix:
        raise ProtocolError(f"message of {frame_length} bytes has no header")
    (size,) = MESSAGE_HEADER_LEN.unpack(await stream.recv_exactly(prefix, stall_timeout=stall_timeout))
    if size > MAX_RECORD_BYTES or prefix + size > frame_length:
        raise ProtocolError(
            f"message header of {size} bytes (limit {MAX_RECORD_BYTES}, frame {frame_length})"
        )
    try:
        header = decode_exec_header(await stream.recv_exactly(size, stall_timeout=stall_timeout))
    except RecordError as e:
        raise ProtocolError(f"bad message header: {e}") from e
    if frame_length - prefix - size != header.body_bytes:
        raise ProtocolError(
            f"{header.KIND} declares a body of {header.body_bytes} bytes, the frame carries "
            f"{frame_length - prefix - size}"
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
                    await self._stream.send(FrameKind.END, timeout=DEFAULT_TIMEOUTS.courtesy)
                await self._drop()
