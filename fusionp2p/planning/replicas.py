"""Data-parallel replicas of one pipeline: R copies of one split, their stages averaged.

A job with R replicas runs R pipelines of the same split (the same node ranges per stage,
so the R peers holding stage s hold the same parameters) and, after each backward,
averages each stage's gradients among its R peers (hivemind's all-reduce, in the runtime)
before the optimizer step. The global batch is split: each replica runs ``n_b / R``
micro-batches. The data owner feeds every replica and runs its own head and tail once
per replica, on one copy of their parameters (nothing of its own to average), so each
replica is planned as if the data owner, its compute and its links, were R times slower.

The plan (``plan_replicas``): OP-Fence splits the model and places replica 0 on ``1/R``
of the peers (taken cluster by cluster, the strongest cluster and its fastest peers
first); every other replica takes the same stages on the unused peers, each stage on the
peer that computes it and receives its input soonest (so a replica stays within a
bandwidth cluster where the cluster has room). A step costs the slowest replica's iteration plus
the slowest stage's averaging: each of its R peers sends ``(R - 1) / R`` of the stage's
gradient bytes and receives as many back, over the slowest link in the group (not
overlapped with the next step's forward: a bound the runtime can only beat). ``"auto"``
tries every R that divides ``n_b`` and keeps the one with the most micro-batches per
second, the smallest R on a tie.

The gradients go on the wire as ``cost.averaging`` says (``records.AVERAGING_CODECS``:
fp32, or fp16 through hivemind's codec); with ``"auto"``, a stage averages in fp16 where
in fp32 its all-reduce would take more than ``AUTO_AVERAGING_SHARE`` of the step.

Several data owners, each feeding its own replicas from its own private data, fit this
shape: each is the frame of its own replicas; the averaging groups then span the data
owners' replicas. Planning them together is not done yet.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cluster import cluster_peers
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.estimate import Estimate, Stage, estimate
from fusionp2p.planning.opfence import op_fence
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.topology import PlanningError, Topology
from fusionp2p.records import AVERAGING_CODECS

__all__ = [
    "AUTO_AVERAGING_SHARE",
    "ReplicaPlan",
    "averaging_codec",
    "averaging_seconds",
    "plan_replicas",
    "shared_owner",
]

AUTO_AVERAGING_SHARE = 0.1  # "auto" averaging: fp16 where fp32 would take more than this share of a step
_DENSE = AVERAGING_CODECS["none"]

_CANDIDATES = 48  # OP-Fence's candidates for one pipeline; a replica of R searches 1/R of them ...
_MIN_CANDIDATES = 12  # ... but never fewer than this


@dataclass(frozen=True)
class ReplicaPlan:
    """R pipelines of one split, and what a step of all of them costs."""

    replicas: tuple[tuple[Stage, ...], ...]  # each replica's stages, the data owner's included
    estimates: tuple[Estimate, ...]  # each replica's, with the data owner shared R ways
    averaging_s: tuple[float, ...]  # per stage position: its gradients' all-reduce (0: the data owner's)
    n_micro_batches: int  # per replica: the global n_b / R
    averaging_codecs: tuple[str, ...] = ()  # per stage position: how its gradients go on the wire

    @property
    def step_s(self) -> float:
        """The slowest replica's iteration (its 1F1B schedule played out: replicas of
        different R run different micro-batch counts, and only the schedule counts their
        pipelines' fill and drain) plus the slowest stage's averaging."""
        return max(e.expected_s for e in self.estimates) + max(self.averaging_s, default=0.0)

    @property
    def micro_batches_per_s(self) -> float:
        """Global micro-batches per second (samples per second / micro-batch size)."""
        return len(self.replicas) * self.n_micro_batches / self.step_s if self.step_s > 0 else math.inf


def averaging_seconds(grad_bytes: float, peers: Sequence[int], topo: Topology) -> float:
    """Seconds of an all-reduce of ``grad_bytes`` (as sent: fp16 halves them) among
    ``peers`` as hivemind's averager does it: each peer owns ``1/R`` of the vector, sends
    every other part to its owner and receives the averaged parts back, over the slowest
    link between two of them. No Top-K: the pipeline links' ratios do not apply."""
    r = len(peers)
    if r < 2 or grad_bytes <= 0:
        return 0.0
    pairs = [(a, b) for a in peers for b in peers if a != b]
    slowest = min(float(topo.bandwidth[a, b]) for a, b in pairs)
    latency = max(float(topo.latency[a, b]) for a, b in pairs)
    return 2 * (r - 1) / r * grad_bytes / slowest + 2 * latency


