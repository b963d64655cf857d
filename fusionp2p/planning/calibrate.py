"""A plan's estimate after warm-up: each peer's speed from the compute it reported.

A plan divides each stage's FLOPs by its owner's profiled training speed (FusionLLM §3.5).
What a stage really spends per iteration also holds what the cost model has no term for
(OpData decoding, the optimizer step, a model whose shapes run slower than the profiled
block); its Top-K coding the model estimates from each peer's profile, and keeps. After a
few steps the data owner knows each stage's compute seconds; scaling each peer's speed so
that its estimated compute matches them and estimating the same partition again gives the
step time to expect from then on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.estimate import Estimate, Estimated, estimate
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import Topology

__all__ = ["Calibration", "calibrate"]


@dataclass(frozen=True)
class Calibration(Estimated):
    """The re-estimate and, per peer, its measured speed over its profiled one."""

    estimate: Estimate
    factors: dict[str, float]  # peer id -> speed factor (< 1: slower than profiled)


def calibrate(
    dag: OpDag, topo: Topology, plan: Plan, cost: CostConfig, measured_s: Mapping[str, float]
) -> Calibration:
    """``plan``'s estimate with each peer's speed scaled so that its compute per iteration
    equals ``measured_s[peer]`` (seconds, all its stages, all micro-batches) less its
    estimated Top-K coding; peers not in
    ``measured_s``, or with a non-positive or non-finite value, keep their profiled speed.
    ``topo`` is the topology the plan was made on. The links and Top-K ratios are the plan's.

    Raises:
        PlanningError: the plan does not fit the OP-DAG (as ``estimate``).
    """
    planned: dict[str, float] = {}
    coding: dict[str, float] = {}
    est = plan.estimate
    for peer, compute_s, codec_s in zip(plan.peer_ids, est.compute_s, est.codec_s, strict=True):
        planned[peer] = planned.get(peer, 0.0) + compute_s * plan.n_micro_batches
        coding[peer] = coding.get(peer, 0.0) + codec_s * plan.n_micro_batches
    index = {p: i for i, p in enumerate(topo.peer_ids)}
    speed = topo.speed.copy()
    factors: dict[str, float] = {}
    for peer, expected in planned.items():
        got = measured_s.get(peer)
        if got is None or not math.isfinite(got) or peer not in index:
            continue
        got -= coding[peer]  # the measured Top-K coding stays as profiled
        if got <= 0 or expected <= 0:
            continue
        factors[peer] = expected / got
        speed[index[peer]] *= factors[peer]
    ratios = {(lk.src, lk.dst): lk.ratio for lk in plan.estimate.links}  # what the estimate assumed
    return Calibration(estimate(dag, replace(topo, speed=speed), plan.stages, cost, ratios), factors)
