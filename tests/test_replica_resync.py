"""A replicated run's own faults: replicas whose parameters disagree at a checkpoint (a
replica left out of an average stepped on its own gradients, or fp16 rounding piled up)
save replica 0's state and set every replica up again from it, on a fresh plan: no step is
redone and no re-plan is counted against ``max_replans``; a straggling stage is put on the
replica that was slow. The pipeline and the coordinator are fakes;
``tests/test_replicas_run.py`` shows divergence and its check on real peers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fusionp2p.errors import DeadlineError, ReplicasDiverged
from fusionp2p.planning import Topology
from fusionp2p.records import ShardReport
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.replicated import ReplicatedDriver
from fusionp2p.runtime.restore import Restore
from fusionp2p.training.job_run import JobRun, StepFailed
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.pipeline import Pipeline
from fusionp2p.training.supervision import EventLog

OWNER = "Qm" + "o" * 44
STAGE = "Qm" + "s" * 44
DIGEST = "0" * 64


class _Pipeline:
    """Two replicas; ``check`` is what comparing them does (None: they agree)."""

    def __init__(self, calls: list[str], check: Exception | None) -> None:
        self.calls, self.check = calls, check
        self.replicas = (2, 2)
        self.stage_owners = [STAGE]

    def check_replicas(self, *, timeout: float | None = None) -> dict[int, Any]:
        self.calls.append("check")
        if self.check is not None:
            raise self.check
        return {}

    def checkpoint(self, step: int, replicas: Any, *, timeout: float | None = None) -> list[ShardReport]:
        self.calls.append(f"checkpoint {step}")
        return [ShardReport("v1-s1", 64, (("w", DIGEST),), (STAGE,))]

    def close(self, *, teardown_timeout: float) -> None:
        self.calls.append("close")


class _Connection:
    def __init__(self) -> None:
        self.transport_ = SimpleNamespace(bytes_received=0, peer_id=OWNER)

    async def transport(self) -> Any:
        return self.transport_

    def call(self, coro: Any) -> Any:
        coro.close()
        return self.transport_


def _run(tmp_path: Path, check: Exception | None) -> tuple[JobRun, list[str], list[Restore | None]]:
    calls: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    run = JobRun(_Connection(), JobSpec(), None, "run-1", tmp_path, events)  # type: ignore[arg-type]
    run.report = lambda *args, **kwargs: None  # type: ignore[method-assign]  # no DHT here
    topology = Topology.from_arrays([OWNER, STAGE], [1e12] * 2, [1 << 30] * 2, np.full((2, 2), 1e8))
    run.submitted = SimpleNamespace(epoch=1, data_owner=OWNER, topology=topology)  # type: ignore[assignment]
    run.pipeline = _Pipeline(calls, check)  # type: ignore[assignment]
    run.step = 8
    replanned: list[Restore | None] = []

    def plan_and_setup(state: Restore | None, speeds: Any = ()) -> None:
        calls.append("set up")
        replanned.append(state)
        run.pipeline = _Pipeline(calls, None)  # type: ignore[assignment]

    run._plan_and_setup = plan_and_setup  # type: ignore[method-assign]
    return run, calls, replanned


def test_diverged_replicas_are_set_up_again_from_replica_0s_checkpoint_without_a_roll_back(
    tmp_path: Path,
) -> None:
    run, calls, replanned = _run(tmp_path, ReplicasDiverged("replicas [1] hold other parameters"))
    assert run.maybe_checkpoint(force=True) is not None
    assert calls == ["check", "checkpoint 8", "close", "set up"]  # checked, saved, then set up from it
    assert run.checkpoint is not None and run.checkpoint.step == 8 and run.step == 8  # nothing redone
    (state,) = replanned
    assert state is not None and state.step == 8 and [s.shard for s in state.shards] == ["v1-s1"]
    assert run.replans == 0  # nothing failed: not counted against [fault] max_replans
    kinds = [e["event"] for e in EventLog.read(tmp_path / "events.jsonl")]
    assert kinds == ["replicas_diverged", "replanned"]
    calls.clear()
    run.step = 16
    run.maybe_checkpoint(force=True)  # the new replicas agree: a plain checkpoint
    assert calls == ["check", "checkpoint 16"]


def test_replicas_that_do_not_answer_the_comparison_fail_the_step(tmp_path: Path) -> None:
    run, calls, replanned = _run(tmp_path, DeadlineError("no fingerprints within 30 s"))
    with pytest.raises(StepFailed, match="no fingerprints"):
        run.maybe_checkpoint(force=True)
    assert calls == ["check"] and not replanned and run.checkpoint is None


def test_a_straggling_stage_is_put_on_its_slowest_replicas_owner() -> None:
    """A replicated stage's time is its slowest replica's: the straggler re-plan slows that
    replica's owner down, not replica 0's."""
    a1, a2, b1, b2 = ("Qm" + ch * 44 for ch in "ABCD")
    first = SimpleNamespace(stage_owners=[a1, a2], stage_seconds=[0.1, 1.0, 1.0])
    second = SimpleNamespace(stage_owners=[b1, b2], stage_seconds=[0.1, 0.9, 3.0])
    driver = ReplicatedDriver(None, [first, second], JobOptions(n_micro_batches=4))  # type: ignore[arg-type, list-item]
    pipeline = Pipeline(None, driver, [])  # type: ignore[arg-type]
    assert pipeline.slowest_owners() == [a1, b2]
    assert pipeline.stage_owners == [a1, a2]  # replica 0's, as before
    first.stage_seconds = []  # no iteration yet: the owners of the first replica
    assert pipeline.slowest_owners() == [a1, a2]
