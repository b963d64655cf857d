import asyncio
import dataclasses
import random

import pytest

from fusionp2p.config import ProbeConfig
from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.memory_transport import MemoryTransport
from fusionp2p.net.probe import NEAR_LINKS, LinkEstimator, LinkSample, probe_bytes, probe_link, serve_probe
from fusionp2p.net.transport import RateLimitedTransport
from fusionp2p.records import MAX_LINKS_PER_PEER, PROBE_PROTOCOL, LinkSetRecord


def _serve(transport: MemoryTransport, max_bytes: int, errors: list) -> None:
    async def handler(stream) -> None:
        try:
            await serve_probe(stream, max_bytes=max_bytes, timeout=5)
        except ProtocolError as e:
            errors.append(e)
            raise

    return handler


@pytest.mark.parametrize("rate", [2e6, 8e6])
def test_probe_measures_a_rate_limited_link_within_20_percent(rate: float) -> None:
    async def run() -> LinkSample:
        hub: dict = {}
        client, server = MemoryTransport("QmA", hub), MemoryTransport("QmB", hub)
        await server.serve(PROBE_PROTOCOL, _serve(server, 16 << 20, []))
        limited = RateLimitedTransport(client, rate)
        return await probe_link(limited, "QmB", nbytes=int(rate * 0.5), ping_count=3, timeout=10)

    sample = asyncio.run(run())
    assert abs(sample.bandwidth_bytes_per_s - rate) / rate < 0.2, sample
    assert sample.rtt_s >= 0


def test_probe_server_rejects_a_probe_over_its_byte_limit_and_keeps_serving() -> None:
    async def run() -> list:
        hub: dict = {}
        client, server = MemoryTransport("QmA", hub), MemoryTransport("QmB", hub)
        errors: list = []
        await server.serve(PROBE_PROTOCOL, _serve(server, 1 << 20, errors))
        with pytest.raises((PeerUnreachableError, ProtocolError)):
            await probe_link(client, "QmB", nbytes=4 << 20, ping_count=1, timeout=5)
        ok = await probe_link(client, "QmB", nbytes=512 << 10, ping_count=1, timeout=5)
        assert ok.nbytes == 512 << 10
        stream = await client.open("QmB", PROBE_PROTOCOL, timeout=5)
        await stream.send(FrameKind.ACK, b"out of order")
        kind, reason = await stream.recv(max_payload=4096, timeout=5)
        assert kind is FrameKind.ERROR and b"unexpected ACK" in reason
        with pytest.raises(PeerUnreachableError):
            await stream.recv(max_payload=8, timeout=5)
        await client.aclose()
        await server.aclose()
        return errors

    errors = asyncio.run(run())
    assert any("limit" in str(e) for e in errors)
    assert any("unexpected ACK" in str(e) for e in errors)


def _sample(bw: float, rtt: float = 0.01) -> LinkSample:
    return LinkSample(bandwidth_bytes_per_s=bw, rtt_s=rtt, nbytes=1, seconds=1.0)


def test_estimator_keeps_the_best_of_its_last_samples_and_sizes_probes() -> None:
    config = ProbeConfig(
        window=2, target_seconds=0.5, min_bytes=1000, initial_bytes=2000, max_bytes=10_000_000
    )
    est = LinkEstimator("QmA", config)
    assert est.next_probe_bytes("QmB") == 2000
    first = est.update("QmB", _sample(100e6, 0.02), now=10.0)
    assert (first.bandwidth_bytes_per_s, first.rtt_s, first.samples) == (100e6, 0.02, 1)
    congested = est.update("QmB", _sample(5e6, 0.2), now=20.0)  # shared with a transfer
    assert (congested.bandwidth_bytes_per_s, congested.rtt_s) == (100e6, 0.02)
    assert congested.samples == 2 and congested.measured_at == 20.0
    assert est.next_probe_bytes("QmB") == 10_000_000  # 100 MB/s * 0.5 s, capped
    slower = est.update("QmB", _sample(8e6, 0.05), now=30.0)  # the fast sample left the window
    assert (slower.bandwidth_bytes_per_s, slower.rtt_s) == (8e6, 0.05)
    assert est.next_probe_bytes("QmB") == 4 << 20  # 50 ms RTT: a long-haul link's floor
    est.update("QmC", _sample(1000.0), now=20.0)
    assert est.next_probe_bytes("QmC") == 1000  # floored
    assert [r.dst for r in est.records(now=35.0, max_age=20.0)] == ["QmB", "QmC"]
    assert est.records(now=100.0, max_age=10.0) == []
    est.forget(["QmB"])
    assert est.known_peers() == {"QmC"}


