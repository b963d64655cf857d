"""A probe over a long round trip measures what the link carries once settled.

Real hivemind P2P daemons on loopback; between them the stream benchmark's userspace relay
(``benchmarks/stream_bench.py``) delays every byte by 40 ms each way (+80 ms RTT), carries
50 Mbit/s and ramps up as TCP over that round trip would (slow start, again after idle):
the WAN link of issue 39. What the link carries is measured apart from
any probe's logic: the difference of a 16 MiB and a 4 MiB transfer's durations (ramp-up and
round trips cancel). A peer's estimate after three probe rounds (``LinkEstimator``: 1 MiB
first, then sized by time, bandwidth-delay product and the long-haul floor) must be within
20% of it (it reads ~11% under here; probes timed as a whole, at 0.4 s of their estimate,
read 49% under).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P

from fusionp2p.config import ProbeConfig
from fusionp2p.errors import PeerUnreachableError
from fusionp2p.net.probe import LinkEstimator, probe_link, serve_probe
from fusionp2p.net.transport import P2PTransport
from fusionp2p.records import PROBE_PROTOCOL

ROOT = Path(__file__).resolve().parents[1]
DELAY_MS = 40.0  # one way: the 81 ms RTT of issue 39's WAN
RATE_MBPS = 50.0
IDLE_S = 0.5  # longer than the relay's idle time before slow start begins again (0.3 s)


def _relay(to_port: int, info: Path) -> tuple[subprocess.Popen[bytes], int]:
    relay = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks.stream_bench", "--relay-to", str(to_port)),
            *("--delay-ms", str(DELAY_MS), "--rate-mbps", str(RATE_MBPS), "--slow-start"),
            *("--info", str(info)),
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while not info.exists():
        assert relay.poll() is None and time.monotonic() < deadline, "the relay did not start"
        time.sleep(0.1)
    return relay, json.loads(info.read_text())["port"]


def test_a_probe_over_40_ms_of_rtt_measures_within_20_percent_of_what_the_link_carries(
    tmp_path: Path,
) -> None:
    async def run(relay_port: int, server: P2P) -> tuple[float, float, float]:
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        try:
            transport = P2PTransport(client)
            target = server.peer_id.to_base58()
            await transport.connect(target, [f"/ip4/127.0.0.1/tcp/{relay_port}"], timeout=30)

            async def seconds(nbytes: int) -> float:
                await asyncio.sleep(IDLE_S)  # every transfer starts as a probe does, from slow start
                sample = await probe_link(transport, target, nbytes=nbytes, ping_count=3, timeout=120)
                return sample.seconds

            carried = []
            for _ in range(2):
                short, long = await seconds(4 << 20), await seconds(16 << 20)
                carried.append((12 << 20) / (long - short))
            estimator = LinkEstimator(transport.peer_id, ProbeConfig())
            for _ in range(3):
                nbytes = estimator.next_probe_bytes(target)
                await asyncio.sleep(IDLE_S)  # probes are seconds apart: each starts from slow start
                sample = await probe_link(transport, target, nbytes=nbytes, ping_count=3, timeout=120)
                record = estimator.update(target, sample, time.time())
            return max(carried), record.bandwidth_bytes_per_s, record.rtt_s
        finally:
            await client.shutdown()

    async def main() -> tuple[float, float, float]:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        relay = None
        try:
            served = P2PTransport(server)

            async def handler(stream) -> None:  # type: ignore[no-untyped-def]
                await serve_probe(stream, max_bytes=128 << 20, timeout=120)

            await served.serve(PROBE_PROTOCOL, handler)
            port = int(str((await server.get_visible_maddrs())[0]).split("/tcp/")[1].split("/")[0])
            relay, relay_port = _relay(port, tmp_path / "relay.json")
            try:
                return await run(relay_port, server)
            except PeerUnreachableError:  # the userspace relay's libp2p connection dropped
                # (seen once, in a full test run on a loaded machine): this test is about what a
                # probe measures, not the relay's endurance, so it measures once more
                return await run(relay_port, server)
        finally:
            if relay is not None:
                relay.terminate()
                relay.wait(30)
            await server.shutdown()

    carried, estimate, rtt = asyncio.run(main())
    assert rtt >= 2 * DELAY_MS / 1000
    assert abs(estimate - carried) / carried < 0.2, (estimate, carried)
    assert carried < RATE_MBPS * 1e6 / 8 * 1.05  # the relay's line, not loopback, was measured
