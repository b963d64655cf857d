"""A stage peer's check of a coordinated job: is this the coordinator's plan, now?

A data owner's setup for a planned job names the plan's epoch. Before building anything
the peer reads the lease and the job's plan from the DHT itself and refuses the setup
unless: a lease is in force and its epoch is the setup's; the lease holder signed a
complete plan of that epoch for this job (the DHT's validators already tie each record to
its signer); the plan's data owner is the peer that sent the setup; the plan splits the
same OP-DAG for the same micro-batch count; and the setup is the plan as a runtime runs
it (``planning.plan_layout``): the same peers in the same order, every OP-DAG position on
the same stage, this stage's Top-K ratios and its micro-batches in flight. A stage of a
replicated job checks its replica's plan so, and that every peer it is to average its
gradients with runs the same stage in its own replica's plan of the same epoch, with the
codec the plan gives it. A plan from an older epoch, or signed by anyone else, counts for
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from fusionp2p.coordination.election import LeaseJudge, read_lease
from fusionp2p.errors import ProtocolError
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.planning import RuntimeLayout
from fusionp2p.planning.plan import plan_layout
from fusionp2p.records import JobSetup, PlanStageRecord, expand_ranges, replica_job

__all__ = ["check_planned_setup", "published_layout"]


def published_layout(records: list[PlanStageRecord], data_owner: str) -> RuntimeLayout:
    """How a runtime runs the plan ``records`` publish, with ``data_owner`` as stage 0.

    Raises:
        ProtocolError: the records are not one complete plan, or a link names no stage.
    """
    by_stage = {r.stage: r for r in records}
    n = records[0].n_stages if records else 0
    if not records or sorted(by_stage) != list(range(n)):
        raise ProtocolError(f"a plan of {n} stages came with stages {sorted(by_stage)[:8]}")
    ordered = [by_stage[k] for k in range(n)]
    ratios: dict[tuple[int, int], float] = {}
    for r in ordered:
        for dst, ratio in r.links_to.items():
            if not dst.isdigit() or int(dst) >= n:
                raise ProtocolError(f"plan stage {r.stage} links to {dst!r:.20}, not a stage of {n}")
            ratios[r.stage, int(dst)] = ratio
    nodes = [expand_ranges(r.node_ranges) for r in ordered]
    return plan_layout([r.peer_id for r in ordered], nodes, ratios, ordered[0].n_micro_batches, data_owner)


async def check_planned_setup(
    directory: SwarmDirectory, setup: JobSetup, *, sender: str, me: str, judge: LeaseJudge
) -> None:
    """Refuses ``setup`` unless it follows the current coordinator's plan for its job (the
    lease in force as ``judge``, this peer's reader of leases, accepts it).

    Raises:
        ProtocolError: the reason, one line (sent back to the data owner).
    """
    job = setup.job
    lease = await read_lease(directory, judge)
    if lease is None:
        raise ProtocolError(f"job {job}: no coordinator holds the lease, so no plan is in force")
    if setup.epoch != lease.epoch:
        raise ProtocolError(
            f"job {job}: the setup follows a plan of epoch {setup.epoch}, the coordinator's is {lease.epoch}"
        )
    if setup.replicas > 1 and job != replica_job(setup.group, setup.replica, setup.replicas):
        raise ProtocolError(f"job {job}: not the name of replica {setup.replica} of job {setup.group}")
    plans = await directory.fetch_all_plans()
    records = plans.get((job, lease.epoch, lease.holder), [])
    if not records or len(records) != records[0].n_stages:
        raise ProtocolError(
            f"job {job}: the coordinator {lease.holder[-8:]} published no complete plan "
            f"of epoch {lease.epoch}"
        )
    first = records[0]
    if first.data_owner != sender:
        raise ProtocolError(f"job {job}: the plan's data owner is {first.data_owner[-8:]}, not the sender")
    if first.dag != setup.fingerprint or first.n_micro_batches != setup.n_micro_batches:
        raise ProtocolError(f"job {job}: the setup's model or micro-batches differ from the plan's")
    if (first.replicas, first.replica) != (setup.replicas, setup.replica):
        raise ProtocolError(
            f"job {job}: the setup is replica {setup.replica} of {setup.replicas}, the plan "
            f"{first.replica} of {first.replicas}"
        )
    layout = published_layout(records, sender)
    if tuple(peer for peer, _ in setup.peers) != layout.peers or setup.peer_of(setup.stage) != me:
        raise ProtocolError(f"job {job}: the setup's stage owners are not the plan's")
    if setup.assignment != layout.assignment:
        raise ProtocolError(f"job {job}: the setup gives this peer other nodes than the plan does")
    planned = {b: r for (a, b), r in layout.ratios.items() if a == setup.stage}
    if dict(setup.ratios) != planned:
        raise ProtocolError(
            f"job {job}: the setup's Top-K ratios {dict(setup.ratios)} are not the plan's {planned}"
        )
    assert layout.in_flight is not None  # plan_layout always counts them
    if setup.in_flight != layout.in_flight[setup.stage]:
        raise ProtocolError(
            f"job {job}: the setup holds {setup.in_flight} micro-batches in flight, the plan "
            f"{layout.in_flight[setup.stage]}"
        )
    if setup.replicas > 1:
        _check_averaging_group(setup, plans, lease.epoch, lease.holder, sender)
        codecs = {r.averaging_codec for r in records if r.peer_id == me}
        if codecs != {setup.averaging_codec}:
            raise ProtocolError(
                f"job {job}: the setup averages with codec {setup.averaging_codec!r}, the plan with "
                f"{sorted(codecs)}"
            )


def _check_averaging_group(
    setup: JobSetup,
    plans: Mapping[tuple[str, int, str], list[PlanStageRecord]],
    epoch: int,
    holder: str,
    sender: str,
) -> None:
    """Refuses a replicated setup unless each peer it would average with runs this stage in
    that replica's plan, signed in the same epoch for the same data owner."""
    for k, peer in enumerate(setup.averaging_peers):
        other = plans.get((replica_job(setup.group, k, setup.replicas), epoch, holder), [])
        if not other or len(other) != other[0].n_stages or other[0].data_owner != sender:
            raise ProtocolError(f"job {setup.group}: replica {k} has no complete plan of epoch {epoch}")
        peers = published_layout(other, sender).peers
        if setup.stage >= len(peers) or peers[setup.stage] != peer:
            raise ProtocolError(
                f"job {setup.job}: the setup averages with {peer[-8:]} for replica {k}, the plan runs "
                "this stage elsewhere there"
            )