def averaging_codec(
    choice: str, grad_bytes: float, peers: Sequence[int], topo: Topology, step_s: float
) -> str:
    """The codec a stage's replicas average with: ``choice``, or for ``"auto"`` fp16 where
    fp32 would take more than ``AUTO_AVERAGING_SHARE`` of a step of ``step_s``."""
    if choice != "auto":
        return choice
    dense = averaging_seconds(grad_bytes, peers, topo)
    return "fp16" if dense > AUTO_AVERAGING_SHARE * step_s else "none"


def shared_owner(topo: Topology, owner: int, ways: int) -> Topology:
    """``topo`` with the data owner's compute and links shared ``ways`` ways (it runs its
    part, and sends and receives its activations, once per replica)."""
    if ways == 1:
        return topo
    speed, bandwidth = topo.speed.copy(), topo.bandwidth.copy()
    speed[owner] /= ways
    diagonal = bandwidth[owner, owner]
    bandwidth[owner, :] /= ways
    bandwidth[:, owner] /= ways
    bandwidth[owner, owner] = diagonal
    return dataclasses.replace(topo, speed=speed, bandwidth=bandwidth)


def _stage_flops(dag: OpDag, stage: Stage) -> float:
    return sum(dag.nodes[i].fwd_flops + dag.nodes[i].bwd_flops for i in stage.nodes)


def _inbound_bytes(dag: OpDag, stage: Stage) -> float:
    """Bytes of the tensors this stage reads from nodes outside it."""
    inside, pos = set(stage.nodes), {n.id: i for i, n in enumerate(dag.nodes)}
    read = {pos[src] for i in stage.nodes for src in dag.nodes[i].inputs if pos[src] not in inside}
    return float(sum(dag.nodes[i].output_bytes for i in read))


def _clone(
    dag: OpDag,
    topo: Topology,
    template: Sequence[Stage],
    usable: Sequence[float],
    memory: Sequence[float],
    owner: int | None,
    used: set[int],
) -> list[Stage] | None:
    """``template``'s stages on unused peers: each on the one that computes it and receives
    its input soonest; None when a stage fits on no unused peer."""
    out: list[Stage] = []
    previous = owner
    for stage, need in zip(template, memory, strict=True):
        if stage.peer == owner:
            out.append(stage)
            previous = owner
            continue
        free = [p for p in range(len(topo)) if p not in used and p != owner and need <= usable[p]]
        if not free:
            return None
        flops, inbound, src = _stage_flops(dag, stage), _inbound_bytes(dag, stage), previous
        seconds = flops / topo.speed
        if src is not None:
            seconds = seconds + topo.latency[src] + inbound / topo.bandwidth[src]
        best = min(free, key=lambda p: (float(seconds[p]), p))
        used.add(best)
        out.append(Stage(best, stage.nodes))
        previous = best
    return out


def _by_cluster(topo: Topology, owner: int | None) -> list[int]:
    """The peers (the data owner aside) cluster by cluster, the cluster with the most
    compute first and its fastest peers first."""
    clusters = cluster_peers(topo)
    clusters.sort(key=lambda c: (-float(sum(topo.speed[p] for p in c)), c[0]))
    return [p for c in clusters for p in sorted(c, key=lambda p: (-float(topo.speed[p]), p)) if p != owner]


