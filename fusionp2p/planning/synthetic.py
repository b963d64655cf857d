"""Seeded synthetic swarms for tests and benchmarks, built as real records.

Clusters of peers with fast links inside (1-10 Gbit/s) and slow links between
(8 Mbit/s - 1 Gbit/s, log-uniform), compute varying 10x (10-100 TFLOP/s, log-uniform),
memory from common GPU sizes. Links are slightly asymmetric. The records go through
``Topology.from_records``, the same path a live swarm's records take.
"""

from __future__ import annotations

import numpy as np

from fusionp2p.records import LinkRecord, PeerRecord

__all__ = ["synthetic_swarm"]

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
