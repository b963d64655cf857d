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
from fusionp2p.planning.cost import CostConfig, planned_budgets, planned_ratios
from fusionp2p.planning.estimate import Estimate, Stage, estimate
from fusionp2p.planning.fit import explain_no_fit
from fusionp2p.planning.local_search import improve
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["cluster_orders", "contiguous_stages", "op_fence", "search_sequence"]

logger = logging.getLogger(__name__)

_CAP_FACTORS = (1.0, 1.15, 1.5, 2.5, math.inf)
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
    """One DP pass over K cut positions and m sequence slots, from the end of the OP-DAG.

    ``stage[d, j, s, e]``: seconds of slot j covering positions s..e (indices into the cut
    positions) while it holds the activations of d + 1 micro-batches (inf where that does
    not fit; the last depth stands for that many or more); ``link_*[l, j, s]``: link l -> j
    at position s. Stage k of S holds ``min(n_b, S - k)`` micro-batches (``cost.in_flight``),
    the number of stages from it to the end, so the DP runs over suffixes and knows that
    depth exactly. ``cap is None`` minimizes the bottleneck; otherwise the critical path
    with every element <= cap. Returns the value and (slot, s, e) triples.
    """
    depth, m, k1, _ = stage.shape
    last = k1 - 1
    value = np.full((depth, m, k1), np.inf)  # [d, j, s]: positions s.. with their first stage on j
    back = np.full((depth, m, k1, 3), -1, dtype=int)  # the next stage's slot, start and depth
    later = np.triu(np.ones((m, m), dtype=bool), 1)[:, :, None]  # [j, l]: slot l comes after slot j
    rows = np.arange(m)
    followers = [[dn for dn in range(depth) if min(dn + 1, depth - 1) == d] for d in range(depth)]
    for s in range(last - 1, -1, -1):
        alone = stage[0, :, s, last]  # the last stage holds one micro-batch
        value[0, :, s] = alone if cap is None else np.where(alone <= cap, alone, np.inf)
        if s + 1 >= last or m < 2:
            continue
        width = last - s - 1
        lk_max = link_max[:, :, s + 1 : last]  # [j, l, e]
        lk_fill = link_fill[:, :, s + 1 : last]
        for d in range(depth):
            st = stage[d, :, s, s + 1 : last][:, None, :]  # [j, 1, e]
            for dn in followers[d]:
                prev = value[dn, :, s + 1 : last][None, :, :]  # [1, l, e]
                if cap is None:
                    cand = np.maximum(np.maximum(prev, lk_max), st)
                else:
                    cand = np.where((lk_max <= cap) & (st <= cap), prev + lk_fill + st, np.inf)
                cand = np.where(later, cand, np.inf).reshape(m, -1)  # [j, l*e]
                idx = np.argmin(cand, axis=1)
                found = cand[rows, idx]
                better = found < value[d, :, s]
                value[d, :, s] = np.where(better, found, value[d, :, s])
                for col, new in enumerate((idx // width, idx % width + s + 1, np.full(m, dn))):
                    back[d, :, s, col] = np.where(better, new, back[d, :, s, col])
    d, j = (int(x) for x in np.unravel_index(int(np.argmin(value[:, :, 0])), (depth, m)))
    total = float(value[d, j, 0])
    if not math.isfinite(total):
        return total, []
    out, s = [], 0
    while True:
        nxt, e, dn = (int(x) for x in back[d, j, s])
        if nxt < 0:
            out.append((j, s, last))
            return total, out
        out.append((j, s, e))
        j, s, d = nxt, e, dn


def _dp_depths(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, cap: float | None
) -> tuple[float, list[tuple[int, int, int]]]:
    """``_dp`` with every stage's in-flight depth, computed cheaply when memory is loose:
    first as if every stage held one micro-batch (a relaxation: its optimum is a lower
    bound); when that optimum fits with its true depths it is the optimum, else the DP
    runs again over every depth."""
    total, triples = _dp(stage[:1], link_fill, link_max, cap)
    if stage.shape[0] == 1 or not triples:
        return total, triples
    n = len(triples)
    depth = stage.shape[0]
    if all(np.isfinite(stage[min(n - k, depth) - 1, j, s, e]) for k, (j, s, e) in enumerate(triples)):
        return total, triples
    return _dp(stage, link_fill, link_max, cap)


def _stage_depths(ch: ChainCosts, seq: Sequence[int], n_micro_batches: int, pos: np.ndarray) -> np.ndarray:
    """``[d, j, s, e]``: each slot's stage matrices holding 1, 2, ... micro-batches, up to
    the first depth from which memory no longer makes a difference."""
    most = max(1, min(n_micro_batches, len(seq)))
    mats = [np.stack([ch.stage_matrix(p, held, pos) for p in seq]) for held in range(1, most + 1)]
    used = most
    while used > 1 and np.array_equal(mats[used - 2], mats[-1]):
        used -= 1
    return np.stack(mats[:used])


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
    fastest, n_links = 0.0, 1
    stage = _stage_depths(ch, seq, cost.n_micro_batches, pos)
    m = len(seq)
    for _ in range(passes):  # later passes: adaptive reference and planned budget from the previous
        link_f = np.zeros((m, m, len(pos)))
        link_b = np.zeros((m, m, len(pos)))
        for a, pa in enumerate(seq):
            for b, pb in enumerate(seq):
                if a >= b:
                    continue
                if policy.kind == "none":
                    ratio: np.ndarray | float = 1.0
                elif policy.kind == "planned" and budget is None:  # first pass: the most it may compress
                    ratio = policy.max_ratio
                elif policy.kind == "planned" and budget is not None:
                    bw = min(topo.bandwidth[pa, pb], topo.bandwidth[pb, pa])
                    lat = max(topo.latency[pa, pb], topo.latency[pb, pa])
                    link_budget = planned_budgets(lat, budget, fastest, n_links, policy)
                    ratio = planned_ratios(
                        ch.cut, bw, lat, link_budget, policy, cost.wire, topo.link_codec(pa, pb)
                    )
                elif policy.kind == "uniform" or t_ref is None:
                    ratio = policy.ratio
                else:
                    ratio = np.clip(policy.ratio * ch.dense_time(pa, pb) / t_ref, 1.0, policy.max_ratio)
                f, bk = ch.link_times(pa, pb, ratio)
                link_f[a, b], link_b[a, b] = f[pos], bk[pos]
        link_fill, link_max = link_f + link_b, np.maximum(link_f, link_b)
        b_star, _ = _dp_depths(stage, link_fill, link_max, None)
        if not math.isfinite(b_star):
            return best
        for factor in cap_factors:
            _, triples = _dp_depths(stage, link_fill, link_max, b_star * factor)
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
        busy: dict[int, float] = {}
        for planned_stage, seconds in zip(best[1], best[0].compute_s, strict=True):
            busy[planned_stage.peer] = busy.get(planned_stage.peer, 0.0) + seconds
        budget = max(busy.values())  # planned ratios: hide each link under this compute ...
        n_links = max(1, len(remote))  # ... and within the slack of about this fast an iteration
        fastest = (
            best[0].critical_path_s
            - sum(lk.fwd_s + lk.bwd_s for lk in remote)
            + (cost.n_micro_batches - 1) * budget
        )
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
    dag: OpDag, topo: Topology, cost: CostConfig, seq: Sequence[int], ch: ChainCosts, max_positions: int
) -> tuple[Estimate, list[Stage]] | None:
    return search_sequence(
        dag, topo, cost, seq, max_positions=max_positions, ch=ch, passes=1, cap_factors=(1.0, math.inf)
    )


def _best_of_orders(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    ranked: list[list[int]],
    ch: ChainCosts,
    max_positions: int,
    refine: int,
) -> tuple[Estimate, list[Stage]] | None:
    """The best plan over every cluster order and intra-cluster arrangement of ``ranked``
    (each cluster's candidates); ``None`` when none fits in memory."""
    seqs = _sequences(topo, ranked, cluster_orders(topo, ranked))
    few = sorted(p for r in ranked for p in r)
    if len(few) <= _EVERY_ORDER:  # a handful of peers: every order is cheap
        seen = {tuple(s) for s in seqs}
        seqs += [list(p) for p in itertools.permutations(few) if p not in seen]
    if len(seqs) > refine:  # many candidates: a quick single pass picks the ones worth refining
        quick = [_quick(dag, topo, cost, s, ch, max_positions) for s in seqs]
        score = [q[0].iteration_s if q else math.inf for q in quick]
        seqs = [seqs[i] for i in np.argsort(score, kind="stable")[:refine] if math.isfinite(score[i])]
    best: tuple[Estimate, list[Stage]] | None = None
    for seq in seqs:
        found = search_sequence(dag, topo, cost, seq, max_positions=max_positions, ch=ch)
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
) -> Plan:
    """Plans ``dag`` on ``topo`` with OP-Fence (and, unless ``local_search`` is off, a
    local search from its plan: ``planning.local_search``).

    Raises:
        PlanningError: no combination of peers has the memory for the model.
    """
    clusters = cluster_peers(topo, clustering, seed)
    searched = _strongest(topo, clusters, max_candidates)
    per_cluster = max(1, min(len(dag), max_candidates // len(searched)))
    ch = ChainCosts(dag, topo, cost)
    ranked = [_candidates(topo, c, per_cluster) for c in searched]
    best = _best_of_orders(dag, topo, cost, ranked, ch, max_positions, refine)
    candidates = sorted({p for r in ranked for p in r})
    if best is None:  # memory-tight: the peers with the most memory, still cluster by cluster
        roomy = [sorted(c, key=lambda p: (-topo.memory[p], -topo.speed[p], p)) for c in clusters]
        ranked = [c[:per_cluster] for c in roomy]
        best = _best_of_orders(dag, topo, cost, ranked, ch, max_positions, refine)
        candidates = sorted({p for r in ranked for p in r})
    if best is None or _EVERY_ORDER < len(candidates) <= _SEEDED_ORDERS:
        # which peer takes which piece matters more than speed when memory is tight: more orders
        enough = 8 * refine if best is None else math.inf
        fitting = []
        for seq in _memory_orders(topo, candidates, seed):
            found = _quick(dag, topo, cost, seq, ch, max_positions)
            if found and math.isfinite(found[0].iteration_s):
                fitting.append((found[0].iteration_s, seq))
                if len(fitting) >= enough:
                    break
        for _, seq in sorted(fitting, key=lambda f: f[0])[:refine]:
            found = search_sequence(dag, topo, cost, seq, max_positions=max_positions, ch=ch)
            if found and (best is None or found[0].iteration_s < best[0].iteration_s):
                best = found
    if best is None or not math.isfinite(best[0].iteration_s):
        raise PlanningError(f"the model does not fit: {explain_no_fit(dag, topo, cost, candidates)}")
    if local_search:
        best = improve(dag, topo, cost, best[1], candidates)
    return Plan.build("op-fence", dag, topo, best[1], cost, best[0], clusters=clusters)
