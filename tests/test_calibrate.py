"""The plan's re-estimate from the compute its stages reported (planning/calibrate.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusionp2p.opdag import OpDag, OpNode
from fusionp2p.planning import CompressionPolicy, CostConfig, Plan, Stage, Topology, estimate
from fusionp2p.planning.calibrate import calibrate

GB = 1 << 30


def _chain(n: int) -> OpDag:
    nodes = [
        OpNode(f"n{i}", "x", (f"n{i - 1}",) if i else (), fwd_flops=1e11, bwd_flops=2e11, output_bytes=4e6)
        for i in range(n)
    ]
    return OpDag(tuple(nodes))


def _plan(dag: OpDag, topo: Topology, cost: CostConfig) -> Plan:
    stages = (Stage(0, (0, 1)), Stage(1, (2, 3)), Stage(2, (4, 5)))
    est = estimate(dag, topo, stages, cost)
    ratios = {(lk.src, lk.dst): lk.ratio for lk in est.links}
    return Plan("test", dag.fingerprint, topo.peer_ids, stages, ratios, cost.n_micro_batches, est)


@pytest.fixture
def setting() -> tuple[OpDag, Topology, CostConfig, Plan]:
    dag = _chain(6)
    topo = Topology.from_arrays(["p0", "p1", "p2"], [1e12, 1e12, 2e12], [GB] * 3, np.full((3, 3), 1e8))
    cost = CostConfig(n_micro_batches=4)
    return dag, topo, cost, _plan(dag, topo, cost)


def _planned_per_step(plan: Plan) -> list[float]:
    return [c * plan.n_micro_batches for c in plan.estimate.compute_s]


def test_compute_as_planned_leaves_the_estimate_as_it_was(setting) -> None:
    dag, topo, cost, plan = setting
    result = calibrate(dag, topo, plan, cost, dict(zip(plan.peer_ids, _planned_per_step(plan), strict=True)))
    assert result.factors == pytest.approx({"p0": 1.0, "p1": 1.0, "p2": 1.0})
    assert result.iteration_s == pytest.approx(plan.iteration_s)


def test_a_stage_slower_than_profiled_makes_the_step_slower_by_what_it_adds(setting) -> None:
    dag, topo, cost, plan = setting
    per_step = _planned_per_step(plan)
    # p1 computes 3x its estimate: it becomes the bottleneck of the pipeline
    result = calibrate(dag, topo, plan, cost, {"p1": 3 * per_step[1]})
    assert result.factors == pytest.approx({"p1": 1 / 3})
    new = result.estimate
    assert new.compute_s[1] == pytest.approx(3 * plan.estimate.compute_s[1])
    assert new.compute_s[0] == pytest.approx(plan.estimate.compute_s[0])
    assert [lk.fwd_s for lk in new.links] == pytest.approx([lk.fwd_s for lk in plan.estimate.links])
    # pipelined: critical path + (n_b - 1) x the busiest resource, now p1's compute
    assert new.bottleneck_s == pytest.approx(new.compute_s[1])
    extra = 2 * plan.estimate.compute_s[1]
    assert new.critical_path_s == pytest.approx(plan.estimate.critical_path_s + extra)
    assert new.iteration_s == pytest.approx(new.critical_path_s + 3 * new.compute_s[1])
    assert new.iteration_s > plan.iteration_s


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_missing_or_meaningless_measurement_keeps_the_profiled_speed(setting, bad: float) -> None:
    dag, topo, cost, plan = setting
    result = calibrate(dag, topo, plan, cost, {"p0": bad, "stranger": 1.0})
    assert result.factors == {}
    assert result.iteration_s == pytest.approx(plan.iteration_s)


def test_the_measured_compute_less_its_estimated_topk_coding_is_what_rescales_the_speed() -> None:
    dag = _chain(6)  # 4 MB between nodes: 1e6 fp32 elements
    codec = np.tile([1e-8, 5e-8, 2e-9, 1e-8], (3, 1))
    topo = Topology.from_arrays(["p0", "p1", "p2"], [1e12] * 3, [GB] * 3, np.full((3, 3), 1e8), None, codec)
    cost = CostConfig(n_micro_batches=4, compression=CompressionPolicy(kind="uniform", ratio=10.0))
    plan = _plan(dag, topo, cost)
    assert all(c > 0 for c in plan.estimate.codec_s)
    # p1 computes twice as slowly as profiled; its coding takes what the profile said
    measured = {"p1": 4 * (2 * plan.estimate.compute_s[1] + plan.estimate.codec_s[1])}
    result = calibrate(dag, topo, plan, cost, measured)
    assert result.factors == pytest.approx({"p1": 0.5})
    assert result.estimate.compute_s[1] == pytest.approx(2 * plan.estimate.compute_s[1])
    assert result.estimate.codec_s == pytest.approx(plan.estimate.codec_s)
