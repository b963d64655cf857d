"""One run of a job from its data owner: plans, steps, checkpoints, and what goes wrong.

A ``JobRun`` holds the plan in force (a ``Pipeline`` over the coordinator's plan) and
the run's place in its data. It never stops for a peer:

- **A step fails or passes its deadline** (a stage owner died, was stopped, or its
  stream broke): every stage owner is pinged; those that do not answer are *lost*. The
  old pipeline is torn down (best effort, briefly), the coordinator re-plans the job
  without the lost peers (``replaces``: the job's own busy stage owners may be reused, new
  idle peers are used too) as plan version v+1, every new stage loads its part of the
  latest checkpoint, and the data owner rolls its data back to that step: at most one
  checkpoint period of steps is redone.
- **A straggler** (``StepClock.straggling``): a checkpoint is taken at once, the job is
  re-planned with each stage's measured slowdown, and continues on the new plan from
  that checkpoint: no step is lost.
- **The coordinator is lost**: the plan in force needs no coordinator; a later re-plan
  goes to whoever holds the lease then (it retries until one does).

Every such event is one line of the log, of the console and of ``events.jsonl``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import torch

from fusionp2p.config import DEFAULT_TIMEOUTS, RatioWarmup, format_bytes
from fusionp2p.errors import (
    ConfigError,
    CoordinatorError,
    FusionP2PError,
    LimitError,
    SwarmError,
)
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.planning import PlanningError
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.pretrained import PretrainedWeights
from fusionp2p.runtime.restore import Restore
from fusionp2p.training.batches import Batch, TrainingData
from fusionp2p.training.checkpoint import Checkpoint, run_secret
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.pipeline import Pipeline, start_planned
from fusionp2p.training.run_checkpoints import take_checkpoint
from fusionp2p.training.run_reports import publish_status, report_calibration
from fusionp2p.training.submit import SubmittedJob, plan_job_id, submit_job
from fusionp2p.training.supervision import CheckpointPolicy, EventLog, StepFailed

__all__ = ["JobRun", "StepFailed"]

logger = logging.getLogger(__name__)

REPLAN_PATIENCE_S = 180.0  # how long a re-plan is retried (a coordinator may have to be elected)
REPLAN_RETRY_S = 2.0  # between two tries of a re-plan
REPORT_PERIOD_S = 5.0  # how often the run's progress goes to the DHT
MAX_AVERAGING_S = 3600.0  # the longest averaging deadline a setup carries (JobSetup.averaging_s)
SHARD_DIR = "shards"  # under the run directory: the data owner's own stage's shards


class JobRun:
    """The data owner's side of one run (see the module doc). Start with ``start()``."""

    def __init__(
        self,
        connection: SwarmConnection,
        job: JobSpec,
        data: TrainingData,
        run_id: str,
        run_dir: Path,
        events: EventLog,
        *,
        registry: ModelRegistry | None = None,
        version: int = 0,
    ) -> None:
        self.connection = connection
        self.job = job
        self.data = data
        self.run_id = run_id
        self.run_dir = run_dir
        self.events = events
        self.registry = registry
        self.version = version  # plan versions so far (a resumed run goes on counting)
        self.step = 0  # optimizer steps done (the checkpoint's, after a roll-back)
        self.lost: list[str] = []  # peers left out of every later plan
        self.replans = 0
        self.checkpoint: Checkpoint | None = None
        self.checkpoint_bytes = 0  # bytes this process received for the last checkpoint
        self.policy = CheckpointPolicy(job.checkpoint_every)
        self.submitted: SubmittedJob | None = None
        self.pipeline: Pipeline | None = None
        self.running_id = ""  # the wire id of the last plan set up (what a re-plan replaces)
        self.clock = job.step_clock(0.0)
        self._batches: Iterator[Batch] = iter(())
        self.loss = 0.0
        self.samples_per_s = 0.0  # in the last step
        self._reported = 0.0
        self.secret = run_secret(run_dir)  # names the run's checkpoint shards on their holders
        # the weights a run without a checkpoint starts from (each stage gets only its own)
        self.pretrained = PretrainedWeights(job.pretrained) if job.pretrained else None
        events.on_event = lambda _: self.report(force=True)

    # ------------------------------------------------------------------ plans
    @property
    def wire_id(self) -> str:
        return plan_job_id(self.run_id, self.version)

    @property
    def stage_peers(self) -> list[str]:
        """Owners of the runtime stages 1.. (stage 0 is this process; with replicas, those
        of the first replica left)."""
        return self.pipeline.stage_owners if self.pipeline is not None else []

    def start(self, checkpoint: Checkpoint | None = None) -> SubmittedJob:
        """Plans the job and sets it up, from ``checkpoint`` if given (a resumed run)."""
        self.checkpoint = checkpoint
        self.step = checkpoint.step if checkpoint is not None else 0
        self._plan_and_setup(self._restore(checkpoint))
        self._rewind(self.step)
        assert self.submitted is not None
        return self.submitted

    def plan_next(self, speeds: tuple[tuple[str, float], ...] = ()) -> Coroutine[Any, Any, SubmittedJob]:
        """Asks the coordinator for the plan of this run's next version (replacing the plan
        in force, without the lost peers, speeds scaled by ``speeds``): await it on this
        run's connection (it is not set up: ``set_up``).

        Raises (when awaited):
            CoordinatorError / SwarmError / PlanningError: no plan (see ``submit_job``).
        """
        self.version += 1
        connection, run_id, replaces, exclude = (
            self.connection,
            self.wire_id,
            self.running_id,
            tuple(self.lost),
        )

        async def submit() -> SubmittedJob:
            return await submit_job(
                await connection.transport(),
                connection.directory,
                self.job,
                registry=self.registry,
                run_id=run_id,
                replaces=replaces,
                exclude=exclude,
                speeds=speeds,
                site=connection.site,
            )

        return submit()

    def _plan_and_setup(self, state: Restore | None, speeds: tuple[tuple[str, float], ...] = ()) -> None:
        self.set_up(self.connection.call(self.plan_next(speeds)), state)

    def set_up(self, submitted: SubmittedJob, state: Restore | None) -> None:
        """Sets ``submitted``'s plan up (every replica of it) from ``state`` (a checkpoint),
        else from the job's pretrained weights or seed; the plan in force from now on.

        Raises:
            FusionP2PError: a stage refused its setup or is unreachable (torn down again).
        """
        plan = submitted.plan
        averaging = submitted.replicated.averaging_s if submitted.replicated is not None else ()
        options = JobOptions(
            job=submitted.run_id,
            n_micro_batches=len(submitted.replicas) * plan.n_micro_batches,
            optimizer=self.job.optimizer_config,
            loss=self.job.loss,
            epoch=submitted.epoch,
            ratio_warmup=RatioWarmup(self.job.ratio_warmup_steps, self.step),
            max_memory=self.job.max_memory_bytes,
            run=self.run_id,
            shard_secret=self.secret,
            shard_dir=str(self.run_dir / SHARD_DIR),
            # the replicas' averaging deadline: the plan's estimate with the step's slack
            averaging_s=min(
                MAX_AVERAGING_S, max(self.job.deadline_s, self.job.deadline_slack * max(averaging, default=0))
            ),
        )
        self.pipeline = None
        transport = self.connection.call(self.connection.transport())
        sent_before = transport.bytes_sent
        self.pipeline = self.connection.call(
            start_planned(
                self.connection,
                self.job.model_spec(),
                submitted.replicas,
                options,
                registry=self.registry,
                restore=state,
                exclude=tuple(self.lost),
                pretrained=self.pretrained if state is None else None,
                averaging_codecs=submitted.replicated.averaging_codecs if submitted.replicated else (),
            )
        )
        setup_bytes = transport.bytes_sent - sent_before
        self.submitted = submitted
        self.running_id = submitted.run_id
        self.clock = self.job.step_clock(submitted.expected_s)
        replicas = len(submitted.replicas)
        self.events.emit(
            "planned",
            f"plan version {self.version} (job {submitted.run_id}, epoch {submitted.epoch}, coordinator "
            f"{submitted.reply.coordinator[-8:]}): "
            + (f"{replicas} replicas, " if replicas > 1 else "")
            + f"stages on {[p.peer_id[-8:] for p in self.pipeline.peers]}, "
            f"from step {self.step}; {format_bytes(setup_bytes)} sent to set them up",
            step=self.step,
            plan_version=self.version,
            peers=[p.peer_id for p in self.pipeline.peers],
            setup_bytes=setup_bytes,
            **submitted.facts(),
        )

    def _rewind(self, step: int) -> None:
        """The data from ``step`` on: the same batches an uninterrupted run would see."""
        job = self.job
        self._batches = self.data.batches(job.micro_batch_size, job.n_micro_batches, seed=job.data_seed)
        for _ in range(step):
            next(self._batches)

    # ------------------------------------------------------------------ steps
    def train_step(self) -> tuple[float, float]:
        """One step on the plan in force: (loss, seconds).

        Raises:
            StepFailed: a stage failed, is gone, or the step passed its deadline.
        """
        assert self.pipeline is not None
        batches = next(self._batches)[: self.pipeline.n_micro_batches]  # a dropped replica's share: left out
        began = time.perf_counter()
        try:
            loss = self.pipeline.train_step(batches, timeout=self.clock.deadline())
        except FusionP2PError as e:
            raise StepFailed(e) from e
        took = time.perf_counter() - began
        self.samples_per_s = self.job.batch_size * len(batches) / self.job.n_micro_batches / took
        self.step += 1
        self.clock.observe(took, self.pipeline.stage_seconds())
        if len(self.clock.steps) == self.clock.warmup + self.clock.window:
            report_calibration(self)
        return loss, took

    def fetch_params(self) -> dict[str, torch.Tensor]:
        """Every stage's trainable parameters (the final weights).

        Raises:
            StepFailed: a stage failed or did not answer within the step deadline.
        """
        assert self.pipeline is not None
        try:
            return self.pipeline.fetch("params", timeout=self.clock.deadline())
        except FusionP2PError as e:
            raise StepFailed(e) from e

    def maybe_checkpoint(self, *, force: bool = False) -> float | None:
        """Checkpoints after this step if it is due (or ``force``); its cost in seconds.
        Replicas whose parameters no longer agree are then set up again from that
        checkpoint (replica 0's state) on a fresh plan: no step is lost or redone.

        Raises:
            StepFailed: fetching the state failed.
        """
        last = self.checkpoint.step if self.checkpoint is not None else 0
        if not force and not self.policy.due(self.step, last):
            return None
        cost, diverged = take_checkpoint(self)
        if diverged:
            self._resync()
        return cost

    def _resync(self) -> None:
        """Sets the replicas up again from the checkpoint just taken, on a fresh plan (new
        averaging groups); not counted against ``max_replans``: nothing failed."""
        assert self.checkpoint is not None
        state = self._restore(self.checkpoint)
        self._close()
        self._replan(state, reason="replicas that diverged", counted=False)

    # ------------------------------------------------------------------ faults
    def _close(self) -> None:
        if self.pipeline is None:
            return
        pipeline, self.pipeline = self.pipeline, None
        try:
            pipeline.close(teardown_timeout=DEFAULT_TIMEOUTS.teardown)
        except Exception as e:  # the job is being abandoned: a failing teardown changes nothing
            logger.info("closing plan version %d: %s", self.version, e)

    def recover(self, failure: StepFailed) -> None:
        """Re-plans around the stage owners that no longer answer and rolls back to the
        latest checkpoint (see the module doc).

        Raises:
            CoordinatorError / SwarmError / PlanningError: no new plan within
                ``REPLAN_PATIENCE_S`` s, or ``max_replans`` re-plans already.
        """
        failed_step = self.step + 1
        silent = self.pipeline.unresponsive(DEFAULT_TIMEOUTS.ping) if self.pipeline is not None else []
        lost = [p for p in silent if p not in self.lost]
        who = ", ".join(p[-8:] for p in lost) or "none (every stage owner answers)"
        self.events.emit(
            "peer_lost" if lost else "step_failed",
            f"step {failed_step} failed on plan version {self.version} ({str(failure)[:200]}); "
            f"stage owners not answering: {who}",
            step=failed_step,
            plan_version=self.version,
            lost=lost,
            error=str(failure)[:500],
        )
        self.lost.extend(lost)
        self._close()
        restored = self.checkpoint.step if self.checkpoint is not None else 0
        state = self._restore(self.checkpoint)
        self._replan(state, reason=f"{len(lost)} lost peer(s)")
        redone = self.step - restored
        self.step = restored
        self._rewind(restored)
        self.events.emit(
            "restored",
            f"restored the checkpoint of step {restored} on plan version {self.version}: "
            f"{redone} step(s) to redo",
            step=restored,
            plan_version=self.version,
            redone=redone,
        )

    def switch_for_straggler(self) -> None:
        """Checkpoints now and re-plans with each stage's measured slowdown, put on the
        stage's slowest owner (with replicas, a stage's time is its slowest replica's); no
        step is lost.

        Raises:
            StepFailed: the checkpoint failed (then ``recover`` handles it).
        """
        factors = self.clock.speed_factors()
        peers = self.pipeline.slowest_owners() if self.pipeline is not None else []
        speeds = tuple(
            (peers[i - 1], round(f, 4))
            for i, f in enumerate(factors)
            if i >= 1 and i - 1 < len(peers) and f < 1
        )
        slowest = min(speeds, key=lambda s: s[1]) if speeds else None
        self.events.emit(
            "straggler",
            f"{self.clock.slow_in_row} steps in a row over {self.job.straggler_factor}x the plan's "
            f"{self.clock.expected_s or 0:.2f} s"
            + (f"; slowest stage owner {slowest[0][-8:]} at {slowest[1]:.2f}x its speed" if slowest else ""),
            step=self.step,
            plan_version=self.version,
            speeds=dict(speeds),
        )
        take_checkpoint(self)  # replicas that disagree are set up from it anyway
        assert self.checkpoint is not None
        state = self._restore(self.checkpoint)
        self._close()
        self._replan(state, speeds=speeds, reason="a straggler")

    def switch(self, submitted: SubmittedJob, reason: str) -> None:
        """Checkpoints now and goes on with ``submitted`` (a plan from ``plan_next``) from
        that checkpoint: no step is lost. A plan that cannot be set up is planned again.

        Raises:
            StepFailed: the checkpoint failed (then ``recover`` handles it).
        """
        take_checkpoint(self)  # replicas that disagree are set up from it anyway
        assert self.checkpoint is not None
        state = self._restore(self.checkpoint)
        self._close()
        try:
            self.set_up(submitted, state)
        except (FusionP2PError, PlanningError) as e:
            self.events.emit(
                "replan_failed",
                f"plan version {self.version} could not be set up ({str(e)[:200]}); planning again",
                plan_version=self.version,
            )
            self._replan(state, reason=reason)

    def _restore(self, checkpoint: Checkpoint | None) -> Restore | None:
        """``checkpoint``'s shards, those of this run's directory held by this process."""
        if checkpoint is None:
            return None
        me = self.connection.call(self.connection.transport()).peer_id
        return checkpoint.restore(data_owner=me)

    def _replan(
        self,
        state: Restore | None,
        *,
        reason: str,
        speeds: tuple[tuple[str, float], ...] = (),
        counted: bool = True,
    ) -> None:
        if counted and self.replans >= self.job.max_replans:
            raise CoordinatorError(f"giving up: {self.replans} re-plans already ([fault] max_replans)")
        if counted:
            self.replans += 1
        deadline = time.monotonic() + REPLAN_PATIENCE_S
        while True:
            began = time.perf_counter()
            try:
                self._plan_and_setup(state, speeds)
                self.events.emit(
                    "replanned",
                    f"re-planned for {reason} in {time.perf_counter() - began:.1f} s",
                    step=self.step,
                    plan_version=self.version,
                )
                return
            except (ConfigError, LimitError) as e:
                raise CoordinatorError(f"the re-plan was refused: {e}") from e
            except (FusionP2PError, PlanningError) as e:  # a failed setup tore itself down
                if time.monotonic() > deadline:
                    raise SwarmError(f"no new plan within {REPLAN_PATIENCE_S:.0f} s: {e}") from e
                self.events.emit(
                    "replan_failed",
                    f"re-plan (version {self.version}) failed: {str(e)[:200]}; trying again",
                    plan_version=self.version,
                )
                time.sleep(REPLAN_RETRY_S)

    def report(self, loss: float | None = None, *, force: bool = False) -> None:
        """Publishes the run's progress and newest events to the DHT (``fusionp2p status``
        shows them), at most every ``REPORT_PERIOD_S`` unless ``force``; never raises."""
        if loss is not None:
            self.loss = loss
        now = time.monotonic()
        if self.submitted is None or (not force and now - self._reported < REPORT_PERIOD_S):
            return
        self._reported = now
        publish_status(self)

    def close(self) -> None:
        """Tears the plan in force down (best effort)."""
        self._close()
