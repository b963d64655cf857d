"""``Pipeline``: a training job driven from this process (the data owner) over the peers of a
``Swarm``; made by ``Swarm.pipeline`` (over a plan, or a fixed number of stages)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from fusionp2p.errors import DeadlineError
from fusionp2p.opdag.split import Partition
from fusionp2p.planning import NO_COMPRESSION, CostConfig, Plan, Topology, estimate_segments
from fusionp2p.planning.estimate import Estimate
from fusionp2p.records import PeerRecord
from fusionp2p.runtime.driver import PipelineDriver

if TYPE_CHECKING:
    from fusionp2p.swarm import Swarm

__all__ = ["Pipeline"]

T = TypeVar("T")


async def _within(coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        raise DeadlineError(f"{what} did not finish within {timeout:.1f} s") from None


class Pipeline:
    """A training job driven from this process (the data owner) over peers of a ``Swarm``.

    Made by ``Swarm.pipeline``; every method blocks until the swarm answers. Inputs,
    labels and the loss stay in this process.
    """

    def __init__(
        self, swarm: Swarm, driver: PipelineDriver, peers: list[PeerRecord], *, plan: Plan | None = None
    ) -> None:
        self._swarm = swarm
        self.driver = driver
        self.peers = peers  # the owners of stages 1.. (stage 0 is this process)
        self.plan = plan  # what it runs, when it was planned

    def estimate(self, topology: Topology, *, cost: CostConfig | None = None) -> Estimate:
        """The cost model's estimate of what this pipeline runs (its real partition, this
        process's own stage included) on ``topology`` (``swarm.topology()``)."""
        part = self.driver.partition
        owners = [peer for peer, _ in self.driver.setups[0].peers]
        segments = [(owners[seg.stage], seg.nodes) for seg in part.segments if seg.kind == "ops"]
        ratios = {
            (owners[a], owners[b]): r for a, setup in enumerate(self.driver.setups) for b, r in setup.ratios
        }
        cost = cost or CostConfig(n_micro_batches=self.driver.n_micro_batches, compression=NO_COMPRESSION)
        return estimate_segments(self.driver.traced.dag, topology, segments, cost, ratios)

    @property
    def partition(self) -> Partition:
        return self.driver.partition

    def train_step(
        self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, timeout: float | None = None
    ) -> float:
        """One iteration (one ``(inputs, labels)`` per micro-batch) and an optimizer step.

        Raises:
            DeadlineError: it did not finish within ``timeout`` s (the pipeline is then in
                an unknown state: close it).
            ProtocolError / PeerUnreachableError: a stage failed or is gone.
        """
        return self._swarm.call(_within(self.driver.train_step(batches), timeout, "the step"))

    def unresponsive(self, timeout: float = 5.0) -> list[str]:
        """The stage owners that do not answer a ping within ``timeout`` s."""
        return self._swarm.call(self.driver.unresponsive(timeout))

    def run_iteration(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Forward and backward only; then ``fetch("grads")`` or ``step()``."""
        return self._swarm.call(self.driver.run_iteration(batches))

    def step(self) -> None:
        self._swarm.call(self.driver.step())

    def stage_seconds(self) -> list[float]:
        """Per runtime stage (0 is this process): seconds it computed in the last iteration."""
        return list(self.driver.stage_seconds)

    def fetch(self, what: str = "params", *, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """All stages' parameters (``"params"``), this iteration's gradients (``"grads"``), or
        a checkpoint's worth of state (``"state"``: every tensor and the optimizer's).

        Raises:
            DeadlineError: not within ``timeout`` s. ProtocolError / PeerUnreachableError.
        """
        return self._swarm.call(_within(self.driver.fetch(what), timeout, f"fetching {what}"))

    def close(self, teardown_timeout: float = 10.0) -> None:
        """Tears the job down on its stages (each within ``teardown_timeout`` s, best effort)."""
        self._swarm.call(self.driver.aclose(teardown_timeout))

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
