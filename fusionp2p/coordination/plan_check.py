"""A stage peer's check of a coordinated job: is this the coordinator's plan, now?

A data owner's setup for a planned job names the plan's epoch. Before building anything
the peer reads the lease and the job's plan from the DHT itself and refuses the setup
unless: a lease is in force and its epoch is the setup's; the lease holder signed a
complete plan of that epoch for this job (the DHT's validators already tie each record to
its signer); the plan's data owner is the peer that sent the setup; the plan splits the
same OP-DAG for the same micro-batch count; and the nodes the setup gives this peer are
exactly the plan's. A plan from an older epoch, or signed by anyone else, counts for
nothing.
"""

from __future__ import annotations

from hivemind.utils import get_dht_time

from fusionp2p.coordination.election import lease_in_force
from fusionp2p.errors import ProtocolError
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.records import PlanStageRecord
from fusionp2p.runtime.job_setup import JobSetup

__all__ = ["check_planned_setup", "plan_positions"]


def plan_positions(records: list[PlanStageRecord], peer_id: str) -> set[int]:
    """The OP-DAG positions a plan gives ``peer_id`` (over all its plan stages)."""
    out: set[int] = set()
    for record in records:
        if record.peer_id == peer_id:
            ranges = record.node_ranges
            for start, end in zip(ranges[::2], ranges[1::2], strict=True):
                out.update(range(start, end))
    return out


async def check_planned_setup(directory: SwarmDirectory, setup: JobSetup, *, sender: str, me: str) -> None:
    """Refuses ``setup`` unless it follows the coordinator's current plan for its job.

    Raises:
        ProtocolError: the reason, one line (sent back to the data owner).
    """
    lease = lease_in_force(await directory.fetch_leases(), get_dht_time())
    if lease is None:
        raise ProtocolError(f"job {setup.job}: no coordinator holds the lease, so no plan is in force")
    if setup.epoch != lease.epoch:
        raise ProtocolError(
            f"job {setup.job}: the setup follows a plan of epoch {setup.epoch}, "
            f"the coordinator's is {lease.epoch}"
        )
    records = (await directory.fetch_plans(setup.job)).get((lease.epoch, lease.holder), [])
    if not records or len(records) != records[0].n_stages:
        raise ProtocolError(
            f"job {setup.job}: the coordinator {lease.holder[-8:]} published no complete plan "
            f"of epoch {lease.epoch}"
        )
    first = records[0]
    if first.data_owner != sender:
        raise ProtocolError(
            f"job {setup.job}: the plan's data owner is {first.data_owner[-8:]}, not the sender"
        )
    if first.dag != setup.fingerprint or first.n_micro_batches != setup.n_micro_batches:
        raise ProtocolError(f"job {setup.job}: the setup's model or micro-batches differ from the plan's")
    mine = {i for i, stage in enumerate(setup.assignment) if stage == setup.stage}
    if mine != plan_positions(records, me):
        raise ProtocolError(f"job {setup.job}: the setup gives this peer other nodes than the plan does")
