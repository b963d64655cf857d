"""OP-Fence: cluster peers by bandwidth, order the clusters, cut the OP-DAG (FusionLLM §4).

1. Clusters of well-connected peers (Leiden by default).
2. Cluster orders: all of them for up to 4 clusters, else a greedy chain from each start
   along the fastest inter-cluster links. A large cluster offers its fastest peers and,
   for a quarter of its candidate slots, those with the most memory. Within a cluster,
   peers go fastest first, and, as a second candidate, fastest last. With many
   candidates, a quick single pass ranks them and only the best ``refine`` get the full
   search.
3. For each order, a dynamic program over contiguous cuts of the OP-DAG's topological
   order and that peer sequence, where any peer may be left out (so a slow peer is only
   used when it helps). It first finds the smallest possible bottleneck B*, then, for a
   few caps c >= B*, the smallest critical path with every resource under c; each result
   is estimated exactly and the best pipelined iteration time wins. So the cuts land where
   the OP-DAG is thin on the slow links, and each cluster gets work for its compute.
4. Adaptive ratios (§5.2) depend on the whole plan; the search approximates them with the
   previous pass's plan and the final estimate applies them exactly.
5. A deterministic local search from the best plan (move a boundary, merge two stages,
   hand a stage to an unused candidate, swap two peers) keeps every move that lowers the
   exact estimate.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.chain import ChainCosts
from fusionp2p.planning.cluster import ClusterMethod, cluster_peers, inter_cluster_bandwidth
from fusionp2p.planning.cost import CostConfig, planned_ratios
from fusionp2p.planning.estimate import Estimate, Stage, estimate
from fusionp2p.planning.fit import explain_no_fit
from fusionp2p.planning.local_search import improve
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["cluster_orders", "contiguous_stages", "op_fence", "search_sequence"]

logger = logging.getLogger(__name__)

_CAP_FACTORS = (1.0, 1.15, 1.5, 2.5, math.inf)


def cluster_orders(topo: Topology, clusters: list[list[int]], max_orders: int = 24) -> list[tuple[int, ...]]:
    """Orders in which the pipeline visits the clusters."""
    k = len(clusters)
    if k <= 4:
        return list(itertools.permutations(range(k)))
    bw = inter_cluster_bandwidth(topo, clusters)
    orders = []
    for start in range(k):
        order, left = [start], set(range(k)) - {start}
        while left:
            nxt = max(left, key=lambda c: bw[order[-1], c])
            order.append(nxt)
            left.remove(nxt)
        orders.append(tuple(order))
    return orders[:max_orders]


def contiguous_stages(assignment: Sequence[tuple[int, int, int]]) -> list[Stage]:
    """Stages from (peer, start, end) triples over the topological order."""
    return [Stage(peer, tuple(range(s, e))) for peer, s, e in assignment]


def _positions(ch: ChainCosts, max_positions: int) -> np.ndarray:
    """Cut positions the DP may use: all, or quantiles of the work for a very long OP-DAG."""
    if ch.n <= max_positions:
        return np.arange(ch.n + 1)
    work = ch.flops_fwd + ch.flops_bwd
    targets = np.linspace(0, work[-1], max_positions + 1)
    pos = np.unique(np.clip(np.searchsorted(work, targets), 0, ch.n))
    return np.union1d(pos, [0, ch.n])


def _dp(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, cap: float | None
) -> tuple[float, list[tuple[int, int, int]]]:
    """One DP pass over K cut positions and m sequence slots.

    ``stage[j, s, e]``: seconds of slot j covering positions s..e (indices into the cut
    positions); ``link_*[l, j, s]``: link l -> j at position s. ``cap is None`` minimizes
    the bottleneck; otherwise the critical path with every element <= cap.
    Returns the value and (slot, s, e) triples.
    """
    m, k1, _ = stage.shape
    last = k1 - 1
    value = np.full((m, k1), np.inf)
    back = np.full((m, k1, 2), -1, dtype=int)
    earlier = np.tri(m, m, -1, dtype=bool).T[:, :, None]  # [l, j]: slot l comes before slot j
    rows = np.arange(m)
    for e in range(1, k1):
        first = stage[:, 0, e]
        best = first if cap is None else np.where(first <= cap, first, np.inf)
        arg_l, arg_s = np.full(m, -1), np.zeros(m, dtype=int)
        if e > 1 and m > 1:
            prev = value[:, None, 1:e]  # [l, 1, s]
            st = stage[None, :, 1:e, e]  # [1, j, s]
            lk_max = link_max[:, :, 1:e]  # [l, j, s]
            if cap is None:
                cand = np.maximum(np.maximum(prev, lk_max), st)
            else:
                cand = np.where((lk_max <= cap) & (st <= cap), prev + link_fill[:, :, 1:e] + st, np.inf)
            cand = np.where(earlier, cand, np.inf).transpose(1, 0, 2).reshape(m, -1)  # [j, l*s]
            idx = np.argmin(cand, axis=1)
            better = cand[rows, idx] < best
            best = np.where(better, cand[rows, idx], best)
            arg_l = np.where(better, idx // (e - 1), arg_l)
            arg_s = np.where(better, idx % (e - 1) + 1, arg_s)
        value[:, e] = best
        back[:, e, 0], back[:, e, 1] = arg_l, arg_s
    j = int(np.argmin(value[:, last]))
    total = float(value[j, last])
    if not math.isfinite(total):
        return total, []
    out, e = [], last
    while True:
        prev_slot, s = back[j, e]
        out.append((j, int(s), e))
        if prev_slot < 0:
            break
        j, e = int(prev_slot), int(s)
    return total, out[::-1]


def search_sequence(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    seq: Sequence[int],
    *,
    max_positions: int = 64,
    ch: ChainCosts | None = None,
    passes: int = 2,
    cap_factors: Sequence[float] = _CAP_FACTORS,
) -> tuple[Estimate, list[Stage]] | None:
    """The best contiguous plan over the peer sequence ``seq`` (peers may be skipped)."""
    ch = ch or ChainCosts(dag, topo, cost)
    pos = _positions(ch, max_positions)
    policy = cost.compression
    best: tuple[Estimate, list[Stage]] | None = None
    t_ref: float | None = None
    budget: float | None = None
    inflight = 1
    for _ in range(passes):  # later passes: adaptive reference and in-flight memory from the previous
        stage = np.stack([ch.stage_matrix(p, inflight, pos) for p in seq])
        m = len(seq)
        link_f = np.zeros((m, m, len(pos)))
        link_b = np.zeros((m, m, len(pos)))
        for a, pa in enumerate(seq):
            for b, pb in enumerate(seq):
                if a >= b:
                    continue
                if policy.kind == "none" or (policy.kind == "planned" and budget is None):
                    ratio: np.ndarray | float = 1.0
                elif policy.kind == "planned" and budget is not None:
                    bw = min(topo.bandwidth[pa, pb], topo.bandwidth[pb, pa])
                    lat = max(topo.latency[pa, pb], topo.latency[pb, pa])
                    ratio = planned_ratios(ch.cut, bw, lat, budget, policy, cost.wire)
                elif policy.kind == "uniform" or t_ref is None:
                    ratio = policy.ratio
                else:
                    ratio = np.clip(policy.ratio * ch.dense_time(pa, pb) / t_ref, 1.0, policy.max_ratio)
                f, bk = ch.link_times(pa, pb, ratio)
                link_f[a, b], link_b[a, b] = f[pos], bk[pos]
        link_fill, link_max = link_f + link_b, np.maximum(link_f, link_b)
        b_star, _ = _dp(stage, link_fill, link_max, None)
        if not math.isfinite(b_star):
            return best
        for factor in cap_factors:
            _, triples = _dp(stage, link_fill, link_max, b_star * factor)
            if not triples:
                continue
            stages = contiguous_stages([(seq[j], int(pos[s]), int(pos[e])) for j, s, e in triples])
            est = estimate(dag, topo, stages, cost)
            if best is None or est.iteration_s < best[0].iteration_s:
                best = (est, stages)
        if best is None:
            return None
        remote = [lk for lk in best[0].links if lk.wire_bytes > 0]
        if remote:
            peers = [s.peer for s in best[1]]
            t_ref = float(
                np.mean(
                    [
                        topo.latency[peers[lk.src], peers[lk.dst]]
                        + lk.dense_bytes / topo.bandwidth[peers[lk.src], peers[lk.dst]]
                        for lk in remote
                    ]
                )
            )
        inflight = min(cost.n_micro_batches, len(best[1]))
        busy: dict[int, float] = {}
        for planned_stage, seconds in zip(best[1], best[0].compute_s, strict=True):
            busy[planned_stage.peer] = busy.get(planned_stage.peer, 0.0) + seconds
        budget = max(busy.values())  # planned ratios: hide each link under this compute
    return best


def _candidates(topo: Topology, cluster: Sequence[int], n: int) -> list[int]:
    """Up to ``n`` peers of a cluster, fastest first: the fastest three quarters, and the
    rest by memory (a slow peer with much memory may be what lets a model fit)."""
    by_speed = sorted(cluster, key=lambda p: (-topo.speed[p], p))
    if len(by_speed) <= n:
        return by_speed
    chosen = by_speed[: max(1, (3 * n) // 4)]
    rest = sorted(set(cluster) - set(chosen), key=lambda p: (-topo.memory[p], p))
    chosen += rest[: n - len(chosen)]
    return sorted(chosen, key=lambda p: (-topo.speed[p], p))


def op_fence(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    *,
    clustering: ClusterMethod = "leiden",
    seed: int = 0,
    max_candidates: int = 48,
    max_positions: int = 64,
    refine: int = 4,
    local_search: bool = True,
) -> Plan:
    """Plans ``dag`` on ``topo`` with OP-Fence (and, unless ``local_search`` is off, a
    local search from its plan: ``planning.local_search``).

    Raises:
        PlanningError: no combination of peers has the memory for the model.
    """
    clusters = cluster_peers(topo, clustering, seed)
    per_cluster = max(1, min(len(dag), max_candidates // len(clusters)))
    ranked = [_candidates(topo, c, per_cluster) for c in clusters]
    ch = ChainCosts(dag, topo, cost)
    # fastest first, and fastest last (the last stage keeps the fewest micro-batches in flight)
    seqs = [
        [p for c in order for p in ranked[c][::direction]]
        for order in cluster_orders(topo, ranked)
        for direction in (1, -1)
    ]
    if len(seqs) > refine:  # many candidates: a quick single pass picks the ones worth refining
        quick = [
            search_sequence(
                dag, topo, cost, s, max_positions=max_positions, ch=ch, passes=1, cap_factors=(1.0, math.inf)
            )
            for s in seqs
        ]
        score = [q[0].iteration_s if q else math.inf for q in quick]
        seqs = [seqs[i] for i in np.argsort(score)[:refine]]
    best: tuple[Estimate, list[Stage]] | None = None
    for seq in seqs:
        found = search_sequence(dag, topo, cost, seq, max_positions=max_positions, ch=ch)
        if found and (best is None or found[0].iteration_s < best[0].iteration_s):
            best = found
    candidates = sorted({p for seq in seqs for p in seq})
    if best is None or not math.isfinite(best[0].iteration_s):
        raise PlanningError(f"the model does not fit: {explain_no_fit(dag, topo, cost, candidates)}")
    if local_search:
        best = improve(dag, topo, cost, best[1], candidates)
    return Plan.build("op-fence", dag, topo, best[1], cost, best[0], clusters=clusters)
