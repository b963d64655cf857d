"""``Pipeline``: a job driven from this process (the data owner) over a swarm's peers.

``start_planned`` sets up a plan's layout (its peers must still be live), ``start_fixed``
splits the model by hand over the fastest live peers. Either way every method of the
``Pipeline`` blocks until the swarm answers; inputs, labels and the loss stay here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import ConfigError, DeadlineError, SwarmError
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.split import Partition
from fusionp2p.planning import NO_COMPRESSION, CostConfig, Plan, RuntimeLayout, Topology, estimate_segments
from fusionp2p.planning.estimate import Estimate
from fusionp2p.records import ModelSpec, PeerRecord, ShardReport
from fusionp2p.runtime.averaging import Fingerprint
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.pretrained import PretrainedWeights
from fusionp2p.runtime.replicated import ReplicatedDriver
from fusionp2p.runtime.restore import Restore

__all__ = ["Pipeline", "start_fixed", "start_planned"]

T = TypeVar("T")
Tensors = Mapping[str, torch.Tensor]


async def _within(coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
    try:
        return await asyncio.wait_for(coro, timeout)
    except TimeoutError:
        raise DeadlineError(f"{what} did not finish within {timeout:.1f} s") from None


class Pipeline:
    """A training job driven from this process over peers of a swarm (``DataOwner.pipeline``)."""

    def __init__(
        self,
        connection: SwarmConnection,
        driver: PipelineDriver | ReplicatedDriver,
        peers: list[PeerRecord],
        *,
        plan: Plan | None = None,
    ) -> None:
        self._connection = connection
        self.driver = driver
        self.peers = peers  # the owners of stages 1.. (stage 0 is this process), replica by replica
        self.plan = plan  # what it runs, when it was planned

    def estimate(self, topology: Topology, *, cost: CostConfig | None = None) -> Estimate:
        """The cost model's estimate of what this pipeline runs (its real partition, this
        process's own stage included) on ``topology`` (``DataOwner.topology()``)."""
        part = self.driver.partition
        owners = [peer for peer, _ in self.driver.setups[0].peers]
        segments = [(owners[seg.stage], seg.nodes) for seg in part.segments if seg.kind != "source"]
        ratios = {
            (owners[a], owners[b]): r for a, setup in enumerate(self.driver.setups) for b, r in setup.ratios
        }
        cost = cost or CostConfig(n_micro_batches=self.driver.n_micro_batches, compression=NO_COMPRESSION)
        return estimate_segments(self.driver.traced.dag, topology, segments, cost, ratios)

    @property
    def partition(self) -> Partition:
        return self.driver.partition

    @property
    def n_micro_batches(self) -> int:
        """Micro-batches a step takes now (fewer than planned once a replica is dropped)."""
        return self.driver.n_micro_batches

    @property
    def replicas(self) -> tuple[int, int]:
        """(replicas running, replicas set up): (1, 1) without replicas."""
        driver = self.driver
        return (len(driver.replicas), driver.planned) if isinstance(driver, ReplicatedDriver) else (1, 1)

    @property
    def stage_owners(self) -> list[str]:
        """Per runtime stage 1.., its owner (with replicas: in the first replica left)."""
        driver = self.driver
        return (driver.replicas[0] if isinstance(driver, ReplicatedDriver) else driver).stage_owners

    def slowest_owners(self) -> list[str]:
        """Per runtime stage 1.., the owner that computed it longest in the last iteration
        (with replicas: over the replicas left; without, its only owner)."""
        driver = self.driver
        drivers = driver.replicas if isinstance(driver, ReplicatedDriver) else [driver]
        if not all(len(d.stage_seconds) == len(d.stage_owners) + 1 for d in drivers):
            return self.stage_owners  # no iteration yet
        return [
            max(drivers, key=lambda d: d.stage_seconds[i + 1]).stage_owners[i]
            for i in range(len(drivers[0].stage_owners))
        ]

    @property
    def lost(self) -> list[str]:
        """Stage owners of dropped replicas that did not answer a ping."""
        return list(self.driver.lost) if isinstance(self.driver, ReplicatedDriver) else []

    def train_step(
        self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, timeout: float | None = None
    ) -> float:
        """One iteration (one ``(inputs, labels)`` per micro-batch) and an optimizer step.

        Raises:
            DeadlineError: it did not finish within ``timeout`` s (the pipeline is then in
                an unknown state: close it).
            ProtocolError / PeerUnreachableError: a stage failed or is gone.
        """
        return self._connection.call(_within(self.driver.train_step(batches), timeout, "the step"))

    def check_replicas(self, *, timeout: float | None = None) -> dict[int, Fingerprint]:
        """Per stage, a fingerprint of its parameters; with replicas, checked on each to
        agree (``runtime.averaging.fingerprints_agree``).

        Raises:
            ReplicasDiverged: two replicas hold different parameters (``ReplicatedDriver``).
            DeadlineError: not within ``timeout`` s.
        """
        driver = self.driver
        check = driver.check_replicas() if isinstance(driver, ReplicatedDriver) else driver.fingerprints()
        return self._connection.call(_within(check, timeout, "comparing the replicas"))

    def unresponsive(self, timeout: float = DEFAULT_TIMEOUTS.ping) -> list[str]:
        """The stage owners that do not answer a ping within ``timeout`` s."""
        return self._connection.call(self.driver.unresponsive(timeout))

    def run_iteration(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Forward and backward only; then ``fetch("grads")`` or ``step()``."""
        return self._connection.call(self.driver.run_iteration(batches))

    def step(self) -> None:
        self._connection.call(self.driver.step())

    def stage_seconds(self) -> list[float]:
        """Per runtime stage (0 is this process): seconds it computed in the last iteration."""
        return list(self.driver.stage_seconds)

    def stage_averaging(self) -> list[tuple[float, int]]:
        """Per runtime stage, in the last step: seconds spent averaging gradients with the
        other replicas, and how many averaged together ((0, 0) without replicas)."""
        return list(self.driver.stage_averaging)

    def fetch(self, what: str = "params", *, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """All stages' parameters (``"params"``), this iteration's gradients (``"grads"``), or
        a checkpoint's worth of state (``"state"``: every tensor and the optimizer's).

        Raises:
            DeadlineError: not within ``timeout`` s. ProtocolError / PeerUnreachableError.
        """
        return self._connection.call(_within(self.driver.fetch(what), timeout, f"fetching {what}"))

    def checkpoint(
        self, step: int, replicas: Mapping[int, str], *, timeout: float | None = None
    ) -> list[ShardReport]:
        """Every stage writes its shard of ``step`` and copies it to ``replicas[stage]``;
        their reports (``PipelineDriver.checkpoint``).

        Raises:
            DeadlineError: not within ``timeout`` s. ProtocolError / PeerUnreachableError.
        """
        return self._connection.call(
            _within(self.driver.checkpoint(step, replicas), timeout, "the checkpoint")
        )

    def close(self, teardown_timeout: float = DEFAULT_TIMEOUTS.teardown) -> None:
        """Tears the job down on its stages (each within ``teardown_timeout`` s, best effort)."""
        self._connection.call(self.driver.aclose(teardown_timeout))

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _live_peers(connection: SwarmConnection) -> dict[str, PeerRecord]:
    return dict(await connection.directory.fetch_peers())


async def start_planned(
    connection: SwarmConnection,
    spec: ModelSpec,
    plan: Plan | Sequence[Plan],
    options: JobOptions,
    *,
    registry: ModelRegistry | None = None,
    initial_state: Tensors | None = None,
    pretrained: PretrainedWeights | None = None,
    restore: Restore | None = None,
    exclude: Sequence[str] = (),
    averaging_codecs: Sequence[str] = (),
) -> Pipeline:
    """Sets ``plan`` up with this process as its data owner (``Plan.layout``); every OpData
    of the job names the plan's version. The stages start from ``restore`` (a checkpoint
    kept by stages, read from its holders but ``exclude``) or ``initial_state`` (every
    tensor, sent from here), else from ``pretrained`` weights, else from the spec's seed.
    Several plans are the replicas of one job (``ReplicatedPlan.plans``): each is set up as
    ``runtime.replicated`` runs them, ``options`` being the whole job's, each stage averaging
    with the codec ``averaging_codecs`` gives its plan stage (``ReplicatedPlan.averaging_codecs``).

    Raises:
        ConfigError: ``options`` are for another micro-batch count than the plan's, or the
            plan is of another model.
        SwarmError: a peer of the plan is no longer live.
        ProtocolError / PeerUnreachableError: a stage refused its setup or is unreachable.
    """
    plans = (plan,) if isinstance(plan, Plan) else tuple(plan)
    if options.n_micro_batches != len(plans) * plans[0].n_micro_batches:
        raise ConfigError(
            f"the plan is for {len(plans) * plans[0].n_micro_batches} micro-batches, not "
            f"{options.n_micro_batches}: plan again"
        )
    live = await _live_peers(connection)
    transport = await connection.transport()
    layouts = [p.layout(transport.peer_id) for p in plans]
    others = [peer for layout in layouts for peer in layout.peers[1:]]
    missing = [p[-8:] for p in others if p not in live]
    if missing:
        raise SwarmError(f"peers {missing} of the plan are no longer live: plan again")
    options = replace(options, plan_version=plans[0].version, expect_dag=plans[0].dag)
    if averaging_codecs:  # per plan stage -> per layout stage, by the peer that runs it
        codec_of = dict(zip(plans[0].peer_ids, averaging_codecs, strict=True))
        options = replace(options, averaging_codecs=tuple(codec_of.get(p, "none") for p in layouts[0].peers))
    addresses = {p: live[p].maddrs for p in others}
    driver: PipelineDriver | ReplicatedDriver
    if len(plans) == 1:
        driver = await PipelineDriver.create(
            transport,
            spec,
            layouts[0],
            options,
            addresses=addresses,
            registry=registry,
            initial_state=initial_state,
            pretrained=pretrained,
            restore=restore,
            exclude=exclude,
        )
    else:
        driver = await ReplicatedDriver.create(
            transport,
            spec,
            layouts,
            options,
            addresses=addresses,
            registry=registry,
            initial_state=initial_state,
            pretrained=pretrained,
            restore=restore,
            exclude=exclude,
        )
    return Pipeline(connection, driver, [live[p] for p in others], plan=plans[0])


async def start_fixed(
    connection: SwarmConnection,
    spec: ModelSpec,
    n_stages: int,
    options: JobOptions,
    *,
    assignment: Sequence[int] | Mapping[str, int] | None = None,
    ratios: Mapping[tuple[int, int], float] | None = None,
    registry: ModelRegistry | None = None,
    replicas: int = 1,
) -> Pipeline:
    """Splits ``spec``'s model over this process (stage 0) and the ``n_stages - 1`` fastest
    live peers: by ``assignment`` (a stage per operator node, or per node name), else in
    contiguous pieces of equal forward FLOPs; ``ratios[(a, b)]`` compresses what stage
    ``a`` sends stage ``b``. With ``replicas`` R > 1, R such pipelines on R x (n_stages - 1)
    peers (replica k the k-th run of them by speed), their gradients averaged
    (``runtime.replicated``); R must divide ``options.n_micro_batches``.

    Raises:
        SwarmError: fewer live peers than ``replicas x (n_stages - 1)``.
        ConfigError / ProtocolError / PeerUnreachableError: see ``PipelineDriver.create``.
    """
    live = await _live_peers(connection)
    need = replicas * (n_stages - 1)
    peers = sorted(live.values(), key=lambda p: -p.fp32_flops)[:need]
    if len(peers) < need:
        what = f"{replicas} replicas of {n_stages} stages" if replicas > 1 else f"{n_stages} stages"
        raise SwarmError(f"{what} need {need} live peers, the swarm has {len(peers)}")
    transport = await connection.transport()
    addresses = {p.peer_id: p.maddrs for p in peers}
    layouts = [
        RuntimeLayout(
            (transport.peer_id, *(p.peer_id for p in peers[k * (n_stages - 1) : (k + 1) * (n_stages - 1)])),
            assignment,
            ratios or {},
        )
        for k in range(replicas)
    ]
    driver: PipelineDriver | ReplicatedDriver
    if replicas == 1:
        driver = await PipelineDriver.create(
            transport, spec, layouts[0], options, addresses=addresses, registry=registry
        )
    else:
        driver = await ReplicatedDriver.create(
            transport, spec, layouts, options, addresses=addresses, registry=registry
        )
    return Pipeline(connection, driver, peers)
