"""Baseline partitions from the FusionLLM evaluation (§7.2), in the same code path.

- equal-number: every peer (in PeerID order) gets the same number of OP-DAG nodes;
- equal-computation: every peer gets work proportional to its measured speed, so compute
  times are equal (the stronger reading of "equal computation cost" on mixed hardware).

Each runs with no compression, uniform Top-K, or adaptive Top-K. Around the data owner's
part of the model (``planning.owner``), they split what is left.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CompressionKind, CostConfig
from fusionp2p.planning.estimate import Stage, estimate
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import Topology
from fusionp2p.records import BASELINES

__all__ = ["BASELINES", "baseline_plan"]


def _bounds_equal_number(lo: int, hi: int, n_peers: int) -> list[int]:
    return [lo + round(i * (hi - lo) / n_peers) for i in range(n_peers + 1)]


def _bounds_equal_computation(dag: OpDag, lo: int, hi: int, speeds: np.ndarray) -> list[int]:
    work = np.cumsum([n.fwd_flops + n.bwd_flops for n in dag.nodes[lo:hi]])
    shares = np.cumsum(speeds) / speeds.sum() * work[-1]
    n = hi - lo
    bounds = [0] + [int(np.searchsorted(work, s, side="left")) + 1 for s in shares[:-1]] + [n]
    return [lo + min(max(b, bounds[i - 1] if i else 0), n) for i, b in enumerate(bounds)]


def baseline_plan(
    name: str,
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    compression: CompressionKind,
    *,
    frame: OwnerFrame | None = None,
) -> Plan:
    """A baseline partition of ``dag`` over all of ``topo`` (at most one peer per node);
    with ``frame``, of the middle over the peers other than the data owner, framed by the
    data owner's part (``planning.owner``)."""
    lo, hi = (frame.part.head, frame.part.tail) if frame is not None else (0, len(dag))
    others = [p for p in range(len(topo)) if frame is None or p != frame.owner]
    peers = others[: min(len(others), hi - lo)]
    if name == "equal-number":
        bounds = _bounds_equal_number(lo, hi, len(peers))
    elif name == "equal-computation":
        bounds = _bounds_equal_computation(dag, lo, hi, topo.speed[peers])
    else:
        raise ValueError(f"unknown baseline {name!r}; known: {BASELINES}")
    stages = [
        Stage(p, tuple(range(s, e))) for p, s, e in zip(peers, bounds[:-1], bounds[1:], strict=True) if e > s
    ]
    if frame is not None:
        stages = frame.frame(stages)
    cost = replace(cost, compression=replace(cost.compression, kind=compression))
    return Plan.build(f"{name}/{compression}", dag, topo, stages, cost, estimate(dag, topo, stages, cost))
