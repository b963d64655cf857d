"""What a run tells of itself without changing its course: its plan re-estimated from the
stages' measured compute (a ``calibrated`` event), and its status in the DHT (what
``fusionp2p status`` shows: progress, speed, replicas, the newest events)."""

from __future__ import annotations

import logging
from typing import Protocol

from hivemind.utils import get_dht_time

from fusionp2p.net.connection import SwarmConnection
from fusionp2p.planning import PlanningError
from fusionp2p.planning.calibrate import calibrate
from fusionp2p.records import RUN_EVENT_CHARS, RUN_EVENTS, RunStatusRecord
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.pipeline import Pipeline
from fusionp2p.training.submit import SubmittedJob
from fusionp2p.training.supervision import EventLog, StepClock

__all__ = ["REPORT_TTL_S", "Run", "publish_status", "report_calibration", "status_record"]

logger = logging.getLogger(__name__)

REPORT_TTL_S = 300.0  # a report outlives a dead data owner this long


class Run(Protocol):
    """What a report reads of a run (``training.job_run.JobRun``)."""

    connection: SwarmConnection
    job: JobSpec
    run_id: str
    events: EventLog
    version: int
    step: int
    replans: int
    loss: float
    samples_per_s: float
    clock: StepClock
    submitted: SubmittedJob | None
    pipeline: Pipeline | None

    @property
    def stage_peers(self) -> list[str]: ...


def report_calibration(run: Run) -> None:
    """Re-estimates ``run``'s plan with each stage owner's speed as its compute over the
    calibration window shows it (``planning.calibrate``); a ``calibrated`` event. Not for
    replicas: the calibration does not model their averaging (yet)."""
    submitted, stages = run.submitted, run.clock.calibrated_stages()
    if submitted is None or not stages or submitted.replicated is not None:
        return
    owners = [submitted.data_owner, *run.stage_peers]
    measured = dict(zip(owners, stages, strict=False))
    try:
        result = calibrate(submitted.traced.dag, submitted.topology, submitted.plan, submitted.cost, measured)
    except PlanningError as e:  # only a report: the run goes on without it
        logger.warning("could not re-estimate plan version %d: %s", run.version, e)
        return
    run.events.emit(
        "calibrated",
        f"plan version {run.version} re-estimated at {result.expected_s:.2f} s/step from its "
        f"stages' measured compute (planned {submitted.plan.expected_s:.2f} s, measured "
        f"{run.clock.expected_s or 0:.2f} s)",
        step=run.step,
        plan_version=run.version,
        estimate_s=result.expected_s,
        planned_estimate_s=submitted.plan.expected_s,
        measured_s=run.clock.expected_s,
        speed_factors={p[-8:]: round(f, 3) for p, f in result.factors.items()},
    )


def status_record(run: Run) -> RunStatusRecord:
    """``run``'s status as ``fusionp2p status`` shows it (it must have a plan)."""
    submitted, pipeline = run.submitted, run.pipeline
    assert submitted is not None
    events = tuple(
        f"{e['event']}: {e['message']}"[:RUN_EVENT_CHARS] for e in list(run.events.recent)[-RUN_EVENTS:]
    )
    left = pipeline.replicas[0] if pipeline is not None else 1
    averaging = pipeline.stage_averaging() if pipeline is not None and left > 1 else []
    return RunStatusRecord(
        run_id=run.run_id,
        data_owner=submitted.data_owner,
        job=submitted.run_id,
        step=min(run.step, run.job.steps),
        steps=run.job.steps,
        loss=float(run.loss),
        plan_version=run.version,
        epoch=submitted.epoch,
        replans=run.replans,
        events=events,
        updated_at=get_dht_time(),
        replicas=left,
        samples_per_s=run.samples_per_s,
        averaging_s=max((s for s, _ in averaging), default=0.0),
    )


def publish_status(run: Run) -> None:
    """Publishes ``status_record(run)`` to the DHT; never raises (a report is a courtesy)."""
    try:
        record = status_record(run)
        directory = run.connection.directory
        run.connection.call(directory.publish_run(record, get_dht_time() + REPORT_TTL_S))
    except Exception as e:  # training goes on without it
        logger.info("could not publish the run's status: %s", e)
