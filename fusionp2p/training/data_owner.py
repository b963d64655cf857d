"""``DataOwner``: the role of the process that holds a job's data and drives its training.

It measures itself and its links (only it can), plans or submits a job, sets a plan up
as a ``Pipeline`` and trains a ``JobSpec`` to saved weights; its raw data never leaves
it. It talks to the swarm through a ``SwarmConnection`` (a ``Swarm`` is one:
``swarm.data_owner()``).

    owner = swarm.data_owner()
    plan = owner.plan(spec, n_micro_batches=4)
    with owner.pipeline(spec, plan=plan) as pipeline: ...
    result = owner.train(job)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import (
    NO_COMPRESSION,
    CompressionPolicy,
    CostConfig,
    Plan,
    Topology,
    plan_job,
    vouched_links,
)
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.training.export import export_run
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.owner_records import probe_from, self_record
from fusionp2p.training.pipeline import Pipeline, start_fixed, start_planned
from fusionp2p.training.submit import SubmittedJob, submit_job
from fusionp2p.training.trainer import TrainResult, train

__all__ = ["DataOwner"]

T = TypeVar("T")
MAX_TOPOLOGY_PEERS = 16  # the fastest live peers a data owner plans over by itself


class DataOwner:
    """This process as a job's data owner, on ``connection``'s swarm."""

    def __init__(self, connection: SwarmConnection) -> None:
        self.connection = connection

    @property
    def directory(self) -> SwarmDirectory:
        """The swarm's records in the DHT."""
        return self.connection.directory

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the connection's event loop; its result."""
        return self.connection.call(coro)

    async def atopology(self, *, max_peers: int = MAX_TOPOLOGY_PEERS, probe_bytes: int = 1 << 20) -> Topology:
        """The swarm as a planner sees it, with this process in it: the live peers (the
        ``max_peers`` fastest), their measured links, this device (measured once, cached)
        and this process's links to each of them (probed now).

        Raises:
            PlanningError: no live peer, or a peer no measured link reaches.
        """
        transport = await self.connection.transport()
        live = await self.directory.fetch_peers()
        peers = sorted(live.values(), key=lambda p: -p.fp32_flops)[:max_peers]
        chosen = {p.peer_id for p in peers}
        links = [lk for lk in await self.directory.fetch_links(sorted(chosen)) if lk.dst in chosen]
        me = await asyncio.to_thread(self_record, transport.peer_id, site=self.connection.site)
        mine = await probe_from(transport, peers, nbytes=probe_bytes)
        return Topology.from_records([*peers, me], vouched_links([*links, *mine], trusted={me.peer_id}))

    def topology(self, **kwargs: Any) -> Topology:
        """Sync ``atopology``."""
        return self.call(self.atopology(**kwargs))

    async def aplan(
        self,
        spec: ModelSpec,
        *,
        method: str = "op-fence",
        n_micro_batches: int = 8,
        compression: CompressionPolicy | None = None,
        registry: ModelRegistry | None = None,
        topology: Topology | None = None,
    ) -> Plan:
        """Plans ``spec``'s model over the live peers by itself (this process keeps the
        inputs and the loss): OP-Fence by default, or a baseline by name
        (``records.PLAN_METHODS``). Top-K is off unless ``compression`` says otherwise (it
        costs convergence).

        Raises:
            ConfigError: an unknown method, family or config.
            PlanningError: no peers, or the model fits nowhere.
        """
        topo = topology or await self.atopology()
        registry = registry or ModelRegistry.for_data_owner(spec.family)
        traced = await asyncio.to_thread(trace_spec, spec, registry, fake=True)
        cost = CostConfig(n_micro_batches=n_micro_batches, compression=compression or NO_COMPRESSION)
        transport = await self.connection.transport()
        return plan_job(traced.dag, topo, transport.peer_id, method=method, cost=cost)

    def plan(self, spec: ModelSpec, **kwargs: Any) -> Plan:
        """Sync ``aplan``."""
        return self.call(self.aplan(spec, **kwargs))

    async def asubmit(self, job: JobSpec, **kwargs: Any) -> SubmittedJob:
        """Submits ``job`` to the elected coordinator: the plan it published. ``kwargs`` go
        to ``training.submit.submit_job`` (``registry``; a re-plan's ``replaces``,
        ``exclude``, ``speeds``)."""
        kwargs.setdefault("site", self.connection.site)
        return await submit_job(await self.connection.transport(), self.directory, job, **kwargs)

    def submit(self, job: JobSpec, **kwargs: Any) -> SubmittedJob:
        """Sync ``asubmit``."""
        return self.call(self.asubmit(job, **kwargs))

    def pipeline(
        self,
        spec: ModelSpec,
        *,
        plan: Plan | str | None = None,
        n_stages: int | None = None,
        assignment: Sequence[int] | Mapping[str, int] | None = None,
        ratios: Mapping[tuple[int, int], float] | None = None,
        options: JobOptions | None = None,
        registry: ModelRegistry | None = None,
        initial_state: Mapping[str, torch.Tensor] | None = None,
        replicas: int = 1,
    ) -> Pipeline:
        """Sets ``spec``'s model up over live peers; this process runs stage 0 (it reads the
        raw inputs and computes the loss, which never leave it).

        By default OP-Fence plans the model over the live peers (``plan="op-fence"``, for
        ``options.n_micro_batches``); a baseline by name, or a ``Plan`` from ``plan()`` or a
        coordinator, runs as given (``options`` default to the plan's micro-batch count).
        With ``n_stages`` (and optionally ``assignment``, a stage per operator node, and
        ``ratios[(a, b)]``, the Top-K ratio of what stage ``a`` sends stage ``b``) the model
        goes to the ``n_stages - 1`` fastest peers instead, in contiguous pieces of equal
        FLOPs unless ``assignment`` says otherwise. Each peer builds only its stage, and
        only if it serves ``spec.family``; ``registry`` is what this process builds the
        model from. ``initial_state`` (a checkpoint's tensors by name) replaces the model's
        initial weights and optimizer state on every stage. ``replicas`` (with ``n_stages``):
        that many such pipelines, each on its own peers, averaging their gradients every step
        (data parallelism; it must divide the micro-batch count).

        Raises:
            SwarmError: fewer live peers than ``n_stages - 1``, or a planned peer is gone.
            ConfigError: a bad config, plan method, or a plan of another model or
                micro-batch count.
            PlanningError: planning found no peers or no fit.
            ProtocolError: a peer refused its stage (an unknown family, too little
                memory, busy); the peer's reason is in the message.
        """
        if replicas > 1 and (n_stages is None or initial_state is not None):
            raise ConfigError("replicas need n_stages (a planned job has one pipeline) and no initial_state")
        if n_stages is not None or assignment is not None:
            fixed = options or JobOptions()
            return self.call(
                start_fixed(
                    self.connection,
                    spec,
                    n_stages or 2,
                    fixed,
                    assignment=assignment,
                    ratios=ratios,
                    registry=registry,
                    replicas=replicas,
                )
            )
        if not isinstance(plan, Plan):
            n_b = options.n_micro_batches if options is not None else 1
            plan = self.plan(spec, method=plan or "op-fence", n_micro_batches=n_b, registry=registry)
        options = options or JobOptions(n_micro_batches=plan.n_micro_batches)
        return self.call(
            start_planned(
                self.connection, spec, plan, options, registry=registry, initial_state=initial_state
            )
        )

    def train(
        self,
        job: JobSpec,
        *,
        progress: bool = True,
        out: Callable[[str], Any] = print,
        registry: ModelRegistry | None = None,
        resume: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> TrainResult:
        """Trains ``job`` with this process as its data owner: submits it, sets the
        published plan up, runs ``job.steps`` steps on its data (which never leaves this
        process) with a progress bar, writes metrics, checkpoints and the final weights
        under ``job.run_dir``. A lost or stopped stage owner is planned around from the
        latest checkpoint; ``resume`` goes on from the newest run's checkpoint (after this
        process was lost); ``on_step`` gets each step's metrics row (``training.trainer``).

        Raises:
            ConfigError, SwarmError, CoordinatorError, ProtocolError: see ``trainer.train``.
        """
        return train(
            self.connection,
            job,
            progress=progress,
            out=out,
            registry=registry,
            resume=resume,
            on_step=on_step,
        )

    def export(
        self,
        run_dir: str | Path,
        out_dir: str | Path,
        *,
        registry: ModelRegistry | None = None,
        out: Any = print,
    ) -> Path:
        """Writes a run's weights from the shards its stages keep into ``out_dir`` (a
        sharded ``save_pretrained`` layout; ``training.export``), peer to peer.

        Raises:
            ConfigError: not a run directory with a checkpoint, or a shard with no live holder.
            ProtocolError: no holder of a shard gave it with its digests.
        """

        async def run() -> Path:
            transport = await self.connection.transport()
            return await export_run(transport, Path(run_dir), Path(out_dir), registry=registry, out=out)

        return self.call(run())
