"""A run's checkpoints: the state of a step saved by the stages (replica 0's, with its
shards copied to another stage peer) and its manifest in the run directory, once the
replicas' parameters were compared (only replica 0's are saved)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from fusionp2p.errors import FusionP2PError, ReplicasDiverged
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.training.checkpoint import Checkpoint, choose_replicas, save_checkpoint
from fusionp2p.training.pipeline import Pipeline
from fusionp2p.training.submit import SubmittedJob
from fusionp2p.training.supervision import CheckpointPolicy, EventLog, StepClock, StepFailed

__all__ = ["Run", "replicas_diverged", "shard_copies", "take_checkpoint"]

logger = logging.getLogger(__name__)


class Run(Protocol):
    """What a checkpoint reads and updates of a run (``training.job_run.JobRun``)."""

    connection: SwarmConnection
    run_dir: Path
    events: EventLog
    version: int
    step: int
    checkpoint: Checkpoint | None
    checkpoint_bytes: int
    policy: CheckpointPolicy
    clock: StepClock
    submitted: SubmittedJob | None
    pipeline: Pipeline | None

    @property
    def stage_peers(self) -> list[str]: ...


def take_checkpoint(run: Run) -> tuple[float, bool]:
    """Saves the state of ``run``'s step (replica 0's) as its latest checkpoint: its cost in
    seconds, and whether the replicas' parameters disagreed (``replicas_diverged``).

    Raises:
        StepFailed: comparing the replicas or fetching the state failed.
    """
    began = time.perf_counter()
    assert run.submitted is not None and run.pipeline is not None
    diverged = replicas_diverged(run)
    transport = run.connection.call(run.connection.transport())
    received = transport.bytes_received
    try:
        shards = run.pipeline.checkpoint(run.step, shard_copies(run), timeout=run.clock.deadline())
    except FusionP2PError as e:
        raise StepFailed(e) from e
    run.checkpoint = save_checkpoint(
        run.run_dir,
        run.step,
        shards,
        plan_version=run.version,
        epoch=run.submitted.epoch,
        data_owner=run.submitted.data_owner,
    )
    cost = time.perf_counter() - began
    run.checkpoint_bytes = transport.bytes_received - received
    step_s = run.clock.expected_s or (run.clock.steps[-1] if run.clock.steps else 0.0)
    run.policy.measured(cost, step_s)
    logger.info("checkpoint of step %d in %.2f s (next in %d steps)", run.step, cost, run.policy.period)
    return cost, diverged


def replicas_diverged(run: Run) -> bool:
    """Whether ``run``'s replicas hold parameters that disagree (a replica left out of an
    average stepped on its own gradients, or a codec's rounding piled up): a
    ``replicas_diverged`` event if so.

    Raises:
        StepFailed: a replica did not answer.
    """
    assert run.pipeline is not None
    if run.pipeline.replicas[0] < 2:
        return False
    try:
        run.pipeline.check_replicas(timeout=run.clock.deadline())
    except ReplicasDiverged as e:
        run.events.emit(
            "replicas_diverged",
            f"{str(e)[:400]}; every replica is set up again from replica 0's state of step {run.step}",
            step=run.step,
            plan_version=run.version,
        )
        return True
    except FusionP2PError as e:
        raise StepFailed(e) from e
    return False


def shard_copies(run: Run) -> dict[int, str]:
    """Per stage peer of the plan in force, the other stage peer its shard is copied to."""
    assert run.submitted is not None
    owners = dict(enumerate(run.stage_peers, 1))
    topo = run.submitted.topology
    pos = {p: i for i, p in enumerate(topo.peer_ids)}
    bandwidth = {
        (a, b): float(topo.bandwidth[pos[a], pos[b]])
        for a in owners.values()
        for b in owners.values()
        if a != b and a in pos and b in pos
    }
    return choose_replicas(owners, bandwidth, run.submitted.data_owner)
