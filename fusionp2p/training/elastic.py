"""A replicated run refills its replicas and grows onto idle peers, without stopping.

A run whose job asks for replicas (``[train] replicas`` a number above 1, or ``"auto"``)
asks the coordinator for a fresh plan of itself (``JobRun.plan_next``):

- at once after a replica was dropped (one of its stage owners failed: the other replicas
  went on without a roll-back, each step on their share of the batch), then every
  ``[train] refresh_s`` seconds while replicas are missing;
- with ``"auto"``, every ``refresh_s`` seconds when the swarm has at least as many idle
  peers as a replica has stage peers (a peer that joins is seen at the next refresh).

The plan is made in the background while the run steps on (planning takes seconds, and a
stage frees a job that hears nothing for its idle timeout). Once it is made, the run
switches to it (a checkpoint now, the new plan set up from it: no step is lost) if it
runs more replicas than are running and its estimated micro-batches per second beat the
plan in force, counted with only the replicas it still runs: by any margin when replicas
are missing, by more than ``GROW_GAIN`` otherwise (the switch costs a checkpoint and a
setup). Else the plan is left unused and the run goes on as it is.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from fusionp2p.errors import FusionP2PError
from fusionp2p.planning import PlanningError
from fusionp2p.training.job_run import JobRun
from fusionp2p.training.submit import SubmittedJob

__all__ = ["GROW_GAIN", "Elastic"]

logger = logging.getLogger(__name__)

GROW_GAIN = 1.2  # a full run switches to a plan only if it is this much faster (samples per second)


def _rate(submitted: SubmittedJob, replicas: int) -> float:
    """Micro-batches per second ``replicas`` of ``submitted``'s replicas make, by its estimate."""
    return (
        replicas * submitted.plan.n_micro_batches / submitted.expected_s if submitted.expected_s > 0 else 0.0
    )


class Elastic:
    """When and how ``run`` refreshes its plan (see the module doc). Call ``tick`` after
    each step, ``close`` when the run ends."""

    def __init__(self, run: JobRun) -> None:
        self.run = run
        self._last = time.monotonic()
        self._left = 0  # replicas left at the last refresh (a new drop triggers one at once)
        self._pending: Future[SubmittedJob] | None = None  # the plan being made
        self._version = 0  # the run's plan version it will be

    def due(self) -> bool:
        """Whether a refresh should start now (none is being made)."""
        run, job = self.run, self.run.job
        if job.replicas == 1 or run.pipeline is None or run.step >= job.steps or self._pending is not None:
            return False
        left, planned = run.pipeline.replicas
        if left < planned and left != self._left:
            return True
        waited = time.monotonic() - self._last >= job.refresh_s
        return waited and (left < planned or job.replicas == "auto")

    def tick(self) -> None:
        """Starts a refresh when one is due; switches to its plan once it is made and pays.

        Raises:
            StepFailed: the checkpoint before a switch failed (``JobRun.recover`` handles it).
        """
        if self._pending is not None:
            if self._pending.done():
                self._decide()
        elif self.due():
            self._start()

    def close(self) -> None:
        """Stops a refresh still being made."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _idle_peers(self) -> int:
        run = self.run
        peers = run.connection.call(run.connection.directory.fetch_peers())
        allowed = run.job.stage_peers
        return sum(
            1
            for p in peers.values()
            if p.state == "idle" and p.peer_id not in run.lost and (not allowed or p.peer_id in allowed)
        )

    def _start(self) -> None:
        """Asks the coordinator for a fresh plan, in the background: the run steps on."""
        run = self.run
        assert run.pipeline is not None
        self._last = time.monotonic()
        left, planned = run.pipeline.replicas
        self._left = left
        run.lost.extend(p for p in run.pipeline.lost if p not in run.lost)
        if left == planned and self._idle_peers() < len(run.stage_peers):
            return  # not enough idle peers for one more replica
        self._pending = run.connection.spawn(run.plan_next())
        self._version = run.version

    def _decide(self) -> None:
        run, future = self.run, self._pending
        assert future is not None
        self._pending = None
        if run.version != self._version or run.pipeline is None or run.submitted is None:
            return  # the run was planned again meanwhile (a fault): this plan is stale
        left, planned = run.pipeline.replicas
        try:
            submitted = future.result()
        except (FusionP2PError, PlanningError) as e:
            logger.info(
                "run %s: no fresh plan (%s); going on with %d of %d replicas", run.run_id, e, left, planned
            )
            return
        current, rate = _rate(run.submitted, left), _rate(submitted, len(submitted.replicas))
        gain = 1.0 if left < planned else GROW_GAIN
        if len(submitted.replicas) <= left or rate <= current * gain:
            logger.info(
                "run %s: plan version %d (%d replicas, %.2f micro-batches/s) is not taken: the plan in force "
                "makes %.2f with its %d replicas",
                run.run_id,
                run.version,
                len(submitted.replicas),
                rate,
                current,
                left,
            )
            return
        lost = [p for p in run.lost if p in run.pipeline.lost]
        why = (
            f"{planned - left} of {planned} replicas were dropped"
            + (f" (stage owners {[p[-8:] for p in lost]} lost)" if lost else "")
            if left < planned
            else f"idle peers make {rate / current:.2f}x the samples/s"
        )
        run.events.emit(
            "regrown" if left < planned else "grown",
            f"{why}: plan version {run.version} runs {len(submitted.replicas)} replicas "
            f"({rate:.2f} micro-batches/s estimated, {current:.2f} with the {left} running); "
            f"switching at step {run.step} from a checkpoint",
            step=run.step,
            plan_version=run.version,
            replicas=len(submitted.replicas),
            replicas_before=left,
            lost=lost,
        )
        run.switch(submitted, reason="replicas")
