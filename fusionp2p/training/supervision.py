"""What a data owner watches while its job runs: deadlines, stragglers, checkpoints, events.

Pure bookkeeping, no I/O but the event log, so each rule can be tested by itself:

- ``StepClock``: a plan's measured step times. The cost model's absolute numbers are off
  on a shared machine (five processes on two cores compute ~10x slower than profiled), so
  each plan is *calibrated*: the median of its first steps after warm-up is its expected
  step time. A step's deadline is ``max(deadline_s, slack x expected)`` (before
  calibration: ``3 x deadline_s`` or ``slack x`` the plan's estimate, whichever is more);
  ``straggling()`` is true once ``patience`` steps in a row took more than ``factor x``
  the expected time (and at least ``min_excess_s`` more: jitter is no straggler), and
  ``speed_factors()`` then says, per stage, how much slower it computes now than in the
  calibration steps (what the coordinator re-plans with).
- ``CheckpointPolicy``: every ``every`` steps, or, when ``every`` is 0, often enough that
  a checkpoint's measured cost stays within 10% of the steps between two of them.
- ``EventLog``: every fault-handling event is one log line, one printed line and one
  record of ``events.jsonl`` in the run directory.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionp2p.errors import FusionP2PError

__all__ = ["CheckpointPolicy", "EventLog", "StepClock", "StepFailed"]


logger = logging.getLogger(__name__)

CHECKPOINT_OVERHEAD = 0.10  # what automatic checkpointing may cost, as a fraction of step time
MAX_AUTO_PERIOD = 50  # an automatic period never exceeds this many steps (bounds redone work)


class StepFailed(Exception):
    """A step, a checkpoint or the final fetch failed; ``cause`` says how."""

    def __init__(self, cause: FusionP2PError) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class StepClock:
    """One plan's step times and per-stage compute times, and what follows from them."""

    deadline_s: float
    slack: float
    factor: float
    patience: int
    min_excess_s: float = (
        1.0  # a slow step is also at least this many seconds over (noise is not a straggler)
    )
    estimate_s: float = 0.0  # the cost model's step time for the plan
    warmup: int = 2  # first steps of a plan not used for calibration (lazy allocation, caches)
    window: int = 3  # steps whose median calibrates the plan
    steps: list[float] = field(default_factory=list)
    stages: list[Sequence[float]] = field(default_factory=list)
    slow_in_row: int = 0

    @property
    def expected_s(self) -> float | None:
        """The calibrated step time, once ``warmup + window`` steps ran on this plan."""
        if len(self.steps) < self.warmup + self.window:
            return None
        return statistics.median(self.steps[self.warmup : self.warmup + self.window])

    def deadline(self) -> float:
        """Seconds the next step may take before its stage owners are probed."""
        expected = self.expected_s
        if expected is None:
            return max(3 * self.deadline_s, self.slack * self.estimate_s)
        return max(self.deadline_s, self.slack * expected)

    def observe(self, seconds: float, stage_seconds: Sequence[float]) -> None:
        """Records one finished step: its wall time and each stage's compute seconds."""
        self.steps.append(seconds)
        self.stages.append(list(stage_seconds))
        expected = self.expected_s
        calibrating = len(self.steps) <= self.warmup + self.window
        if expected is None or calibrating:
            return
        slow = seconds > self.factor * expected and seconds - expected >= self.min_excess_s
        self.slow_in_row = self.slow_in_row + 1 if slow else 0

    def calibrated_stages(self) -> list[float] | None:
        """Per stage: the median compute seconds over the calibration window, once it ran."""
        window = self.stages[self.warmup : self.warmup + self.window]
        if not window or len(window) < self.window:
            return None
        n = min(len(s) for s in window)
        return [statistics.median(s[i] for s in window) for i in range(n)]

    def straggling(self) -> bool:
        """Whether the last ``patience`` steps were all slower than ``factor x`` expected."""
        return self.slow_in_row >= self.patience

    def speed_factors(self) -> list[float]:
        """Per stage: its calibrated compute time over its recent one, capped at 1 (a stage
        that got 3x slower gets 1/3). Stages without measurements get 1."""
        calibration = self.stages[self.warmup : self.warmup + self.window]
        recent = self.stages[-self.patience :]
        if not calibration or not recent:
            return []
        n = min(len(s) for s in (*calibration, *recent))
        out = []
        for i in range(n):
            before = statistics.median(s[i] for s in calibration)
            now = statistics.median(s[i] for s in recent)
            ok = math.isfinite(before) and math.isfinite(now) and before > 0 and now > 0
            out.append(min(1.0, before / now) if ok else 1.0)
        return out


@dataclass
class CheckpointPolicy:
    """When to checkpoint: every ``every`` steps, or automatically when ``every`` is 0."""

    every: int
    period: int = 0  # the automatic period in force
    cost_s: float = 0.0  # the last checkpoint's measured cost

    def __post_init__(self) -> None:
        self.period = self.every or 5  # the first automatic checkpoint comes early: its cost is measured

    def due(self, step: int, last: int) -> bool:
        """Whether to checkpoint after ``step``, the last checkpoint being after ``last``."""
        return step - last >= self.period

    def measured(self, cost_s: float, step_s: float) -> None:
        """Adapts the automatic period to a checkpoint that took ``cost_s`` with steps of ``step_s``."""
        self.cost_s = cost_s
        if self.every == 0 and step_s > 0:
            self.period = max(1, min(MAX_AUTO_PERIOD, math.ceil(cost_s / (CHECKPOINT_OVERHEAD * step_s))))

    def overhead(self, step_s: float) -> float:
        """The measured checkpoint cost per step, as a fraction of ``step_s``."""
        return self.cost_s / self.period / step_s if step_s > 0 else 0.0


class EventLog:
    """Fault-handling events: a log line, a printed line and a JSONL record each."""

    def __init__(self, path: Path, out: Callable[[str], Any] | None = None, keep: int = 20) -> None:
        self.path = path
        self.out = out
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self.on_event: Callable[[dict[str, Any]], Any] | None = None  # e.g. publish the run's status

    def emit(self, kind: str, message: str, **fields: Any) -> dict[str, Any]:
        """Records event ``kind`` (e.g. ``peer_lost``, ``replanned``) described by ``message``."""
        row = {"time": time.time(), "event": kind, "message": message, **fields}
        self.recent.append(row)
        # printed already when there is a console: the log line then stays at debug level
        logger.log(logging.DEBUG if self.out is not None else logging.WARNING, "%s: %s", kind, message)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
        if self.out is not None:
            self.out(f"[{kind}] {message}")
        if self.on_event is not None:
            self.on_event(row)
        return row

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The events of a run directory's ``events.jsonl`` (unreadable lines skipped)."""
        if not path.exists():
            return []
        rows = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows
