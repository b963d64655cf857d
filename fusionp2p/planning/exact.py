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
from fusionp2p.planning.cost import CostConfig, adaptive_ratios, planned_budgets, planned_ratios
from fusionp2p.planning.estimate import Stage, estimate, shared_bandwidth
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["exact_plan", "is_chain"]


def is_chain(dag: OpDag) -> bool:
    """Whether every node consumes nothing or only the node right before it."""
    return all(set(n.inputs) <= ({dag.nodes[i - 1].id} if i else set()) for i, n in enumerate(dag.nodes))


def exact_plan(
    dag: OpDag, topo: Topology, cost: CostConfig, *, max_peers: int = 7, max_nodes: int = 32
) -> Plan:
    """The partition with the smallest pipelined iteration time.

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
    ch = ChainCosts(dag, topo, cost)
    f_pre, b_pre = ch.flops_fwd, ch.flops_bwd
    n_b = cost.n_micro_batches
    best_t, best_assign = math.inf, None
    codec = topo.codec
    for k in range(1, min(p_count, n) + 1):
        combos = list(itertools.combinations(range(1, n), k - 1))
        cuts = np.array(combos, dtype=int).reshape(len(combos), k - 1)
        bounds = np.concatenate([np.zeros((len(cuts), 1), int), cuts, np.full((len(cuts), 1), n)], axis=1)
        s_idx, e_idx = bounds[:, :-1], bounds[:, 1:]
        flops_f = f_pre[e_idx] - f_pre[s_idx]
        flops_b = b_pre[e_idx] - b_pre[s_idx]
        inflight = np.minimum(n_b, k - np.arange(k))
        mem = cost.param_multiplier * (ch.params[e_idx] - ch.params[s_idx]) + inflight * (
            ch.saved[e_idx] - ch.saved[s_idx]
        )
        cut_bytes = ch.cut[cuts]
        for seq in itertools.permutations(range(p_count), k):
            seq_a = np.array(seq)
            fits = np.all(mem <= cost.memory_headroom * topo.memory[seq_a], axis=1)
            if not fits.any():
                continue
            speed = topo.speed[seq_a]
            cf, cb = flops_f / speed, flops_b / speed
            src, dst = seq_a[:-1], seq_a[1:]
            lat_f, lat_b = topo.latency[src, dst], topo.latency[dst, src]
            bw_f, bw_b = topo.bandwidth[src, dst], topo.bandwidth[dst, src]
            if cost.compression.kind == "planned":
                budget = np.max(cf + cb, axis=1, keepdims=True)  # one peer per stage here
                fastest = (cf.sum(1) + cb.sum(1) + lat_f.sum() + lat_b.sum())[:, None] + (n_b - 1) * budget
                slow_lat = np.maximum(lat_f, lat_b)
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
            bottleneck = np.max(busy, axis=1)
            if k > 1:
                on_link: dict[tuple[str, int, int], np.ndarray] = {}  # Topology.link_resource
                for j in range(k - 1):
                    for key, seconds in (
                        (topo.link_resource(seq[j], seq[j + 1]), lf[:, j] - lat_f[j]),  # occupancy:
                        (topo.link_resource(seq[j + 1], seq[j]), lb[:, j] - lat_b[j]),  # latency is in flight
                    ):
                        on_link[key] = on_link.get(key, 0.0) + seconds
                bottleneck = np.maximum(bottleneck, np.max(list(on_link.values()), axis=0))
            total = np.where(fits, critical + (n_b - 1) * bottleneck, np.inf)
            i = int(np.argmin(total))
            if total[i] < best_t:
                best_t, best_assign = (
                    float(total[i]),
                    [(seq[j], int(s_idx[i, j]), int(e_idx[i, j])) for j in range(k)],
                )
    if best_assign is None:
        raise PlanningError("no combination of peers has the memory for this model")
    stages = [Stage(p, tuple(range(s, e))) for p, s, e in best_assign]
    return Plan.build("exact", dag, topo, stages, cost, estimate(dag, topo, stages, cost))
