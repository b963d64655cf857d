"""OP-Fence: cluster peers by bandwidth, order the clusters, cut the OP-DAG (FusionLLM §4).

1. Clusters of well-connected peers (Leiden by default).
2. Cluster orders: all of them for up to 4 clusters, else a greedy chain from each start
   along the fastest inter-cluster links. A large cluster offers its fastest peers and,
   for a quarter of its candidate slots, those with the most memory; when no order of
   those fits, it offers the peers with the most memory instead. Within a cluster,
   peers go fastest first, fastest last, most memory first (early stages hold more
   micro-batches), or fastest first with the peers best connected to the previous and
   next clusters at the ends. Up to 6 candidates, every peer order is tried too. With
   many orders, a quick single pass ranks them and only the best ``refine`` get the
   full search; when none of those fits in memory, or for up to 8 candidates, more
   orders are tried (by memory both ways and 256 seeded random ones).
3. For each order, a dynamic program over contiguous cuts of the OP-DAG's topological
   order and that peer sequence, where any peer may be left out (so a slow peer is only
   used when it helps). It runs from the end of the OP-DAG, so it knows each stage's
   depth, the micro-batches it holds under 1F1B (``cost.in_flight``, as the estimate and
   the runtime count them). It first finds the smallest possible bottleneck B*, then,
   for a few caps c >= B*, the smallest critical path with every resource under c; each
   result is estimated exactly and the best pipelined iteration time wins. So the cuts
   land where the OP-DAG is thin on the slow links, and each cluster gets work for its
   compute.
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
from collections.abc import Iterator, Sequence

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.chain import ChainCosts
from fusionp2p.planning.cluster import ClusterMethod, cluster_peers, inter_cluster_bandwidth
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.estimate import Estimate, Stage
from fusionp2p.planning.fit import explain_no_fit
from fusionp2p.planning.local_search import improve
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.sequence_search import search_sequence
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["cluster_orders", "op_fence"]

logger = logging.getLogger(__name__)

_EVERY_ORDER = 6  # up to this many candidates, OP-Fence tries every peer order (720: ~1 s)
_SEEDED_ORDERS = 8  # up to this many, also orders by memory and 256 seeded random ones
_MIN_PER_CLUSTER = 6  # a cluster the search visits offers at least this many candidates


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


def _strongest(topo: Topology, clusters: list[list[int]], max_candidates: int) -> list[list[int]]:
    """The clusters the search visits: all of them, unless that leaves fewer than
    ``_MIN_PER_CLUSTER`` candidates each; then the strongest (the most compute in their
    ``_MIN_PER_CLUSTER`` fastest peers), in their original order. On a large swarm this
    keeps whole fast clusters in the search instead of one or two peers of every cluster."""
    keep = max(1, max_candidates // _MIN_PER_CLUSTER)
    if len(clusters) <= keep:
        return clusters
    score = [float(np.sort(topo.speed[c])[::-1][:_MIN_PER_CLUSTER].sum()) for c in clusters]
    chosen = sorted(sorted(range(len(clusters)), key=lambda i: (-score[i], i))[:keep])
    return [clusters[i] for i in chosen]


def _arrange(
    topo: Topology, peers: Sequence[int], how: str, before: Sequence[int], after: Sequence[int]
) -> list[int]:
    """One cluster's peers in pipeline order: ``fast`` (fastest first), ``fast-last``,
    ``memory`` (most memory first: earlier stages hold more micro-batches in flight) or
    ``bandwidth`` (fastest first, except that the peer best connected to the previous
    cluster comes first and the one best connected to the next cluster comes last, so the
    slow links between clusters start and end at their best peers)."""
    fast = sorted(peers, key=lambda p: (-topo.speed[p], p))
    if how == "fast-last":
        return fast[::-1]
    if how == "memory":
        return sorted(peers, key=lambda p: (-topo.memory[p], -topo.speed[p], p))
    if how == "bandwidth" and len(fast) > 1:
        order = list(fast)
        if after:
            exit_peer = max(order, key=lambda p: (topo.bandwidth[p, list(after)].max(), -p))
            order.remove(exit_peer)
            order.append(exit_peer)
        if before:
            entry = max(
                order[:-1] if after else order, key=lambda p: (topo.bandwidth[list(before), p].max(), -p)
            )
            order.remove(entry)
            order.insert(0, entry)
        return order
    return fast


def _sequences(topo: Topology, ranked: list[list[int]], orders: list[tuple[int, ...]]) -> list[list[int]]:
    """Every cluster order with every intra-cluster arrangement, without repeats."""
    out: dict[tuple[int, ...], None] = {}
    for order in orders:
        for how in ("fast", "fast-last", "memory", "bandwidth"):
            seq: list[int] = []
            for i, c in enumerate(order):
                before = ranked[order[i - 1]] if i > 0 else []
                after = ranked[order[i + 1]] if i + 1 < len(order) else []
                seq += _arrange(topo, ranked[c], how, before, after)
            out.setdefault(tuple(seq), None)
    return [list(s) for s in out]


def _quick(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    seq: Sequence[int],
    ch: ChainCosts,
    max_positions: int,
    frame: OwnerFrame | None,
) -> tuple[Estimate, list[Stage]] | None:
    return search_sequence(
        dag,
        topo,
        cost,
        seq,
        max_positions=max_positions,
        ch=ch,
        passes=1,
        cap_factors=(1.0, math.inf),
        frame=frame,
    )


def _best_of_orders(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    ranked: list[list[int]],
    ch: ChainCosts,
    max_positions: int,
    refine: int,
    frame: OwnerFrame | None,
) -> tuple[Estimate, list[Stage]] | None:
    """The best plan over every cluster order and intra-cluster arrangement of ``ranked``
    (each cluster's candidates); ``None`` when none fits in memory."""
    seqs = _sequences(topo, ranked, cluster_orders(topo, ranked))
    few = sorted(p for r in ranked for p in r)
    if len(few) <= _EVERY_ORDER:  # a handful of peers: every order is cheap
        seen = {tuple(s) for s in seqs}
        seqs += [list(p) for p in itertools.permutations(few) if p not in seen]
    if len(seqs) > refine:  # many candidates: a quick single pass picks the ones worth refining
        quick = [_quick(dag, topo, cost, s, ch, max_positions, frame) for s in seqs]
        score = [q[0].iteration_s if q else math.inf for q in quick]
        seqs = [seqs[i] for i in np.argsort(score, kind="stable")[:refine] if math.isfinite(score[i])]
    best: tuple[Estimate, list[Stage]] | None = None
    for seq in seqs:
        found = search_sequence(dag, topo, cost, seq, max_positions=max_positions, ch=ch, frame=frame)
        if found and (best is None or found[0].iteration_s < best[0].iteration_s):
            best = found
    return best if best is not None and math.isfinite(best[0].iteration_s) else None


def _memory_orders(
    topo: Topology, candidates: Sequence[int], seed: int, tries: int = 256
) -> Iterator[list[int]]:
    """Peer orders to try when no cluster-wise order fits: every one for up to
    ``_EVERY_ORDER`` peers, else by memory (both ways) and seeded random orders."""
    if len(candidates) <= _EVERY_ORDER:
        yield from (list(p) for p in itertools.permutations(candidates))
        return
    by_memory = sorted(candidates, key=lambda p: (-topo.memory[p], p))
    yield by_memory
    yield by_memory[::-1]
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        yield [int(p) for p in rng.permutation(candidates)]


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
    frame: OwnerFrame | None = None,
) -> Plan:
    """Plans ``dag`` on ``topo`` with OP-Fence (and, unless ``local_search`` is off, a
    local search from its plan: ``planning.local_search``); with ``frame``, around the data
    owner's part (``planning.owner``), the other peers placing the rest.

    Raises:
        PlanningError: no combination of peers has the memory for the model.
    """
    clusters = cluster_peers(topo, clustering, seed)
    placeable = [c for c in ([p for p in c if frame is None or p != frame.owner] for c in clusters) if c]
    searched = _strongest(topo, placeable, max_candidates)
    per_cluster = max(1, min(len(dag), max_candidates // len(searched)))
    ch = ChainCosts(dag, topo, cost)
    ranked = [_candidates(topo, c, per_cluster) for c in searched]
    best = _best_of_orders(dag, topo, cost, ranked, ch, max_positions, refine, frame)
    candidates = sorted({p for r in ranked for p in r})
    if best is None:  # memory-tight: the peers with the most memory, still cluster by cluster
        roomy = [sorted(c, key=lambda p: (-topo.memory[p], -topo.speed[p], p)) for c in placeable]
        ranked = [c[:per_cluster] for c in roomy]
        best = _best_of_orders(dag, topo, cost, ranked, ch, max_positions, refine, frame)
        candidates = sorted({p for r in ranked for p in r})
    if best is None or _EVERY_ORDER < len(candidates) <= _SEEDED_ORDERS:
        # which peer takes which piece matters more than speed when memory is tight: more orders
        enough = 8 * refine if best is None else math.inf
        fitting = []
        for seq in _memory_orders(topo, candidates, seed):
            found = _quick(dag, topo, cost, seq, ch, max_positions, frame)
            if found and math.isfinite(found[0].iteration_s):
                fitting.append((found[0].iteration_s, seq))
                if len(fitting) >= enough:
                    break
        for _, seq in sorted(fitting, key=lambda f: f[0])[:refine]:
            found = search_sequence(dag, topo, cost, seq, max_positions=max_positions, ch=ch, frame=frame)
            if found and (best is None or found[0].iteration_s < best[0].iteration_s):
                best = found
    if best is None or not math.isfinite(best[0].iteration_s):
        raise PlanningError(f"the model does not fit: {explain_no_fit(dag, topo, cost, candidates)}")
    if local_search:
        best = improve(dag, topo, cost, best[1], candidates, frame=frame)
    return Plan.build("op-fence", dag, topo, best[1], cost, best[0], clusters=clusters)