def test_estimator_probes_a_bounded_sample_preferring_unmeasured_then_stalest() -> None:
    config = ProbeConfig(fanout=2, period=10.0)
    est = LinkEstimator("QmA", config, rng=random.Random(0))
    peers = ["QmA", "QmB", "QmC", "QmD", "QmE"]
    est.update("QmB", _sample(1e6), now=100.0)
    est.update("QmC", _sample(1e6), now=50.0)
    chosen = est.choose_targets(peers, now=101.0)
    assert sorted(chosen) == ["QmD", "QmE"]  # never measured first, never self
    est.update("QmD", _sample(1e6), now=101.0)
    est.update("QmE", _sample(1e6), now=101.0)
    assert est.choose_targets(peers, now=102.0) == ["QmC"]  # stalest; B, D, E too fresh
    assert len(est.choose_targets([f"Qm{i}" for i in range(1000)], now=0.0)) == 2


def test_a_busy_peer_probes_less_often() -> None:
    est = LinkEstimator("QmA", ProbeConfig(period=10.0, busy_slowdown=4.0))
    assert est.probe_interval(busy=False) == 10.0
    assert est.probe_interval(busy=True) == 40.0


def test_estimator_keeps_its_fastest_links_and_a_rotating_sample_of_the_rest() -> None:
    est = LinkEstimator("QmA", ProbeConfig())
    for i in range(MAX_LINKS_PER_PEER + 6):  # peer i measured at time i, Qm0 the fastest
        est.update(f"Qm{i}", _sample(1e9 / (i + 1)), now=float(i))
    records = est.records(now=100.0, max_age=1000.0)
    assert len(records) == MAX_LINKS_PER_PEER
    kept = {r.dst for r in records}
    near = {f"Qm{i}" for i in range(NEAR_LINKS)}
    newest = {f"Qm{i}" for i in range(MAX_LINKS_PER_PEER + 6 - (MAX_LINKS_PER_PEER - NEAR_LINKS), 70)}
    assert kept == near | newest  # the slow ones measured longest ago are dropped
    assert est.fastest(2) == ["Qm0", "Qm1"]


def test_a_full_estimator_explores_hints_and_random_peers_and_re_measures_the_stalest() -> None:
    est = LinkEstimator("QmA", ProbeConfig(fanout=3, period=10.0), rng=random.Random(1))
    for i in range(MAX_LINKS_PER_PEER):
        est.update(f"Qm{i}", _sample(1e6), now=float(i))
    others = [f"QmNew{i}" for i in range(100)]
    chosen = est.choose_targets([f"Qm{i}" for i in range(MAX_LINKS_PER_PEER)] + others, 100.0, ["QmNew7"])
    assert chosen[0] == "QmNew7"  # one exploration slot, the hint first
    assert chosen[1:] == ["Qm0", "Qm1"]  # then the stalest links
    chosen = est.choose_targets(others, 100.0, [])
    assert len(chosen) == 3 and set(chosen) <= set(others)  # nothing of its own is due: explore


def test_probes_of_a_long_haul_link_carry_its_bandwidth_delay_product_and_report_their_size() -> None:
    config = ProbeConfig(target_seconds=0.4, min_bytes=256 << 10, max_bytes=16 << 20)
    assert probe_bytes(100e6, 1e-3, config) == 16 << 20  # 0.4 s of a fast LAN link, capped
    assert probe_bytes(1e6, 1e-3, config) == 400_000  # a slow near link: 0.4 s of it
    assert probe_bytes(1e6, 0.08, config) == 4 << 20  # 80 ms: the long-haul floor, not 0.4 s
    assert probe_bytes(1e6, 0.2, config) == 4 << 20  # 8 BDPs (1.6 MB) are below the floor
    assert probe_bytes(5e6, 0.2, config) == 8_000_000  # 8 BDPs of 5 MB/s at 200 ms
    est = LinkEstimator("QmA", config)
    est.update("QmB", LinkSample(3e6, 0.08, 1 << 20, 0.5), now=1.0)
    best = est.update("QmB", LinkSample(5e6, 0.08, 4 << 20, 0.9), now=2.0)
    assert best.probe_bytes == 4 << 20  # the size of the probe the estimate comes from
    again = est.update("QmB", LinkSample(4e6, 0.08, 4 << 20, 1.1), now=3.0)
    assert (again.bandwidth_bytes_per_s, again.probe_bytes) == (5e6, 4 << 20)
    (packed,) = LinkSetRecord.pack([best])
    assert LinkSetRecord.from_wire(packed.to_wire()).links()[0].probe_bytes == 4 << 20
    older = dataclasses.replace(packed, probe_bytes=())  # a set from before sizes were reported
    assert LinkSetRecord.from_wire(older.to_wire()).links()[0].probe_bytes == 0
