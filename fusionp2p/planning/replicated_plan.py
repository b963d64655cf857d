"""A job's plan with data-parallel replicas: one ``Plan`` per replica, published together.

``plan_replicated_job`` is ``plan_job`` for a job that asks for replicas: OP-Fence splits
the model once and places R copies of the split (``planning.replicas``). Each replica is
a ``Plan`` of its own (its stages and Top-K ratios, for its ``n_b / R`` micro-batches,
estimated with the data owner's compute and links shared R ways), published under its own
job id (``records.replica_job``) with the replica count, its index and each stage's
averaging estimate in every record; the coordinator signs all of them in one epoch. A
stage checks its own replica's plan and, from the others', whom it averages with
(``coordination.plan_check``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.owner import framed
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.replicas import plan_replicas, shared_owner
from fusionp2p.planning.topology import PlanningError, Topology
from fusionp2p.records import PlanStageRecord, replica_job

__all__ = ["ReplicatedPlan", "plan_replicated_job", "replicas_request"]


def replicas_request(replicas: int) -> int | str:
    """A job request's ``replicas`` (0: "auto") as ``plan_replicas`` takes it."""
    return "auto" if replicas == 0 else replicas


@dataclass(frozen=True)
class ReplicatedPlan:
    """R replicas of one split: each replica's ``Plan`` and each plan stage's averaging."""

    plans: tuple[Plan, ...]  # per replica, for its share of the micro-batches
    averaging_s: tuple[float, ...]  # per plan stage: its gradients' all-reduce (0: the data owner's)
    averaging_codecs: tuple[str, ...] = ()  # per plan stage: how they go on the wire ("none" if empty)

    def averaging_codec(self, stage: int) -> str:
        """How plan stage ``stage``'s replicas send the gradients they average."""
        return self.averaging_codecs[stage] if self.averaging_codecs else "none"

    @property
    def replicas(self) -> int:
        return len(self.plans)

    @property
    def expected_s(self) -> float:
        """A step: the slowest replica's plus the slowest stage's averaging."""
        return max(p.expected_s for p in self.plans) + max(self.averaging_s, default=0.0)

    def to_records(
        self, *, job: str, epoch: int, made_by: str, made_at: float, data_owner: str
    ) -> list[PlanStageRecord]:
        """Every replica's records, each under its replica's job id."""
        r = self.replicas
        return [
            dataclasses.replace(
                record,
                replicas=r,
                replica=k,
                averaging_s=self.averaging_s[record.stage],
                averaging_codec=self.averaging_codec(record.stage),
            )
            for k, plan in enumerate(self.plans)
            for record in plan.to_records(
                plan_id=replica_job(job, k, r),
                epoch=epoch,
                made_by=made_by,
                made_at=made_at,
                data_owner=data_owner,
            )
        ]

    @classmethod
    def from_records(
        cls,
        replicas: Sequence[Sequence[PlanStageRecord]],
        dag: OpDag,
        topo: Topology,
        cost: CostConfig,
        data_owner: str,
        *,
        method: str = "",
    ) -> ReplicatedPlan:
        """The replicas a coordinator published (replica k's records at ``replicas[k]``),
        each rebuilt over ``topo`` with the data owner shared R ways, for ``cost``'s
        micro-batches split R ways.

        Raises:
            PlanningError: a replica's records are incomplete, of another OP-DAG, or say
                another replica count or index than their place.
        """
        r = len(replicas)
        if r < 1 or cost.n_micro_batches % r:
            raise PlanningError(f"{r} replicas cannot split {cost.n_micro_batches} micro-batches")
        for k, records in enumerate(replicas):
            if not records or any((rec.replicas, rec.replica) != (r, k) for rec in records):
                raise PlanningError(f"the records of replica {k} do not say replica {k} of {r}")
        shared = _shared(topo, data_owner, r)
        per = dataclasses.replace(cost, n_micro_batches=cost.n_micro_batches // r)
        plans = tuple(Plan.from_records(list(rs), dag, shared, per, method=method) for rs in replicas)
        first = {rec.stage: rec for rec in replicas[0]}
        stages = range(len(first))
        return cls(
            plans,
            tuple(first[k].averaging_s for k in stages),
            tuple(first[k].averaging_codec for k in stages),
        )


def _shared(topo: Topology, data_owner: str, ways: int) -> Topology:
    if data_owner not in topo.peer_ids:
        return topo
    return shared_owner(topo, topo.peer_ids.index(data_owner), ways)


def plan_replicated_job(
    dag: OpDag, topo: Topology, data_owner: str, *, replicas: int | str, cost: CostConfig
) -> ReplicatedPlan:
    """``replicas`` (a number that divides ``cost.n_micro_batches``, or ``"auto"``) OP-Fence
    pipelines of ``dag`` over ``topo``, the data owner's part pinned to ``data_owner`` in
    each (``planning.replicas``).

    Raises:
        PlanningError: no peer besides the data owner, R does not divide n_b, or R
            replicas do not fit the swarm.
    """
    topo, frame = framed(dag, topo, data_owner)
    found = plan_replicas(dag, topo, cost, replicas, frame=frame)
    r = len(found.replicas)
    per = dataclasses.replace(cost, n_micro_batches=found.n_micro_batches)
    shared = _shared(topo, data_owner, r)
    plans = tuple(
        Plan.build("op-fence", dag, shared, stages, per, est)
        for stages, est in zip(found.replicas, found.estimates, strict=True)
    )
    return ReplicatedPlan(plans, found.averaging_s, found.averaging_codecs)
