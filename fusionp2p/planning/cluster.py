"""Clusters of well-connected peers, found on the bandwidth graph (FusionLLM §4).

Edge weight = the slower direction's bandwidth between two peers, normalized by the
fastest link so modularity sees fast links as strong ties. Leiden (leidenalg on igraph)
by default; Louvain (igraph's multilevel) selectable. Seeded, so plans are reproducible.
"""

from __future__ import annotations

from typing import Literal

import igraph as ig
import leidenalg
import numpy as np

from fusionp2p.planning.topology import Topology

__all__ = ["ClusterMethod", "cluster_peers", "inter_cluster_bandwidth"]

ClusterMethod = Literal["leiden", "louvain"]
_DENSE_LIMIT = 64  # above this many peers, cluster a k-nearest-neighbour graph
_NEIGHBOURS = 16


def cluster_peers(topo: Topology, method: ClusterMethod = "leiden", seed: int = 0) -> list[list[int]]:
    """Peer indices grouped into clusters, each sorted; clusters sorted by their first peer."""
    n = len(topo)
    if n == 1:
        return [[0]]
    sym = np.minimum(topo.bandwidth, topo.bandwidth.T)
    np.fill_diagonal(sym, 0.0)
    keep = np.ones_like(sym, dtype=bool)
    if n > _DENSE_LIMIT:  # keep each peer's strongest links: a k-nearest-neighbour graph
        keep[:] = False
        keep[np.arange(n)[:, None], np.argsort(-sym, axis=1)[:, :_NEIGHBOURS]] = True
        keep |= keep.T
    iu = np.triu_indices(n, 1)
    mask = keep[iu]
    weights = sym[iu][mask] / sym[iu][mask].max()
    graph = ig.Graph(n=n, edges=list(zip(iu[0][mask].tolist(), iu[1][mask].tolist(), strict=True)))
    graph.es["weight"] = weights.tolist()
    if method == "leiden":
        partition = leidenalg.find_partition(
            graph, leidenalg.ModularityVertexPartition, weights="weight", seed=seed, n_iterations=-1
        )
        membership = partition.membership
    elif method == "louvain":
        membership = graph.community_multilevel(weights="weight").membership
    else:
        raise ValueError(f"unknown clustering method {method!r} (leiden or louvain)")
    groups: dict[int, list[int]] = {}
    for peer, label in enumerate(membership):
        groups.setdefault(label, []).append(peer)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def inter_cluster_bandwidth(topo: Topology, clusters: list[list[int]]) -> np.ndarray:
    """``[a, b]``: the best bandwidth from any peer of cluster a to any peer of cluster b."""
    k = len(clusters)
    out = np.zeros((k, k))
    for a in range(k):
        for b in range(k):
            if a != b:
                out[a, b] = topo.bandwidth[np.ix_(clusters[a], clusters[b])].max()
    return out
