"""R pipelines of one job, driven from its data owner: data parallelism over replicas.

Replica ``k`` is a ``PipelineDriver`` of its own under the job name ``<job>-r<k>``, on its
own stage peers; all of them run this process's stage on one exec service, each on its
own copy of this stage's parameters (made from the same seed, so equal). An iteration
splits the global batch's micro-batches in R contiguous runs, one per replica, and runs
the replicas at once. Before the optimizer step the replicas average their gradients,
weighted by micro-batches, so every replica applies the gradient of the whole global
batch: the stage peers through hivemind's averager (``runtime.averaging``, group key
job, plan version, stage, this owner), this process's R copies here, in memory. The
replicas' parameters then stay equal up to rounding; ``check_replicas`` compares them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence

import torch

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import ConfigError, FusionP2PError, ReplicasDiverged
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.split import Partition
from fusionp2p.opdag.trace import TracedModel
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import MAX_REPLICAS, JobSetup, ModelSpec, ShardReport, replica_job
from fusionp2p.runtime.averaging import CODEC_RTOL, Fingerprint, fingerprint_distance, fingerprints_agree
from fusionp2p.runtime.driver import PipelineDriver, owner_service
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.pretrained import PretrainedWeights
from fusionp2p.runtime.restore import Restore
from fusionp2p.runtime.service import ExecutorService

__all__ = ["ReplicatedDriver", "replica_options", "split_micro_batches"]

logger = logging.getLogger(__name__)


def split_micro_batches(n_micro_batches: int, replicas: int) -> list[range]:
    """The global batch's micro-batches each replica runs: R contiguous runs of equal length.

    Raises:
        ConfigError: ``replicas`` does not divide ``n_micro_batches``.
    """
    if not 1 <= replicas <= MAX_REPLICAS or n_micro_batches % replicas:
        raise ConfigError(
            f"{replicas} replicas need a micro-batch count they divide (1-{MAX_REPLICAS}), "
            f"got {n_micro_batches}"
        )
    each = n_micro_batches // replicas
    return [range(k * each, (k + 1) * each) for k in range(replicas)]


def replica_options(options: JobOptions, layouts: Sequence[RuntimeLayout], replica: int) -> JobOptions:
    """``options`` of the whole job as replica ``replica`` of ``layouts`` runs them: its own
    job name, its share of the micro-batches, the group it averages in and with whom, and
    its share of the data owner's memory allowance (this process holds every replica's
    copy of its stage)."""
    runs = split_micro_batches(options.n_micro_batches, len(layouts))
    allowance = options.max_memory // len(layouts) if options.max_memory is not None else None
    return dataclasses.replace(
        options,
        job=replica_job(options.job, replica, len(layouts)),
        n_micro_batches=len(runs[replica]),
        max_memory=allowance,
        replicas=len(layouts),
        replica=replica,
        group=options.job,
        replica_peers=tuple(tuple(layout.peers) for layout in layouts),
    )


class ReplicatedDriver:
    """Runs ``len(replicas)`` pipelines of one job. Create with ``await ReplicatedDriver.create(...)``."""

    def __init__(self, service: ExecutorService, replicas: list[PipelineDriver], options: JobOptions) -> None:
        self.service = service
        self.replicas = replicas
        self.options = options
        self.iteration = 0
        self.averaging_s = 0.0  # seconds this process spent averaging its own copies, last step
        self.per_replica = options.n_micro_batches // len(replicas)  # micro-batches each replica runs
        self.generation = 0  # of the stages' averaging groups: one more per lost replica
        self.planned = len(replicas)  # replicas set up; ``replicas`` holds those left
        self.lost: list[str] = []  # stage owners of dropped replicas that did not answer a ping

    @property
    def job(self) -> str:
        return self.options.job

    @property
    def n_micro_batches(self) -> int:
        """Micro-batches of one step: each replica's run, for the replicas left."""
        return self.per_replica * len(self.replicas)

    @property
    def partition(self) -> Partition:
        return self.replicas[0].partition

    @property
    def setups(self) -> list[JobSetup]:
        """Replica 0's setups (every replica's are the same but for peers and names)."""
        return self.replicas[0].setups

    @property
    def traced(self) -> TracedModel:
        return self.replicas[0].traced

    @property
    def stage_seconds(self) -> list[float]:
        """Per stage, the most seconds any replica's owner of it computed in the last iteration."""
        return [max(col) for col in zip(*(d.stage_seconds for d in self.replicas), strict=True)]

    @property
    def stage_averaging(self) -> list[tuple[float, int]]:
        """Per stage, in the last step: the most seconds a replica of it spent averaging,
        and the fewest replicas that averaged together (R: none was left out). The data
        owner's own stage: its in-memory average of its R copies."""
        data_stage = self.partition.data_stage
        out = []
        for stage, reports in enumerate(zip(*(d.stage_averaging for d in self.replicas), strict=True)):
            if stage == data_stage:
                out.append((self.averaging_s, len(self.replicas)))
            else:
                out.append((max(s for s, _ in reports), min(g for _, g in reports)))
        return out

    async def checkpoint(self, step: int, replicas: Mapping[int, str]) -> list[ShardReport]:
        """Replica 0's stages write their shards (``PipelineDriver.checkpoint``): every
        replica holds the same parameters and optimizer state."""
        return await self.replicas[0].checkpoint(step, replicas)

    @classmethod
    async def create(
        cls,
        transport: Transport,
        spec: ModelSpec,
        layouts: Sequence[RuntimeLayout],
        options: JobOptions,
        *,
        addresses: Mapping[str, Sequence[str]] | None = None,
        registry: ModelRegistry | None = None,
        initial_state: Mapping[str, torch.Tensor] | None = None,
        pretrained: PretrainedWeights | None = None,
        restore: Restore | None = None,
        exclude: Collection[str] = (),
    ) -> ReplicatedDriver:
        """Sets up one pipeline per layout (each with this process as its data stage and
        its own stage peers), every replica's stages from the same tensors: the spec's seed,
        ``initial_state``, ``pretrained`` or ``restore`` (``PipelineDriver.create``).

        Raises:
            ConfigError: fewer than 2 layouts, layouts of different shapes, a peer in two
                replicas, or a micro-batch count the replicas do not divide.
            ProtocolError / PeerUnreachableError: see ``PipelineDriver.create``.
        """
        r = len(layouts)
        split_micro_batches(options.n_micro_batches, r)
        if r < 2:
            raise ConfigError("a replicated job needs at least 2 replicas")
        if len({len(layout.peers) for layout in layouts}) != 1:
            raise ConfigError("every replica needs as many stages")
        others = [p for layout in layouts for s, p in enumerate(layout.peers) if s != layout.data_stage]
        if len(set(others)) != len(others):
            raise ConfigError("a peer runs a stage in two replicas: each needs its own stage peers")
        service = await owner_service(transport, options, jobs=r)
        drivers: list[PipelineDriver] = []
        try:
            for k, layout in enumerate(layouts):  # one after another: tracing is not thread-safe
                drivers.append(
                    await PipelineDriver.create(
                        transport,
                        spec,
                        layout,
                        replica_options(options, layouts, k),
                        addresses=addresses,
                        registry=registry,
                        initial_state=initial_state,
                        pretrained=pretrained,
                        restore=restore,
                        exclude=exclude,
                        service=service,
                    )
                )
        except BaseException:
            await asyncio.gather(*(d.aclose() for d in drivers), return_exceptions=True)
            await service.aclose()
            raise
        logger.info("job %s: %d replicas of %d stages", options.job, r, len(layouts[0].peers))
        return cls(service, drivers, options)

    async def run_iteration(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Forward and backward of the global batch, each replica its run of micro-batches;
        the losses in the global batch's order. A replica whose stage failed or is gone is
        dropped, with no roll-back of the others: its runs' losses are left out, the
        replicas left average among themselves from now on, and ``n_micro_batches`` shrinks
        by its run.

        Raises:
            ValueError: not ``n_micro_batches`` batches.
            ProtocolError / PeerUnreachableError: every replica failed, or the replicas left
                could not be regrouped. See ``PipelineDriver.run_iteration``.
        """
        if len(batches) != self.n_micro_batches:
            raise ValueError(f"expected {self.n_micro_batches} micro-batches, got {len(batches)}")
        runs = split_micro_batches(self.n_micro_batches, len(self.replicas))
        results = await asyncio.gather(
            *(d.run_iteration([batches[m] for m in run]) for d, run in zip(self.replicas, runs, strict=True)),
            return_exceptions=True,
        )
        failed = {k: r for k, r in enumerate(results) if isinstance(r, BaseException)}
        for error in failed.values():
            if not isinstance(error, FusionP2PError):
                raise error
        if len(failed) == len(self.replicas):
            raise next(iter(failed.values()))
        if failed:
            await self._drop(failed)
        return [loss for r in results if not isinstance(r, BaseException) for loss in r]

    async def _drop(self, failed: Mapping[int, BaseException]) -> None:
        """Drops the failed replicas and regroups the stages of the others."""
        for k, error in failed.items():
            logger.warning(
                "job %s: replica %d dropped (%s); %d replica(s) go on without a roll-back",
                self.job,
                k,
                error,
                len(self.replicas) - len(failed),
            )
        lost = [d for k, d in enumerate(self.replicas) if k in failed]
        self.replicas = [d for k, d in enumerate(self.replicas) if k not in failed]
        silent = await asyncio.gather(*(d.unresponsive() for d in lost))
        self.lost += [peer for peers in silent for peer in peers]
        await asyncio.gather(*(self._end(d) for d in lost))
        self.generation += 1
        data_stage = self.partition.data_stage
        stages = [s for s in range(self.partition.n_stages) if s != data_stage]
        peers = {s: tuple(d.setups[s].peer_of(s) for d in self.replicas) for s in stages}
        await asyncio.gather(*(d.regroup(self.generation, k, peers) for k, d in enumerate(self.replicas)))

    async def _end(self, driver: PipelineDriver) -> None:
        await driver.aclose(teardown_timeout=5.0)
        await self.service.remove(driver.job, "its replica was dropped")

    async def step(self) -> None:
        """Averages this process's copies of its stage, then every replica steps (its stage
        peers average theirs with hivemind first)."""
        for driver in self.replicas:
            await self.service.wait_ready(driver.job)
        executors = [d.executor for d in self.replicas]

        def average() -> None:  # equal runs of micro-batches: equal weights
            with torch.no_grad():
                for tensors in zip(*(e.grad_tensors() for e in executors), strict=True):
                    mean = torch.stack(list(tensors)).mean(dim=0)
                    for t in tensors:
                        t.copy_(mean)

        loop = asyncio.get_running_loop()
        began = loop.time()
        await self.service.in_pool(average)
        self.averaging_s = loop.time() - began
        await asyncio.gather(*(d.step() for d in self.replicas))
        self.iteration += 1

    async def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One iteration of every replica and their optimizer steps; the mean micro-batch loss."""
        losses = await self.run_iteration(batches)
        await self.step()
        return sum(losses) / len(losses)

    async def fetch(self, what: str) -> dict[str, torch.Tensor]:
        """Replica 0's tensors (``PipelineDriver.fetch``): every replica holds the same ones."""
        return await self.replicas[0].fetch(what)

    async def check_replicas(self) -> dict[int, Fingerprint]:
        """Per stage, replica 0's parameter fingerprint, checked against every replica's
        (within ``CODEC_RTOL`` of the codec the stage averages with).

        Raises:
            ReplicasDiverged: a replica holds other parameters for a stage (their averages
                no longer describe one model).
        """
        prints = await asyncio.gather(*(d.fingerprints() for d in self.replicas))
        for stage, first in prints[0].items():
            rtol = CODEC_RTOL[self.options.averaging_codec(stage)]  # within the codec's rounding
            differ = [
                k for k, other in enumerate(prints) if not fingerprints_agree(first, other[stage], rtol)
            ]
            if differ:
                apart = max(fingerprint_distance(first, prints[k][stage]) for k in differ)
                raise ReplicasDiverged(
                    f"job {self.job}: replicas {differ} hold other parameters for stage {stage} than "
                    f"replica 0 after {self.iteration} steps ({apart:.1e} of their norm apart): "
                    "the replicas diverged"
                )
        return prints[0]

    async def unresponsive(self, timeout: float = DEFAULT_TIMEOUTS.ping) -> list[str]:
        """The stage owners of any replica that leave or do not answer a ping."""
        found = await asyncio.gather(*(d.unresponsive(timeout) for d in self.replicas))
        return sorted({peer for peers in found for peer in peers})

    async def aclose(self, teardown_timeout: float = DEFAULT_TIMEOUTS.teardown) -> None:
        """Tears every replica down, then this process's exec service."""
        await asyncio.gather(*(d.aclose(teardown_timeout) for d in self.replicas), return_exceptions=True)
        await self.service.aclose()
