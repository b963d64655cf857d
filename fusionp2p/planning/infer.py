"""The bandwidth and latency of pairs nobody measured, inferred from the pairs someone did.

On a large swarm each peer probes a bounded set of links (its own cluster densely, a
random sample of the rest: ``net.probe.LinkEstimator``), so most pairs are unmeasured.
The model behind the inference: a link's bandwidth is the smaller of what the two
clusters' networks carry between them and what the two peers' access links carry,

    b(u, v) ~= min(pair(A, B), out(u), in(v))    u in cluster A, v in cluster B.

Clusters are found on the measured graph: Leiden modularity on the measured pairs, a
pair's tie its bandwidth over its latency (the slower direction). Latency is what tells
sites apart even for a peer behind a slow access link; on 1,000 synthetic peers with 64
random links each, bandwidth alone finds the clusters with an adjusted Rand index of 0.55,
bandwidth over latency with 0.996. ``pair(A, B)`` is a vote of A's peers: each peer that
measured links into B votes the upper quartile of them, and ``pair(A, B)`` is the upper
quartile of the votes (peers behind a slow access link pull the median down; the upper
quartile sees past them); a pair of clusters no link joins takes the widest path through
the cluster graph.

One vote per peer is what bounds sybils. The links are the vouched ones
(``planning.vouch``): a peer can only lower a link between itself and an honest peer, or
raise its own by at most ``ASYMMETRY`` times what the honest end measured. Say cluster A
holds m honest voters into B and k sybils; with v_q the q-th percentile of the honest
votes, whatever the sybils publish,

    v_(75 - 25 k / (m - 1))  <=  pair(A, B)  <=  v_(75 + 75 k / (m - 1)),

so while k <= (m - 1) / 3 the estimate stays within the honest votes' range (4 sybils
among 13 honest peers: between the honest 67th and 100th percentiles). A sybil in B
moves an honest peer's vote only by lowering its own links, and the upper quartile holds
until sybils are more than a quarter of the links that peer measured into B. Sybils do
move the clustering a little (their links are ties too, if weak ones): that is not
bounded. ``tests/test_infer.py`` pins the bound.
``out(u)`` / ``in(v)`` is the fastest link measured from u / into v, once measured on at
least 8 (fewer say little about its access link). A direction measured only the other way
takes the reverse within the same caps (access links are often asymmetric). Latency is the
median measured between the two clusters (path sums where none was). Measured pairs
keep their measurement. ``benchmarks/scale_sim.py`` measures the error against a
fully measured synthetic swarm.
"""

from __future__ import annotations

import igraph as ig
import leidenalg
import numpy as np

__all__ = ["infer_unmeasured", "measured_clusters"]

_CAP_LINKS = 8  # a peer's fastest link caps its inferred ones once measured on this many
_LATENCY_FLOOR = 50e-6  # seconds: a loopback or LAN pair counts as this near


def measured_clusters(bandwidth: np.ndarray, latency: np.ndarray, seed: int = 0) -> np.ndarray:
    """A cluster label per peer, from the measured pairs (NaN = unmeasured) only; a pair's
    tie is its bandwidth over its latency (a fast, near peer is a strong tie)."""
    n = len(bandwidth)
    known = ~np.isnan(bandwidth)
    np.fill_diagonal(known, False)
    src, dst = np.nonzero(known)
    if len(src) == 0:
        return np.arange(n)
    pair = np.minimum(src, dst) * n + np.maximum(src, dst)  # one edge per pair: its slower direction
    order = np.argsort(pair, kind="stable")
    tie = bandwidth / np.maximum(latency, _LATENCY_FLOOR)
    pair, values = pair[order], tie[src[order], dst[order]]
    starts = np.flatnonzero(np.r_[True, np.diff(pair) != 0])
    edges, weights = pair[starts], np.minimum.reduceat(values, starts)
    graph = ig.Graph(n=n, edges=np.column_stack(np.divmod(edges, n)).tolist())
    graph.es["weight"] = (weights / weights.max()).tolist()
    partition = leidenalg.find_partition(
        graph, leidenalg.ModularityVertexPartition, weights="weight", seed=seed, n_iterations=-1
    )
    return np.asarray(partition.membership)


