import asyncio
import time

import pytest

from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import FRAME_VERSION, HEADER, FrameKind, read_exactly, read_frame, write_frame


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


def test_a_frame_dripped_slower_than_the_minimum_rate_is_dropped() -> None:
    """Each 64 KiB piece comes before the stall deadline, yet the whole frame is too slow: a
    sender cannot hold a large buffer on the peer by dripping it."""

    async def run(min_rate: float) -> float:
        reader = asyncio.StreamReader()

        async def drip() -> None:
            for _ in range(4):
                reader.feed_data(b"\x00" * (64 << 10))
                await asyncio.sleep(0.2)  # each piece within the 0.3 s stall timeout: 0.8 s in all

        dripper = asyncio.create_task(drip())
        start = time.monotonic()
        try:
            await read_exactly(reader, 256 << 10, stall_timeout=0.3, min_rate=min_rate)
        finally:
            dripper.cancel()
        return time.monotonic() - start

    with pytest.raises(PeerUnreachableError, match="too slow"):
        asyncio.run(run(min_rate=1 << 20))  # allowed 0.3 s + 256 KiB / (1 MiB/s) = 0.55 s
    assert asyncio.run(run(min_rate=256 << 10)) < 1.3  # a sender above the rate gets its frame
