"""Every transport passes the same conformance checks; the rate limiter paces to its rate."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from hivemind.p2p import P2P

from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.memory_transport import MemoryTransport
from fusionp2p.net.transport import (
    FrameStream,
    P2PTransport,
    RateLimitedTransport,
    TokenBucket,
    Transport,
)


@contextlib.asynccontextmanager
async def memory_pair() -> AsyncIterator[tuple[Transport, Transport]]:
    hub: dict = {}
    a, b = MemoryTransport("QmA", hub), MemoryTransport("QmB", hub)
    yield a, b
    await a.aclose()
    await b.aclose()


@contextlib.asynccontextmanager
async def p2p_pair() -> AsyncIterator[tuple[Transport, Transport]]:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    second = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        initial_peers=[str(m) for m in await first.get_visible_maddrs()],
    )
    try:
        yield P2PTransport(first), P2PTransport(second)
    finally:
        await second.shutdown()
        await first.shutdown()


async def _echo(stream: FrameStream) -> None:
    while True:
        kind, payload = await stream.recv(max_payload=4 << 20, timeout=5)
        if kind is FrameKind.END:
            return
        if kind is FrameKind.ERROR:
            raise ProtocolError("client asked for an error")
        await stream.send(FrameKind.PONG, payload)


@pytest.mark.parametrize("pair", [memory_pair, p2p_pair], ids=["memory", "p2p"])
def test_transport_conformance(pair) -> None:
    async def run() -> None:
        async with pair() as (client, server):
            await server.serve("test.echo", _echo)
            stream = await client.open(server.peer_id, "test.echo", timeout=10)
            for payload in (b"", b"hello", bytes(3 << 20)):
                await stream.send(FrameKind.PING, payload)
                assert await stream.recv(max_payload=4 << 20, timeout=10) == (FrameKind.PONG, payload)
            await stream.send(FrameKind.END)
            await stream.close()

            # a handler that fails tells the sender why, ends the stream, and the server goes on
            broken = await client.open(server.peer_id, "test.echo", timeout=10)
            await broken.send(FrameKind.ERROR)
            assert await broken.recv(max_payload=4096, timeout=5) == (
                FrameKind.ERROR,
                b"client asked for an error",
            )
            with pytest.raises(PeerUnreachableError):
                await broken.recv(max_payload=16, timeout=5)
            await broken.close()
            again = await client.open(server.peer_id, "test.echo", timeout=10)
            await again.send(FrameKind.PING, b"still here")
            assert await again.recv(max_payload=64, timeout=10) == (FrameKind.PONG, b"still here")
            await again.close()

            with pytest.raises(PeerUnreachableError):
                await client.open(server.peer_id, "test.nobody-serves-this", timeout=5)

    asyncio.run(run())


def test_token_bucket_paces_to_its_rate() -> None:
    async def run() -> float:
        bucket = TokenBucket(rate=2e6)
        start = time.perf_counter()
        for _ in range(16):
            await bucket.acquire(64 << 10)
        return (16 * (64 << 10)) / (time.perf_counter() - start)

    rate = asyncio.run(run())
    assert 1.6e6 < rate < 2.4e6, rate


def test_rate_limited_transport_paces_outgoing_frames() -> None:
    async def run() -> float:
        async with memory_pair() as (client, server):
            limited = RateLimitedTransport(client, bytes_per_second=4e6)
            await server.serve("test.echo", _echo)
            stream = await limited.open(server.peer_id, "test.echo", timeout=5)
            start = time.perf_counter()
            await stream.send(FrameKind.PING, bytes(2 << 20))
            await stream.recv(max_payload=4 << 20, timeout=10)
            elapsed = time.perf_counter() - start
            await stream.send(FrameKind.END)
            await stream.close()
            return (2 << 20) / elapsed

    rate = asyncio.run(run())
    assert 3.2e6 < rate < 4.8e6, rate
