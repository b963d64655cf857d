"""Seeded synthetic swarms for tests and benchmarks, built as real records.

Clusters of peers with fast links inside (1-10 Gbit/s) and slow links between
(8 Mbit/s - 1 Gbit/s, log-uniform), compute varying 10x (10-100 TFLOP/s, log-uniform),
memory from common GPU sizes. Links are slightly asymmetric. The records go through
``Topology.from_records``, the same path a live swarm's records take.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusionp2p.records import LinkRecord, PeerRecord

__all__ = ["SyntheticNetwork", "synthetic_network", "synthetic_swarm"]

GBIT = 1e9 / 8
MBIT = 1e6 / 8


def synthetic_swarm(
    seed: int,
    *,
    n_peers: int | None = None,
    n_clusters: int | None = None,
    memory_gib: tuple[int, ...] = (16, 24, 40, 80),
) -> tuple[list[PeerRecord], list[LinkRecord], list[int]]:
    """(peers, links, cluster label per peer) of one synthetic swarm."""
    rng = np.random.default_rng(seed)
    k = n_clusters or int(rng.integers(2, 5))
    n = n_peers or int(rng.integers(max(4, k), 17))
    labels = np.concatenate([np.arange(k), rng.integers(0, k, n - k)])
    rng.shuffle(labels)
    intra = rng.uniform(1, 10, k) * GBIT
    inter = np.exp(rng.uniform(np.log(8 * MBIT), np.log(1 * GBIT), (k, k)))
    inter = np.minimum(inter, inter.T)
    ids = [f"QmSynthetic{seed:04d}Peer{i:04d}" for i in range(n)]
    peers = [
        PeerRecord(
            peer_id=ids[i],
            maddrs=(),
            device="cuda:0",
            device_name="synthetic",
            flops={"float32": float(np.exp(rng.uniform(np.log(10e12), np.log(100e12))))},
            memory_bytes=int(rng.choice(memory_gib)) << 30,
            total_memory_bytes=80 << 30,
            state="idle",
            started_at=0.0,
            updated_at=0.0,
        )
        for i in range(n)
    ]
    links = []
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            same = labels[i] == labels[j]
            bw = (intra[labels[i]] if same else inter[labels[i], labels[j]]) * rng.uniform(0.85, 1.15)
            rtt = rng.uniform(0.1e-3, 1e-3) if same else rng.uniform(10e-3, 150e-3)
            links.append(
                LinkRecord(
                    src=ids[i], dst=ids[j], bandwidth_bytes_per_s=float(bw), rtt_s=float(rtt), measured_at=0.0
                )
            )
    return peers, links, labels.tolist()


@dataclass(frozen=True)
class SyntheticNetwork:
    """A swarm's true measurements, for simulating what its peers would probe."""

    labels: np.ndarray  # cluster per peer
    bandwidth: np.ndarray  # (n, n) bytes/s
    latency: np.ndarray  # (n, n) one-way seconds
    speed: np.ndarray  # FLOP/s
    memory: np.ndarray  # bytes

    def __len__(self) -> int:
        return len(self.labels)


def synthetic_network(
    seed: int, n_peers: int, *, cluster_size: int = 50, capped: float = 0.2
) -> SyntheticNetwork:
    """Clusters of about ``cluster_size`` peers as in ``synthetic_swarm``, where a fraction
    ``capped`` of the peers sit behind a slow access link (20-200 Mbit/s up, 2-5x that
    down): a link carries min(its clusters' path, the sender's uplink, the receiver's
    downlink), +-10%."""
    rng = np.random.default_rng(seed)
    k = max(2, round(n_peers / cluster_size))
    labels = np.concatenate([np.arange(k), rng.integers(0, k, n_peers - k)])
    rng.shuffle(labels)
    intra = rng.uniform(1, 10, k) * GBIT
    inter = np.exp(rng.uniform(np.log(8 * MBIT), np.log(1 * GBIT), (k, k)))
    inter = np.minimum(inter, inter.T)
    np.fill_diagonal(inter, intra)
    up = np.full(n_peers, np.inf)
    down = np.full(n_peers, np.inf)
    slow = rng.random(n_peers) < capped
    up[slow] = np.exp(rng.uniform(np.log(20 * MBIT), np.log(200 * MBIT), slow.sum()))
    down[slow] = up[slow] * rng.uniform(2, 5, slow.sum())
    base = inter[labels][:, labels]
    bandwidth = np.minimum(base, np.minimum(up[:, None], down[None, :])) * rng.uniform(0.9, 1.1, base.shape)
    pair_delay = rng.uniform(5e-3, 75e-3, (k, k))
    pair_delay = (pair_delay + pair_delay.T) / 2
    np.fill_diagonal(pair_delay, rng.uniform(0.05e-3, 0.5e-3, k))
    latency = pair_delay[labels][:, labels] * rng.uniform(0.95, 1.05, base.shape)
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    speed = np.exp(rng.uniform(np.log(10e12), np.log(100e12), n_peers))
    memory = rng.choice([16, 24, 40, 80], n_peers).astype(float) * (1 << 30)
    return SyntheticNetwork(labels, bandwidth, latency, speed, memory)
