"""``Swarm``: the public Python view of a swarm, usable from any machine.

    with Swarm(initial_peers=["/ip4/.../p2p/Qm..."]) as swarm:
        for peer in swarm.peers(): ...
        for link in swarm.links(): ...

In async code use ``async with Swarm(...) as swarm`` and ``await swarm.apeers()`` /
``await swarm.alinks()``. A Swarm runs a client-mode DHT node: it reads the swarm's
records without serving as a full peer. ``swarm.pipeline(spec, ...)`` trains a model
split over the swarm's peers, with this process as the data owner; ``swarm.train(job)``
submits a ``JobSpec`` to the elected coordinator and trains on the plan it publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from fusionp2p.compression import RatioWarmup
from fusionp2p.config import DEFAULT_SWARM, OptimizerConfig, check_peer_maddr, check_site
from fusionp2p.coordination.election import lease_in_force
from fusionp2p.data_owner import plan_job, probe_from, self_record
from fusionp2p.errors import ConfigError, SwarmError
from fusionp2p.net.dht_node import start_dht
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.pipeline import Pipeline
from fusionp2p.planning import NO_COMPRESSION, CompressionPolicy, CostConfig, Plan, Topology
from fusionp2p.records import LeaseRecord, LinkRecord, PeerRecord, PlanStageRecord, RunStatusRecord
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.submit import SubmittedJob, submit_job

if TYPE_CHECKING:
    from fusionp2p.training.trainer import TrainResult

__all__ = ["Pipeline", "Swarm"]

T = TypeVar("T")


def _start_signed_dht(initial_peers: Sequence[str]) -> tuple[Any, Any]:
    """A client-mode DHT node with a fresh identity, and that identity's record signer; the
    key file lives only while the daemon starts (nothing of it stays on disk)."""
    with tempfile.TemporaryDirectory(prefix="fusionp2p-swarm-") as folder:
        path = os.path.join(folder, "identity.key")
        ensure_identity(path)
        key = load_signing_key(path)
        dht = start_dht(
            initial_peers=initial_peers,
            client_mode=True,
            identity_path=path,
            signing_key=key,
            fresh_identity=True,
        )
        return dht, key


async def _end_loop_tasks(p2p: P2P | None) -> None:
    """Closes the libp2p handle and cancels what still runs on the loop, before it closes."""
    if p2p is not None:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Swarm:
    """A read-only handle on a swarm's live peers and measured links.

    Raises:
        SwarmError: no initial peer given, or none answered.
    """

    def __init__(
        self,
        initial_peers: Sequence[str],
        *,
        swarm: str = DEFAULT_SWARM,
        timeout: float = 15.0,
        site: str = "",
    ) -> None:
        self.site = check_site(site, "Swarm site")  # this data owner's, as PeerRecord.site
        if not initial_peers:
            raise SwarmError(
                "Swarm needs at least one initial peer multiaddr (printed by `fusionp2p peer` at start)"
            )
        self.initial_peers = [check_peer_maddr(m, "--initial-peers") for m in initial_peers]
        self.name = swarm
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._p2p: P2P | None = None  # this process's handle on the DHT's libp2p node, for streams
        try:
            asyncio.get_running_loop()
            self._dht, key = _start_signed_dht(self.initial_peers)
        except RuntimeError:
            # sync use: hivemind's futures bind to the thread's current loop (creating one if
            # there is none, never closed); give them this Swarm's own loop, closed on close()
            self._loop = asyncio.new_event_loop()
            previous = getattr(asyncio.get_event_loop_policy(), "_local", None)
            previous_loop = getattr(previous, "_loop", None)
            asyncio.set_event_loop(self._loop)
            try:
                self._dht, key = _start_signed_dht(self.initial_peers)
            except BaseException:
                self._loop.close()
                raise
            finally:
                asyncio.set_event_loop(previous_loop)
        marker = RSASignatureValidator(key).local_public_key  # signs this data owner's run reports
        self._directory = SwarmDirectory(self._dht, swarm, owner_marker=marker, timeout=timeout)

    # -- async API ---------------------------------------------------------------------

    async def apeers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        peers = await self._directory.fetch_peers()
        return [peers[pid] for pid in sorted(peers)]

    async def alinks(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        peers = await self._directory.fetch_peers()
        links = await self._directory.fetch_links(sorted(peers))
        return sorted((lk for lk in links if lk.dst in peers), key=lambda lk: (lk.src, lk.dst))

    async def acoordinator(self) -> LeaseRecord | None:
        """The coordinator lease in force (its holder and epoch), or None."""
        return lease_in_force(await self._directory.fetch_leases(), get_dht_time())

    async def ajobs(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        """Every complete plan in the DHT: (job, epoch, coordinator) -> its stages."""
        return await self._directory.fetch_all_plans()

    async def __aenter__(self) -> Swarm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # -- sync API ----------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise SwarmError("this Swarm is closed")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._thread is None:
            # one long-lived loop per Swarm: hivemind ties its futures to the first loop used
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="fusionp2p-swarm", daemon=True
            )
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on this Swarm's event loop (where its libp2p handle lives); its result."""
        return self._run(coro)

    def peers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        return self._run(self.apeers())

    def links(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        return self._run(self.alinks())

    def coordinator(self) -> LeaseRecord | None:
        """Sync ``acoordinator``."""
        return self._run(self.acoordinator())

    def runs(self) -> list[RunStatusRecord]:
        """Training runs as their data owners last reported them (progress, newest events)."""
        return self._run(self._directory.fetch_runs())

    def jobs(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        """Sync ``ajobs``."""
        return self._run(self.ajobs())

    async def _transport(self) -> P2PTransport:
        """This process's libp2p handle for streams (one, on this Swarm's loop)."""
        self._p2p = self._p2p or await self._dht.replicate_p2p()
        return P2PTransport(self._p2p)

    async def atopology(self, *, max_peers: int = 16, probe_bytes: int = 1 << 20) -> Topology:
        """The swarm as a planner sees it, with this process (the data owner) in it: the live
        peers (the ``max_peers`` fastest), their measured links, this device (measured once,
        cached) and this process's links to each of them (probed now).

        Raises:
            PlanningError: no live peer, or a peer no measured link reaches.
        """
        transport = await self._transport()
        peers = sorted(await self.apeers(), key=lambda p: -p.fp32_flops)[:max_peers]
        chosen = {p.peer_id for p in peers}
        links = [lk for lk in await self.alinks() if lk.src in chosen and lk.dst in chosen]
        me = await asyncio.to_thread(self_record, transport.peer_id, site=self.site)
        mine = await probe_from(transport, peers, nbytes=probe_bytes)
        return Topology.from_records([*peers, me], [*links, *mine])

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
        """Plans ``spec``'s model over the live peers (this process keeps the inputs and the
        loss): OP-Fence by default, or a baseline by name (``data_owner.PLAN_METHODS``).
        Top-K is off unless ``compression`` says otherwise (it costs convergence).

        Raises:
            ConfigError: an unknown method, family or config.
            PlanningError: no peers, or the model fits nowhere.
        """
        topo = topology or await self.atopology()
        registry = registry or ModelRegistry.for_data_owner(spec.family)
        traced = await asyncio.to_thread(trace_spec, spec, registry, fake=True)
        cost = CostConfig(n_micro_batches=n_micro_batches, compression=compression or NO_COMPRESSION)
        transport = await self._transport()
        return plan_job(traced.dag, topo, transport.peer_id, method=method, cost=cost)

    @property
    def directory(self) -> SwarmDirectory:
        """The swarm's records in the DHT (read-only from a Swarm)."""
        return self._directory

    async def asubmit(
        self, job: JobSpec, *, registry: ModelRegistry | None = None, **kwargs: Any
    ) -> SubmittedJob:
        """Submits ``job`` to the elected coordinator: the plan it published. ``kwargs`` go
        to ``training.submit.submit_job`` (a re-plan's ``replaces``, ``exclude``, ``speeds``)."""
        kwargs.setdefault("site", self.site)
        return await submit_job(await self._transport(), self._directory, job, registry=registry, **kwargs)

    def submit(self, job: JobSpec, **kwargs: Any) -> SubmittedJob:
        """Sync ``asubmit``."""
        return self._run(self.asubmit(job, **kwargs))

    def train(self, job: JobSpec, **kwargs: Any) -> TrainResult:
        """Trains ``job`` on the swarm with this process as its data owner: submits it, sets
        the published plan up, runs ``job.steps`` steps on its data (which never leaves this
        process) with a progress bar, writes metrics, checkpoints and the final weights
        under ``job.run_dir`` (``training.trainer.train``).

        Raises:
            ConfigError, SwarmError, CoordinatorError, ProtocolError: see ``train``.
        """
        from fusionp2p.training.trainer import train

        return train(self, job, **kwargs)

    def topology(self, **kwargs: Any) -> Topology:
        """Sync ``atopology``."""
        return self._run(self.atopology(**kwargs))

    def plan(self, spec: ModelSpec, **kwargs: Any) -> Plan:
        """Sync ``aplan``."""
        return self._run(self.aplan(spec, **kwargs))

    def pipeline(
        self,
        spec: ModelSpec,
        *,
        plan: Plan | str | None = None,
        n_stages: int | None = None,
        assignment: Sequence[int] | None = None,
        n_micro_batches: int | None = None,
        optimizer: OptimizerConfig | None = None,
        loss: str = "lm",
        ratios: dict[int, float] | None = None,
        timeout: float = 120.0,
        registry: ModelRegistry | None = None,
        epoch: int = 0,
        job: str | None = None,
        initial_state: Mapping[str, torch.Tensor] | None = None,
        ratio_warmup: RatioWarmup | int = 0,
    ) -> Pipeline:
        """Sets ``spec``'s model up over live peers; this process runs stage 0 (it reads the
        raw inputs and computes the loss, which never leave it).

        By default OP-Fence plans the model over the live peers (``plan="op-fence"``); a
        baseline by name, or a ``Plan`` from ``swarm.plan``, runs as given. With
        ``n_stages`` (and optionally ``assignment``, a stage per operator node) the model
        goes to the ``n_stages - 1`` fastest peers instead, in contiguous pieces of equal
        FLOPs unless ``assignment`` says otherwise. Each peer builds only its stage, and only
        if it serves ``spec.family`` (built in, or enabled by its operator with
        ``--allow-model``); ``registry`` is what this process builds the model from
        (default: built-ins, installed entry points, and ``spec.family`` if it is an
        import path). ``initial_state`` (a checkpoint's tensors by name) replaces the
        model's initial weights and optimizer state on every stage.
        Over the first ``ratio_warmup`` iterations (an int, or a ``RatioWarmup`` that
        continues a ramp) the plan's Top-K ratios grow geometrically from 1 (dense) to
        their planned values.

        Raises:
            SwarmError: fewer live peers than ``n_stages - 1``.
            ConfigError: a bad config, plan method, or a plan of another model.
            PlanningError: planning found no peers or no fit.
            ProtocolError: a peer refused its stage (an unknown family, too little
                memory, busy); the peer's reason is in the message.
        """
        if isinstance(ratio_warmup, int):
            ratio_warmup = RatioWarmup(ratio_warmup)
        if n_stages is not None or assignment is not None:
            return self._fixed_pipeline(
                spec,
                n_stages or 2,
                assignment,
                n_micro_batches=n_micro_batches or 1,
                optimizer=optimizer,
                loss=loss,
                ratios=ratios,
                timeout=timeout,
                registry=registry,
                ratio_warmup=ratio_warmup,
            )
        if not isinstance(plan, Plan):
            plan = self.plan(
                spec, method=plan or "op-fence", n_micro_batches=n_micro_batches or 1, registry=registry
            )
        if n_micro_batches is not None and n_micro_batches != plan.n_micro_batches:
            raise ConfigError(
                f"the plan is for {plan.n_micro_batches} micro-batches, not {n_micro_batches}: plan again"
            )
        live = {p.peer_id: p for p in self.peers()}

        async def create() -> PipelineDriver:
            transport = await self._transport()
            order, layout, link_ratios, held = plan.layout(transport.peer_id)
            missing = [p[-8:] for p in order[1:] if p not in live]
            if missing:
                raise SwarmError(f"peers {missing} of the plan are no longer live: plan again")
            stage_peers: list[tuple[str, Sequence[str]]] = [(transport.peer_id, [])]
            stage_peers += [(p, list(live[p].maddrs)) for p in order[1:]]
            return await PipelineDriver.create(
                transport,
                spec,
                layout,
                stage_peers,
                n_micro_batches=plan.n_micro_batches,
                optimizer=optimizer,
                loss=loss,
                link_ratios=link_ratios,
                plan_version=plan.version,
                timeout=timeout,
                registry=registry,
                expect_dag=plan.dag,
                epoch=epoch,
                job=job,
                initial_state=initial_state,
                in_flight=held,
                ratio_warmup=ratio_warmup,
            )

        driver = self._run(create())
        return Pipeline(self, driver, [live[p] for p, _ in driver.setups[0].peers[1:]], plan=plan)

    def _fixed_pipeline(
        self,
        spec: ModelSpec,
        n_stages: int,
        assignment: Sequence[int] | None,
        **kwargs: Any,
    ) -> Pipeline:
        peers = sorted(self.peers(), key=lambda p: -p.fp32_flops)[: n_stages - 1]
        if len(peers) < n_stages - 1:
            raise SwarmError(f"{n_stages} stages need {n_stages - 1} live peers, the swarm has {len(peers)}")

        async def create() -> PipelineDriver:
            transport = await self._transport()
            stage_peers: list[tuple[str, Sequence[str]]] = [(transport.peer_id, [])] + [
                (p.peer_id, list(p.maddrs)) for p in peers
            ]
            return await PipelineDriver.create(transport, spec, assignment, stage_peers, **kwargs)

        return Pipeline(self, self._run(create()), peers)

    @property
    def multiaddrs(self) -> list[str]:
        """Multiaddrs of live peers: what a new machine passes as ``--initial-peers``."""
        return sorted({m for peer in self.peers() for m in peer.maddrs})

    def close(self) -> None:
        """Leaves the DHT and stops this handle's background thread; idempotent."""
        if self._closed:
            return
        if self._thread is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_end_loop_tasks(self._p2p), self._loop).result(10)
        self._closed = True
        self._dht.shutdown()
        if self._loop is not None:
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
            self._loop.close()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
