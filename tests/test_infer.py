"""Inferring the pairs nobody measured (planning/infer.py) from a bounded sample of links."""

from __future__ import annotations

import numpy as np

from fusionp2p.planning import Topology
from fusionp2p.planning.infer import infer_unmeasured
from fusionp2p.planning.synthetic import synthetic_network
from fusionp2p.planning.topology import connected_to
from fusionp2p.planning.vouch import ASYMMETRY, vouched_links
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


def _link(src: str, dst: str, bw: float, rtt: float = 2e-3, at: float = 0.0) -> LinkRecord:
    return LinkRecord(src, dst, bw, rtt, at)


def test_a_link_counts_once_both_ends_vouch_for_it_at_no_more_than_the_asymmetry() -> None:
    links = [
        _link("a", "b", 1e12, rtt=1e-4),  # a liar's claim of its own link
        _link("b", "a", 1e8, rtt=2e-2),
        _link("a", "c", 5e7),  # c never measured a: nobody vouches for it
        _link("d", "c", 3e7),  # d is trusted (the planning peer): its own measurement counts
        _link("b", "a", 2e8, rtt=2e-2, at=-1.0),  # an older record of b -> a
    ]
    got = {(lk.src, lk.dst): lk for lk in vouched_links(links, trusted={"d"})}
    assert set(got) == {("a", "b"), ("b", "a"), ("d", "c")}
    assert got["a", "b"].bandwidth_bytes_per_s == ASYMMETRY * 1e8 and got["a", "b"].rtt_s == 2e-2
    assert got["b", "a"].bandwidth_bytes_per_s == 1e8 and got["d", "c"].bandwidth_bytes_per_s == 3e7


def _two_sites(rng: np.random.Generator) -> tuple[list[str], list[str], list[LinkRecord]]:
    """Sites A and B, 13 honest peers each: 1 GB/s and 1 ms inside a site, ~100 MB/s and 40 ms
    between them; each A peer and one B peer measured each other, every other cross pair is
    unmeasured."""
    a, b = [f"QmA{i:02d}" for i in range(13)], [f"QmB{i:02d}" for i in range(13)]
    links = []
    for site in (a, b):
        links += [_link(u, v, 1e9 * rng.uniform(0.9, 1.1), 1e-3) for u in site for v in site if u != v]
    for u, v in zip(a, b, strict=True):
        links += [
            _link(u, v, 1e8 * rng.uniform(0.9, 1.1), 0.04),
            _link(v, u, 1e8 * rng.uniform(0.9, 1.1), 0.04),
        ]
    return a, b, links


def _sybils(a: list[str], b: list[str], claim: float) -> tuple[list[str], list[LinkRecord]]:
    """4 sybils in site A (A's peers measured them as near as they are) publishing ``claim``
    B/s to every B peer; B's peers measured them at 100 MB/s."""
    sybils = [f"QmS{i:02d}" for i in range(4)]
    links = []
    for s in sybils:
        links += [lk for u in a for lk in (_link(s, u, 1e9, 1e-3), _link(u, s, 1e9, 1e-3))]
        links += [lk for v in b for lk in (_link(s, v, claim, 0.04), _link(v, s, 1e8, 0.04))]
    return sybils, links


def _cross(topo: Topology, a: list[str], b: list[str]) -> np.ndarray:
    """The inferred A -> B bandwidths of the honest pairs nobody measured."""
    ia = [topo.peer_ids.index(p) for p in a]
    ib = [topo.peer_ids.index(p) for p in b]
    sub, measured = topo.bandwidth[np.ix_(ia, ib)], topo.measured[np.ix_(ia, ib)]
    return sub[~measured]


def test_sybils_move_inferred_honest_pairs_no_further_than_the_documented_bound() -> None:
    rng = np.random.default_rng(7)
    a, b, honest = _two_sites(rng)
    m, k = len(a), 4
    votes = [lk.bandwidth_bytes_per_s for lk in honest if lk.src in a and lk.dst in b]  # one each
    low = np.percentile(votes, 75 - 25 * k / (m - 1))
    high = np.percentile(votes, min(100.0, 75 + 75 * k / (m - 1)))
    for claim in (1e3, 1e12):  # sybils dragging pairs to 1 KB/s, or lifting them to 1 TB/s
        sybils, lies = _sybils(a, b, claim)
        records = vouched_links([*honest, *lies])
        topo = Topology.from_records([_peer(p) for p in (*a, *b, *sybils)], records)
        inferred = _cross(topo, a, b)
        assert len(inferred) == m * m - m
        assert low <= inferred.min() and inferred.max() <= high, (claim, inferred.min(), inferred.max())
    clean = Topology.from_records([_peer(p) for p in (*a, *b)], vouched_links(honest))
    assert np.all((low <= _cross(clean, a, b)) & (_cross(clean, a, b) <= high))