def _widest(width: np.ndarray, delay: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Widest-path bottleneck (and that path's delay) between clusters; 0 where none."""
    width, delay = width.copy(), delay.copy()
    for k in range(len(width)):
        through = np.minimum(width[:, k : k + 1], width[k : k + 1, :])
        better = through > width
        width = np.where(better, through, width)
        delay = np.where(better, delay[:, k : k + 1] + delay[k : k + 1, :], delay)
    return width, delay


def infer_unmeasured(
    bandwidth: np.ndarray, latency: np.ndarray, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``(bandwidth, latency)`` with every NaN off the diagonal filled in (see the module).

    Both arrays are (n, n): ``[i, j]`` as measured from i to j, NaN where that direction
    was not. A direction measured only the other way takes the reverse, within the two
    peers' access links. The diagonal comes back inf / 0. The measured graph must be
    connected (``Topology.from_records`` checks).
    """
    n = len(bandwidth)
    bw = np.array(bandwidth, dtype=float)
    lat = np.array(latency, dtype=float)
    np.fill_diagonal(bw, np.nan)
    direct = ~np.isnan(bw)
    measured_bw = np.where(direct, bw, -np.inf)
    out_cap, in_cap = measured_bw.max(axis=1), measured_bw.max(axis=0)
    out_cap[direct.sum(axis=1) < _CAP_LINKS] = np.inf  # too few links to know its access link
    in_cap[direct.sum(axis=0) < _CAP_LINKS] = np.inf
    caps = np.minimum(out_cap[:, None], in_cap[None, :])
    reverse = ~direct & direct.T
    bw = np.where(reverse, np.minimum(bw.T, caps), bw)
    lat = np.where(reverse, lat.T, lat)
    known = direct | reverse
    np.fill_diagonal(known, False)
    if known.sum() < n * (n - 1):
        labels = measured_clusters(bw, lat, seed)
        pair, pair_lat = _cluster_pairs(bw, lat, direct, labels)
        bw = np.where(known, bw, np.minimum(pair[labels][:, labels], caps))
        lat = np.where(known, lat, pair_lat[labels][:, labels])
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(lat, 0.0)
    return bw, lat


def _grouped_percentile(key: np.ndarray, values: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct keys, the ``q``-th percentile of ``values`` within each), as
    ``np.percentile`` interpolates, for every group at once."""
    order = np.lexsort((values, key))
    key, values = key[order], values[order]
    starts = np.flatnonzero(np.r_[True, np.diff(key) != 0])
    sizes = np.diff(np.r_[starts, len(key)])
    pos = (sizes - 1) * (q / 100.0)
    low = np.floor(pos).astype(int)
    high = np.minimum(low + 1, sizes - 1)
    below, above = values[starts + low], values[starts + high]
    return key[starts], below + (above - below) * (pos - low)


def _votes(
    src: np.ndarray, dst_cluster: np.ndarray, bw: np.ndarray, lat: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One vote per (peer, cluster it measured links into): the upper quartile of those
    links' bandwidths and their median latency. Returns (voter = peer * k + cluster, bw, lat)."""
    key = src * k + dst_cluster
    voter, vote_bw = _grouped_percentile(key, bw, 75)
    _, vote_lat = _grouped_percentile(key, lat, 50)
    return voter, vote_bw, vote_lat


def _cluster_pairs(
    bw: np.ndarray, lat: np.ndarray, direct: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(k, k) bandwidth and latency between clusters: the upper quartile / median of the
    directly measured links from a to b; else of b to a; else the widest path."""
    k = int(labels.max()) + 1
    pair, pair_lat = np.zeros((k, k)), np.full((k, k), np.inf)
    src, dst = np.nonzero(direct)
    voter, vote_bw, vote_lat = _votes(src, labels[dst], bw[src, dst], lat[src, dst], k)
    by_pair = labels[voter // k] * k + voter % k
    pairs, quartile = _grouped_percentile(by_pair, vote_bw, 75)
    _, median_lat = _grouped_percentile(by_pair, vote_lat, 50)
    pair[pairs // k, pairs % k] = quartile
    pair_lat[pairs // k, pairs % k] = median_lat
    one_way = (pair == 0) & (pair.T > 0)
    pair, pair_lat = np.where(one_way, pair.T, pair), np.where(one_way, pair_lat.T, pair_lat)
    np.fill_diagonal(pair_lat, np.where(np.diag(pair) > 0, np.diag(pair_lat), 0.0))
    np.fill_diagonal(pair, np.where(np.diag(pair) > 0, np.diag(pair), np.inf))
    unknown = pair == 0  # no link joins the two clusters: their widest path
    if unknown.any():
        wide, wide_lat = _widest(pair, pair_lat)
        pair, pair_lat = np.where(unknown, wide, pair), np.where(unknown, wide_lat, pair_lat)
    return pair, pair_lat
