"""An emulated slower device, for testbeds: a peer's work takes ``1 / speed`` times as long.

A testbed on one machine has one kind of CPU; ``fusionp2p peer --emulated-speed 0.25``
makes that peer behave like a device a quarter as fast. After each piece of compute (the
profiler's matmuls included, so the peer *measures* the slower speed and publishes it),
the compute thread sleeps until 4x the CPU time it used has passed: a slowed peer leaves
the CPU to the others instead of burning it, and the others' load on a shared machine
does not slow it further, as with a separate slower device. The work must run on the
calling thread (torch on the CPU with one intra-op thread does, backward included).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from fusionp2p.errors import ConfigError

__all__ = ["Throttle"]

T = TypeVar("T")


class Throttle:
    """Runs work as on a device ``speed`` times as fast as this one (``speed`` in (0, 1])."""

    def __init__(self, speed: float = 1.0) -> None:
        if not (isinstance(speed, int | float) and math.isfinite(speed) and 0 < speed <= 1):
            raise ConfigError(f"an emulated speed must be in (0, 1], got {speed!r}")
        self.speed = float(speed)

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()``, then a sleep so that the whole took ``1 / speed`` times the CPU time
        ``fn`` used on this thread (also when ``fn`` raises). CPU time, not wall time: a
        slower device of its own is not slowed further by the other processes sharing
        this machine, as long as they delay ``fn`` by less than the sleep."""
        if self.speed == 1.0:
            return fn()
        began, began_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn()
        finally:
            target = (time.thread_time() - began_cpu) / self.speed
            time.sleep(max(0.0, target - (time.perf_counter() - began)))
