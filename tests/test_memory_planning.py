"""Memory-tight planning: one in-flight rule (1F1B per stage) in the DP, the estimate and
the runtime layout, and OP-Fence placing every case a brute-force search can place."""

from __future__ import annotations

import numpy as np
import pytest

from fusionp2p.opdag import OpDag, OpNode
from fusionp2p.planning import (
    CompressionPolicy,
    CostConfig,
    PlanningError,
    Stage,
    Topology,
    estimate,
    exact_plan,
    op_fence,
)
from fusionp2p.planning.cost import in_flight, stage_in_flight
from fusionp2p.planning.plan import Plan

GB = float(1 << 30)


def _chain(params: list[float], saved: list[float], flops: list[float] | None = None) -> OpDag:
    flops = flops or [1e11] * len(params)
    return OpDag.from_unordered(
        [
            OpNode(
                f"n{i}",
                "x",
                (f"n{i - 1}",) if i else (),
                fwd_flops=f,
                bwd_flops=2 * f,
                param_bytes=int(p),
                output_bytes=10**6,
                saved_bytes=int(s),
            )
            for i, (p, s, f) in enumerate(zip(params, saved, flops, strict=True))
        ]
    )


def _swarm(memory: list[float], speed: list[float] | None = None, seed: int = 0) -> Topology:
    n = len(memory)
    bw = np.random.default_rng(seed).uniform(1e8, 1e9, (n, n))
    return Topology.from_arrays([f"p{i}" for i in range(n)], speed or [1e12] * n, memory, bw)


def _tight_case(seed: int) -> tuple[OpDag, Topology, CostConfig]:
    """A random chain and swarm whose total memory is 0.9-1.6x what the model needs."""
    r = np.random.default_rng(seed)
    n, n_peers = int(r.integers(4, 8)), int(r.integers(2, 6))
    params, saved = r.uniform(0.02, 0.3, n) * GB, r.uniform(0.01, 0.2, n) * GB
    dag = _chain(list(params), list(saved), list(r.uniform(1e11, 5e11, n)))
    memory = r.uniform(0.5, 2.0, n_peers)
    memory *= (4 * params + saved).sum() * r.uniform(0.9, 1.6) / memory.sum()
    topo = _swarm(list(memory), list(r.uniform(1e12, 5e12, n_peers)), seed)
    cost = CostConfig(n_micro_batches=int(r.integers(1, 6)), compression=CompressionPolicy(kind="none"))
    return dag, topo, cost


def _fits_with_one_window(dag: OpDag, topo: Topology, stages: list[Stage], cost: CostConfig) -> bool:
    """Whether ``stages`` would fit if every stage held the whole window (the old DP's rule)."""
    window = in_flight(cost.n_micro_batches, len(stages))
    return all(
        cost.param_multiplier * sum(dag.nodes[i].param_bytes for i in s.nodes)
        + window * sum(dag.nodes[i].saved_bytes for i in s.nodes)
        <= cost.memory_headroom * topo.memory[s.peer]
        for s in stages
    )


def test_op_fence_places_every_case_a_brute_force_search_places() -> None:
    placed = refused = needs_depths = 0
    for seed in range(60):
        dag, topo, cost = _tight_case(seed)
        try:
            best = exact_plan(dag, topo, cost)  # every split, every injective peer order
        except PlanningError:
            best = None
        if best is None:
            with pytest.raises(PlanningError, match=r"does not fit: .*(alone needs|offer)"):
                op_fence(dag, topo, cost)
            refused += 1
            continue
        plan = op_fence(dag, topo, cost)
        assert plan.estimate.fits, f"seed {seed}: OP-Fence's plan does not fit"
        assert plan.iteration_s <= best.iteration_s * 1.2, f"seed {seed}: far from the optimum"
        placed += 1
        needs_depths += not _fits_with_one_window(dag, topo, list(best.stages), cost)
    # the cases are tight: some fit nowhere, and some fit only with per-stage depths
    assert placed >= 10 and refused >= 10 and needs_depths >= 3, (placed, refused, needs_depths)


def test_the_dp_counts_each_stage_s_own_depth() -> None:
    # 3 equal nodes, 3 peers, n_b = 3: stage k holds 3 - k micro-batches. Only the peer with
    # the most memory can be the first stage; the smallest fits only as the last.
    dag = _chain([0.1 * GB] * 3, [0.2 * GB] * 3)
    need = [0.4 * GB + held * 0.2 * GB for held in (3, 2, 1)]  # 1.0, 0.8, 0.6 GiB
    memory = [need[2] / 0.9 + 1e6, need[0] / 0.9 + 1e6, need[1] / 0.9 + 1e6]
    cost = CostConfig(n_micro_batches=3, compression=CompressionPolicy(kind="none"))
    plan = op_fence(dag, _swarm(memory), cost)
    assert [s.peer for s in plan.stages] == [1, 2, 0]
    assert [s.nodes for s in plan.stages] == [(0,), (1,), (2,)]
    assert plan.estimate.memory_bytes == pytest.approx(need)
    # a window of 3 for every stage (the old rule) would have needed 1 GiB on each peer
    assert not _fits_with_one_window(dag, _swarm(memory), list(plan.stages), cost)


def test_estimate_and_runtime_layout_count_the_same_micro_batches_per_stage() -> None:
    dag = _chain([1e6] * 4, [1e6] * 4)
    topo = _swarm([GB] * 3)
    cost = CostConfig(n_micro_batches=8, compression=CompressionPolicy(kind="none"))
    stages = [Stage(0, (0,)), Stage(1, (1,)), Stage(0, (2,)), Stage(2, (3,))]  # p0 runs two stages
    est = estimate(dag, topo, stages, cost)
    held = stage_in_flight(cost.n_micro_batches, [s.peer for s in stages])
    assert held == [4, 3, 4, 1]  # p0's second stage is gated with its first, as the runtime runs it
    assert est.memory_bytes == pytest.approx([4e6 + h * 1e6 for h in held])
    plan = Plan.build("hand", dag, topo, stages, cost, est)
    layout = plan.layout("owner")
    assert layout.peers == ("owner", "p0", "p1", "p2")
    assert layout.in_flight == (min(8, 4), 4, 3, 1)  # the data owner's window, then each peer's
    assert [in_flight(8, 4, k) for k in range(4)] == [4, 3, 2, 1]


def test_when_the_fastest_peers_lack_memory_the_roomiest_are_tried() -> None:
    # 24 peers in one cluster: 20 fast ones with 0.3 GiB, 4 slow ones with 1.2 GiB. The
    # model needs ~3.6 GiB, so only the 4 roomy peers together hold it; with 8 candidate
    # slots the fastest-first candidates (6 fast + 2 roomy) cannot.
    dag = _chain([0.2 * GB] * 4, [0.05 * GB] * 4)
    memory = [0.3 * GB] * 20 + [1.2 * GB] * 4
    speed = [5e12] * 20 + [1e12] * 4
    topo = Topology.from_arrays([f"p{i}" for i in range(24)], speed, memory, np.full((24, 24), 1e9))
    cost = CostConfig(n_micro_batches=2, compression=CompressionPolicy(kind="none"))
    plan = op_fence(dag, topo, cost, max_candidates=8)
    assert plan.estimate.fits
    assert sorted(s.peer for s in plan.stages) == [20, 21, 22, 23]
