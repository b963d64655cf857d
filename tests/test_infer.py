"""Inferring the pairs nobody measured (planning/infer.py) from a bounded sample of links."""

from __future__ import annotations

import numpy as np

from fusionp2p.planning import Topology
from fusionp2p.planning.infer import infer_unmeasured
from fusionp2p.planning.synthetic import synthetic_network
from fusionp2p.planning.topology import connected_to
from fusionp2p.records import LinkRecord, PeerRecord


def _sampled(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(true bw, true latency, measured bw with NaN, measured latency with NaN): each peer
    measured 16 peers of its cluster and 8 others, as a bounded probe policy would."""
    net = synthetic_network(seed, n, cluster_size=30)
    rng = np.random.default_rng(seed)
    bw, lat = np.full((n, n), np.nan), np.full((n, n), np.nan)
    for i in range(n):
        own = np.flatnonzero((net.labels == net.labels[i]) & (np.arange(n) != i))
        others = np.flatnonzero(net.labels != net.labels[i])
        for j in [*rng.choice(own, min(16, len(own)), replace=False), *rng.choice(others, 8, replace=False)]:
            bw[i, j], lat[i, j] = net.bandwidth[i, j], net.latency[i, j]
    return net.bandwidth, net.latency, bw, lat


def test_unmeasured_pairs_are_inferred_close_to_the_truth_and_measured_ones_kept() -> None:
    true_bw, true_lat, bw, lat = _sampled(3, 240)
    got_bw, got_lat = infer_unmeasured(bw, lat)
    off = ~np.eye(len(bw), dtype=bool)
    measured = ~np.isnan(bw)
    assert np.array_equal(got_bw[measured], bw[measured]) and np.array_equal(got_lat[measured], lat[measured])
    assert measured.sum() < 0.15 * off.sum()  # most pairs were never measured
    guess = off & ~measured
    rel = np.abs(got_bw[guess] - true_bw[guess]) / true_bw[guess]
    assert np.median(rel) < 0.15 and np.percentile(rel, 90) < 0.5
    assert np.median(np.abs(got_lat[guess] - true_lat[guess]) / true_lat[guess]) < 0.15
    # a peer behind a slow uplink: nothing inferred out of it is faster than what it was measured at
    slowest = int(np.argmin(np.nanmax(bw, axis=1)))
    assert np.max(got_bw[slowest, guess[slowest]]) <= np.nanmax(bw[slowest])
    assert np.all(np.isinf(np.diag(got_bw))) and np.all(np.diag(got_lat) == 0)


def test_a_fully_measured_swarm_is_left_as_it_is() -> None:
    rng = np.random.default_rng(0)
    bw, lat = rng.uniform(1e6, 1e9, (5, 5)), rng.uniform(0, 0.05, (5, 5))
    got_bw, got_lat = infer_unmeasured(bw, lat)
    off = ~np.eye(5, dtype=bool)
    assert np.array_equal(got_bw[off], bw[off]) and np.array_equal(got_lat[off], lat[off])


def _peer(pid: str) -> PeerRecord:
    return PeerRecord(pid, (), "cpu", "test", {"float32": 1e12}, 1 << 30, 1 << 30, "idle", 0.0, 0.0)


def test_a_subset_of_the_swarm_travels_as_records_and_comes_back_the_same() -> None:
    _, _, bw, lat = _sampled(5, 90)
    ids = [f"Qm{i:03d}" for i in range(90)]
    links = [
        LinkRecord(ids[i], ids[j], float(bw[i, j]), float(2 * lat[i, j]), 0.0)
        for i, j in zip(*np.nonzero(~np.isnan(bw)), strict=True)
    ]
    swarm = Topology.from_records([_peer(p) for p in ids], links)
    chosen = swarm.subset(ids[:7])
    records = chosen.link_records(0.0)
    assert len(records) == 7 * 6 and any(r.extra.get("inferred") for r in records)
    again = Topology.from_records([_peer(p) for p in ids[:7]], records)
    assert np.allclose(again.bandwidth, chosen.bandwidth) and np.allclose(again.latency, chosen.latency)


def test_only_peers_that_measured_links_reach_are_placeable() -> None:
    links = [
        LinkRecord("a", "b", 1.0, 0.0, 0.0),
        LinkRecord("c", "b", 1.0, 0.0, 0.0),
        LinkRecord("d", "e", 1.0, 0.0, 0.0),
    ]
    assert connected_to("a", links) == {"a", "b", "c"}
    assert connected_to("z", links) == {"z"}