def _plan_r(
    dag: OpDag, topo: Topology, cost: CostConfig, r: int, frame: OwnerFrame | None, order: list[int]
) -> ReplicaPlan | None:
    """R replicas; replica 0 is planned on the first ``1/r`` of ``order`` (``_by_cluster``),
    so it sits in one bandwidth cluster where that has room and every replica has as many
    peers to take."""
    owner = frame.owner if frame is not None else None
    per_replica = dataclasses.replace(cost, n_micro_batches=cost.n_micro_batches // r)
    shared = shared_owner(topo, owner, r) if owner is not None else topo
    group = order[: max(1, len(order) // r)]
    members = group if owner is None else [owner, *group]
    sub = shared.subset([topo.peer_ids[p] for p in members])
    sub_frame = None if frame is None else OwnerFrame(0, frame.part)
    try:
        first = op_fence(
            dag, sub, per_replica, frame=sub_frame, max_candidates=max(_MIN_CANDIDATES, _CANDIDATES // r)
        )
    except PlanningError:
        return None
    template = [Stage(members[s.peer], s.nodes) for s in first.stages]
    memory = list(first.estimate.memory_bytes)
    used = {s.peer for s in template if s.peer != owner}
    usable = [cost.memory_headroom * float(m) for m in topo.memory]
    replicas = [template]
    for _ in range(r - 1):
        clone = _clone(dag, shared, template, usable, memory, owner, used)
        if clone is None:
            return None
        replicas.append(clone)
    estimates = [estimate(dag, shared, stages, per_replica) for stages in replicas]
    if not all(math.isfinite(e.iteration_s) for e in estimates):
        return None
    step_s = max(e.expected_s for e in estimates)
    averaging, codecs = [], []
    for k, stage in enumerate(template):
        grad_bytes = float(sum(dag.nodes[i].param_bytes for i in stage.nodes))
        group = [rep[k].peer for rep in replicas]
        codec = (
            "none"
            if stage.peer == owner
            else averaging_codec(cost.averaging, grad_bytes, group, topo, step_s)
        )
        sent = grad_bytes * AVERAGING_CODECS[codec] / _DENSE
        averaging.append(0.0 if stage.peer == owner else averaging_seconds(sent, group, topo))
        codecs.append(codec)
    return ReplicaPlan(
        tuple(tuple(rep) for rep in replicas),
        tuple(estimates),
        tuple(averaging),
        per_replica.n_micro_batches,
        tuple(codecs),
    )


def plan_replicas(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    replicas: int | str = "auto",
    *,
    frame: OwnerFrame | None = None,
) -> ReplicaPlan:
    """R replicas of one OP-Fence split over ``topo`` (see the module doc); ``replicas``:
    a number that divides ``cost.n_micro_batches``, or ``"auto"`` for the R with the most
    micro-batches per second.

    Raises:
        PlanningError: R does not divide n_b, or R replicas do not fit the swarm.
    """
    n_b = cost.n_micro_batches
    if replicas == "auto":
        tries = [r for r in range(1, n_b + 1) if n_b % r == 0]
    elif isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1:
        if n_b % replicas:
            raise PlanningError(
                f"{replicas} replicas cannot split {n_b} micro-batches evenly: choose a divisor of n_b"
            )
        tries = [replicas]
    else:
        raise PlanningError(f"replicas must be 'auto' or a positive number, got {replicas!r}")
    best: ReplicaPlan | None = None
    order = _by_cluster(topo, frame.owner if frame is not None else None)
    for r in tries:
        plan = _plan_r(dag, topo, cost, r, frame, order)
        if plan is None:
            if replicas != "auto":
                raise PlanningError(f"{r} replicas of the plan do not fit the swarm's {len(topo)} peers")
            continue  # a larger R runs fewer micro-batches per replica: it may still fit
        if best is None or plan.micro_batches_per_s > best.micro_batches_per_s * (1 + 1e-9):
            best = plan
    if best is None:
        raise PlanningError("not even one replica fits the swarm")
    return best
