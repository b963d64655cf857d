"""The ratio warm-up: Top-K ratios that grow from dense to the plan's over a job's first steps.

An abrupt switch from dense to the full ratio costs more loss than no warm-up at all;
growing the ratio geometrically costs less than either (benchmarks/convergence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionp2p.errors import ConfigError

__all__ = ["NO_WARMUP", "RatioWarmup"]


@dataclass(frozen=True)
class RatioWarmup:
    """Ratios grow as ``ratio ** (t / steps)`` over a job's steps ``t < steps``; ``done``
    of them passed before this pipeline's iteration 0, so a re-plan or a resume continues
    the ramp instead of restarting it."""

    steps: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "done"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
                raise ConfigError(f"RatioWarmup.{name} must be an integer in [0, 2**62), got {value!r:.40}")

    def ratio(self, ratio: float, iteration: int) -> float:
        """The Top-K ratio to send at this pipeline's ``iteration`` for a planned ``ratio``."""
        step = self.done + iteration
        if step >= self.steps or ratio <= 1:
            return ratio
        return float(ratio ** (step / self.steps))


NO_WARMUP = RatioWarmup()  # the plan's ratios from the first step
