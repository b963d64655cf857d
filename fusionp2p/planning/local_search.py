"""Local search around a contiguous plan: small moves while the estimate improves.

OP-Fence's dynamic program works on one peer sequence at a time and approximates the
adaptive ratios and the memory in flight; a few exact moves afterwards fix what those
approximations cost. From a plan of stages over contiguous ranges of the topological
order, each move is estimated exactly (``estimate``) and taken as soon as it lowers the
iteration time and still fits:

- move one stage boundary by 1, 2, 4, ... positions;
- split a stage at a quarter, half or three quarters, its second part to an unused peer;
- give a stage to an unused candidate peer (faster, or with the memory);
- swap the peers of two stages;
- merge two neighbouring stages onto either one's peer (a stage that only costs transfers).

The search is deterministic (bounded by a number of estimates, never by wall time), so two
coordinators planning the same records publish the same plan.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.estimate import Estimate, Stage, estimate
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.topology import Topology

__all__ = ["improve"]

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (bounds b0=0 < ... < bS=n, peer of each stage)


def _stages(layout: Layout) -> list[Stage]:
    bounds, peers = layout
    return [Stage(p, tuple(range(bounds[i], bounds[i + 1]))) for i, p in enumerate(peers)]


def _layout(stages: Sequence[Stage]) -> Layout | None:
    """Bounds and peers of contiguous stages in order, or None when they are not."""
    if not stages or not stages[0].nodes:
        return None
    bounds = [stages[0].nodes[0]]
    for s in stages:
        if (
            not s.nodes
            or s.nodes[0] != bounds[-1]
            or list(s.nodes) != list(range(s.nodes[0], s.nodes[-1] + 1))
        ):
            return None
        bounds.append(s.nodes[-1] + 1)
    return tuple(bounds), tuple(s.peer for s in stages)


def _moves(layout: Layout, candidates: Sequence[int]) -> Iterator[Layout]:
    bounds, peers = layout
    n_stages = len(peers)
    for i in range(1, n_stages):  # boundary between stage i-1 and stage i
        step = 1
        while step < bounds[-1] - bounds[0]:
            for b in (bounds[i] - step, bounds[i] + step):
                if bounds[i - 1] < b < bounds[i + 1]:
                    yield (*bounds[:i], b, *bounds[i + 1 :]), peers
            step *= 2
    unused = [p for p in candidates if p not in peers]
    for i in range(n_stages):  # split a stage, its second part to an unused peer
        start, end = bounds[i], bounds[i + 1]
        for cut in sorted({start + (end - start) * q // 4 for q in (1, 2, 3)} - {start, end}):
            for p in unused:
                yield (*bounds[: i + 1], cut, *bounds[i + 1 :]), (*peers[: i + 1], p, *peers[i + 1 :])
    for i in range(n_stages):
        for p in unused:
            yield bounds, (*peers[:i], p, *peers[i + 1 :])
    for i in range(n_stages):
        for j in range(i + 1, n_stages):
            swapped = list(peers)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            yield bounds, tuple(swapped)
    for i in range(1, n_stages):  # merge stages i-1 and i onto either peer
        merged = (*bounds[:i], *bounds[i + 1 :])
        for keep in (peers[i - 1], peers[i]):
            yield merged, (*peers[: i - 1], keep, *peers[i + 1 :])


def improve(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    stages: Sequence[Stage],
    candidates: Sequence[int],
    *,
    max_estimates: int = 400,
    max_unused: int = 8,
    frame: OwnerFrame | None = None,
) -> tuple[Estimate, list[Stage]]:
    """The plan after first-improvement local search from ``stages`` (contiguous, in
    order) over moves that use peers of the plan and up to ``max_unused`` of
    ``candidates`` (fastest first); at most ``max_estimates`` estimates. Stages that are
    not contiguous are returned as they are. With ``frame`` the stages are framed by the
    data owner's (``owner.OwnerPart.frame``): the moves are the middle's, and every
    estimate is of the framed plan."""

    def framed(middle: Sequence[Stage]) -> list[Stage]:
        return frame.frame(middle) if frame is not None else list(middle)

    best_est = estimate(dag, topo, list(stages), cost)
    layout = _layout(frame.part.middle(stages) if frame is not None else stages)
    if layout is None:
        return best_est, list(stages)
    spare = sorted((p for p in candidates if p not in layout[1]), key=lambda p: (-topo.speed[p], p))
    pool = [*layout[1], *spare[:max_unused]]
    budget = max_estimates
    improved = True
    while improved and budget > 0:
        improved = False
        for move in _moves(layout, pool):
            if budget <= 0:
                break
            budget -= 1
            est = estimate(dag, topo, framed(_stages(move)), cost)
            if est.iteration_s < best_est.iteration_s * (1 - 1e-9):
                best_est, layout, improved = est, move, True
                break
    return best_est, framed(_stages(layout))
