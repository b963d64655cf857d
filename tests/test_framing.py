import asyncio

import pytest

from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import FRAME_VERSION, HEADER, FrameKind, read_frame, write_frame


class _Sink:
    """A StreamWriter stand-in that feeds a StreamReader."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, data) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        return None


def test_write_and_read_are_inverse() -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        sink = _Sink(reader)
        payloads = [b"", b"x", bytes(range(256)) * 1000]
        for i, payload in enumerate(payloads):
            await write_frame(sink, FrameKind.DATA if i else FrameKind.PING, payload)
        got = [await read_frame(reader, max_payload=1 << 20, timeout=1) for _ in payloads]
        assert got == [(FrameKind.PING, b""), (FrameKind.DATA, b"x"), (FrameKind.DATA, payloads[2])]

    asyncio.run(run())


@pytest.mark.parametrize(
    ("header", "error", "match"),
    [
        (HEADER.pack(FRAME_VERSION + 1, 1, 0), ProtocolError, "version"),
        (HEADER.pack(FRAME_VERSION, 99, 0), ProtocolError, "unknown frame kind"),
        (HEADER.pack(FRAME_VERSION, 3, 1 << 30), ProtocolError, "limit"),
        (HEADER.pack(FRAME_VERSION, 3, 10) + b"short", PeerUnreachableError, "closed"),
        (b"\x01", PeerUnreachableError, "closed"),
    ],
)
def test_bad_frames_raise_clear_errors(header: bytes, error: type, match: str) -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(header)
        reader.feed_eof()
        with pytest.raises(error, match=match):
            await read_frame(reader, max_payload=1 << 20, timeout=1)

    asyncio.run(run())


def test_a_silent_peer_hits_the_deadline() -> None:
    async def run() -> None:
        with pytest.raises(PeerUnreachableError, match="no frame within"):
            await read_frame(asyncio.StreamReader(), max_payload=10, timeout=0.2)

    asyncio.run(run())
