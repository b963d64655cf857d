"""The exact optimum for small cases: every ordered subset of peers, every set of cuts.

Only for chain OP-DAGs (each node consumes at most its predecessor), where contiguous
stages in a peer order are the whole search space and the vectorized chain costs equal
``estimate``. Cost grows like ``P! * C(N-1, P-1)``: meant for up to ~7 peers and ~16 nodes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.chain import ChainCosts
from fusionp2p.planning.cost import (
    CostConfig,
    adaptive_ratios,
    planned_budgets,
    planned_ratios,
    stage_in_flight,
)
from fusionp2p.planning.estimate import Stage, estimate, shared_bandwidth
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["exact_plan", "is_chain"]


def is_chain(dag: OpDag) -> bool:
    """Whether every node consumes nothing or only the node right before it."""
    return all(set(n.inputs) <= ({dag.nodes[i - 1].id} if i else set()) for i, n in enumerate(dag.nodes))


def exact_plan(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    *,
    max_peers: int = 7,
    max_nodes: int = 32,
    frame: OwnerFrame | None = None,
) -> Plan:
    """The partition with the smallest pipelined iteration time; with ``frame``, of the
    middle over the peers other than the data owner, framed by its part (``planning.owner``).

    Raises:
        PlanningError: the case is too big or not a chain, or nothing fits in memory.
    """
    n, p_count = len(dag), len(topo)
    if p_count > max_peers or n > max_nodes:
        raise PlanningError(
            f"exact search is for <= {max_peers} peers and <= {max_nodes} nodes, got {p_count} and {n}"
        )
    if not is_chain(dag):
        raise PlanningError("exact search needs a chain OP-DAG (coarsen to blocks first)")
    if frame is not None and frame.part.strays:
        raise PlanningError("exact search needs the data owner's part at the ends of the chain")
    ch = ChainCosts(dag, topo, cost)
    lo, hi = (frame.part.head, frame.part.tail) if frame is not None else (0, n)
    ends = ([frame.owner] if lo else [], [frame.owner] if hi < n else []) if frame is not None else ([], [])
    placeable = [p for p in range(p_count) if frame is None or p != frame.owner]
    best_t, best_assign = math.inf, None
    for k in range(1, min(len(placeable), hi - lo) + 1):
        combos = list(itertools.combinations(range(lo + 1, hi), k - 1))
        cuts = np.array(combos, dtype=int).reshape(len(combos), k - 1)
        bounds = np.concatenate(
            [np.full((len(cuts), 1), lo, int), cuts, np.full((len(cuts), 1), hi, int)], axis=1
        )
        if ends[0]:
            bounds = np.concatenate([np.zeros((len(cuts), 1), int), bounds], axis=1)
        if ends[1]:
            bounds = np.concatenate([bounds, np.full((len(cuts), 1), n, int)], axis=1)
        for seq in itertools.permutations(placeable, k):
            found = _best_cuts(ch, topo, cost, (*ends[0], *seq, *ends[1]), bounds)
            if found is not None and found[0] < best_t:
                best_t, best_assign = found
    if best_assign is None:
        raise PlanningError("no combination of peers has the memory for this model")
    stages = [Stage(p, tuple(range(s, e))) for p, s, e in best_assign]
    if frame is not None:  # the chain's ends are the data owner's head and tail already
        stages = frame.frame(stages[len(ends[0]) : len(stages) - len(ends[1])])
    return Plan.build("exact", dag, topo, stages, cost, estimate(dag, topo, stages, cost))


def _best_cuts(
    ch: ChainCosts, topo: Topology, cost: CostConfig, seq: tuple[int, ...], bounds: np.ndarray
) -> tuple[float, list[tuple[int, int, int]]] | None:
    """The best of the cuts ``bounds`` (one row per candidate: stage k covers
    ``[bounds[k], bounds[k + 1])``) for the stages' peers ``seq`` (a peer may run several
    stages: their compute and memory add up), as (pipelined seconds, (peer, start, end)
    per stage); None when none fits."""
    n_b, k = cost.n_micro_batches, len(seq)
    s_idx, e_idx = bounds[:, :-1], bounds[:, 1:]
    seq_a = np.array(seq)
    owners = sorted(set(seq))
    of_peer = np.array([[peer == p for peer in seq] for p in owners], dtype=float)  # [peer, stage]
    inflight = np.array(stage_in_flight(n_b, seq))
    mem = cost.param_multiplier * (ch.params[e_idx] - ch.params[s_idx]) + inflight * (
        ch.saved[e_idx] - ch.saved[s_idx]
    )
    fits = np.all(mem @ of_peer.T <= cost.memory_headroom * topo.memory[owners], axis=1)
    if not fits.any():
        return None
    speed = topo.speed[seq_a]
    cf = (ch.flops_fwd[e_idx] - ch.flops_fwd[s_idx]) / speed
    cb = (ch.flops_bwd[e_idx] - ch.flops_bwd[s_idx]) / speed
    cut_bytes = ch.cut[bounds[:, 1:-1]]
    src, dst = seq_a[:-1], seq_a[1:]
    lat_f, lat_b = topo.latency[src, dst], topo.latency[dst, src]
    bw_f, bw_b = topo.bandwidth[src, dst], topo.bandwidth[dst, src]
    if cost.compression.kind == "planned":
        budget = np.max((cf + cb) @ of_peer.T, axis=1, keepdims=True)
        fastest = (cf.sum(1) + cb.sum(1) + lat_f.sum() + lat_b.sum())[:, None] + (n_b - 1) * budget
        slow_lat = np.maximum(lat_f, lat_b)
        codec = topo.codec
        ratios = planned_ratios(
            cut_bytes,
            shared_bandwidth(topo, list(zip(src.tolist(), dst.tolist(), strict=True))),
            slow_lat,
            planned_budgets(slow_lat, budget, fastest, k - 1, cost.compression),
            cost.compression,
            cost.wire,
            (codec[src, 0] + codec[dst, 2], codec[src, 1] + codec[dst, 3]),  # both sides
        )
    else:
        ratios = adaptive_ratios(lat_f + cut_bytes / bw_f, cost.compression)
    wire = cost.wire.wire_bytes(cut_bytes, ratios)
    numel = cut_bytes / cost.wire.dense_value_bytes
    send, recv = topo.coding_s(src, dst, numel, ratios)
    lf, lb = lat_f + wire / bw_f + send + recv, lat_b + wire / bw_b
    critical = cf.sum(1) + cb.sum(1) + lf.sum(1) + lb.sum(1)
    busy = cf + cb
    busy[:, :-1] += send
    busy[:, 1:] += recv
    bottleneck = np.max(busy @ of_peer.T, axis=1)
    if k > 1:
        on_link: dict[tuple[str, int, int], np.ndarray] = {}  # Topology.link_resource
        for j in range(k - 1):
            for key, seconds in (
                (topo.link_resource(seq[j], seq[j + 1]), lf[:, j] - lat_f[j]),  # occupancy:
                (topo.link_resource(seq[j + 1], seq[j]), lb[:, j] - lat_b[j]),  # latency is in flight
            ):
                on_link[key] = on_link.get(key, 0.0) + seconds
        bottleneck = np.maximum(bottleneck, np.max(list(on_link.values()), axis=0))
    control = 0.0  # estimate.step_round_trip: the last stage runs the data owner's loss
    if ch.dag.nodes[-1].pinned and len(set(seq)) > 1:
        last = seq[-1]
        control = max(float(topo.latency[last, p] + topo.latency[p, last]) for p in set(seq) - {last})
    total = np.where(fits, critical + (n_b - 1) * bottleneck + control, np.inf)
    i = int(np.argmin(total))
    if not math.isfinite(total[i]):
        return None
    return float(total[i]), [(seq[j], int(s_idx[i, j]), int(e_idx[i, j])) for j in range(k)]
