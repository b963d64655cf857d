"""The coordinator's work: plan a submitted job over the idle peers, publish the plan.

Every peer that stands for election serves ``COORD_PROTOCOL``; only the lease holder
plans (the others answer with who holds the lease). Planning traces the spec fake (no
weights allocated; the same OP-DAG fingerprint on every peer), reads the live records,
keeps the idle peers (a peer busy in a job is left out, unless the request re-plans that
very job for its data owner; excluded peers always are), adds the data owner's own record
and links, runs OP-Fence (or the baseline asked for) and publishes the plan to the DHT,
signed by this peer and stamped with its epoch. Each request is sized and traced in a
child process within the operator's budget (``trace_budget``); one job is planned at a
time, a few more wait their turn, lightest model first (``queue``), one per data owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace

from hivemind.utils import get_dht_time

from fusionp2p.config import DEFAULT_TIMEOUTS, TraceBudget
from fusionp2p.coordination.election import LeaseKeeper
from fusionp2p.coordination.queue import PlanningQueue
from fusionp2p.coordination.trace_budget import TraceJob, warm_up
from fusionp2p.errors import ConfigError, FusionP2PError, LimitError, ProtocolError
from fusionp2p.net.directory import SwarmDirectory, Unread
from fusionp2p.net.directory_view import DirectoryView, ViewState
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.limits import StreamGate
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning import (
    CostConfig,
    Plan,
    PlanningError,
    Topology,
    compression_policy,
    plan_job,
    vouched_links,
)
from fusionp2p.planning.fit import explain_no_fit
from fusionp2p.planning.replicated_plan import ReplicatedPlan, plan_replicated_job, replicas_request
from fusionp2p.planning.topology import connected_to
from fusionp2p.records import COORD_PROTOCOL, LinkRecord, PeerRecord, PlanStageRecord, in_job
from fusionp2p.records.coordinator import MAX_UNREAD, JobReply, JobRequest

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)

MAX_REPLY_PEERS = 64  # peers a reply names: 64 x 63 pairs fit its 4,096 link records
# the fastest idle peers a plan considers: all of them go into the reply, with every pair,
# so the data owner can plan them again itself (training.verify)
MAX_PLAN_PEERS = MAX_REPLY_PEERS - 1
PLAN_TTL = 3600.0  # a plan's records live this long in the DHT
_MAX_WAITING = 4  # requests waiting for their turn (lightest first)
_MAX_IN_FLIGHT = 8  # requests being sized, waiting or planned, one per data owner
VIEW_PERIOD = 5.0  # seconds between refreshes of the lease holder's view of the swarm


def _scaled(peer: PeerRecord, speeds: dict[str, float]) -> PeerRecord:
    """``peer`` with its profiled speeds scaled by the data owner's measured factor, if any."""
    factor = speeds.get(peer.peer_id)
    if factor is None:
        return peer
    return replace(peer, flops={k: v * factor for k, v in peer.flops.items()})


@dataclass(frozen=True)
class _Candidates:
    """What a job is planned over: the idle peers it may use, and the swarm they sit in."""

    idle: list[PeerRecord]  # fastest first, speeds scaled as the request asks
    everyone: dict[str, PeerRecord]  # every reachable live peer, the idle ones, the data owner
    measured: list[LinkRecord]  # every link known, the data owner's included
    reached: set[str]  # peers some measured link connects to the data owner


class Coordinator:
    """Plans jobs while ``keeper`` holds the lease. Start with ``await Coordinator(...).start()``."""

    def __init__(
        self,
        transport: Transport,
        directory: SwarmDirectory,
        keeper: LeaseKeeper,
        registry: ModelRegistry,
        *,
        timeout: float = DEFAULT_TIMEOUTS.serve,
        gate: StreamGate | None = None,
        budget: TraceBudget | None = None,
    ) -> None:
        self.transport = transport
        self.directory = directory
        self.view = DirectoryView(directory)
        self.keeper = keeper
        self.registry = registry
        self.timeout = timeout
        self._gate = gate
        self.budget = budget or TraceBudget()
        self._queue = PlanningQueue(_MAX_WAITING)
        self._waiting: set[str] = set()  # data owners with a request being sized, queued or planned
        self._viewing: asyncio.Task[None] | None = None

    async def start(self) -> Coordinator:
        await self.transport.serve(COORD_PROTOCOL, self._serve, gate=self._gate)
        self._viewing = asyncio.create_task(self._keep_view(), name="coordinator-view")
        return self

    async def aclose(self) -> None:
        if self._viewing is not None:
            self._viewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._viewing
        await self.transport.stop_serving(COORD_PROTOCOL)

    async def _keep_view(self) -> None:
        """While this peer holds the lease, keeps its view of the swarm fresh, a few link
        reads at a time, so planning reads only what fell due since."""
        while True:
            await asyncio.sleep(VIEW_PERIOD)
            if not self.keeper.holds():
                continue
            try:
                await asyncio.to_thread(warm_up)  # the lease holder traces requests: its fork server, once
                await self.view.refresh(Unread())
            except (TimeoutError, FusionP2PError, OSError) as e:
                logger.warning("refreshing the coordinator's view failed, will retry: %s", e)

    async def _serve(self, stream: FrameStream) -> None:
        kind, body = await stream.recv(max_payload=JobRequest.MAX_BYTES, timeout=self.timeout)
        if kind is not FrameKind.DATA:
            raise ProtocolError(f"a job request is one DATA frame, got {kind.name}")
        try:
            request = JobRequest.from_wire(body)
            request.check_sender(stream.remote)
            reply = await self.submit(request)
        except Exception as e:  # every refusal gets its reason: a trace may fail any way
            if not isinstance(e, FusionP2PError):
                logger.warning("planning a job of %s failed: %s: %s", stream.remote[-8:], type(e).__name__, e)
                e = PlanningError(f"planning failed: {type(e).__name__}: {str(e)[:300]}")
            logger.info("refused job from %s: %s", stream.remote[-8:], e)
            await stream.send(FrameKind.ERROR, str(e).encode()[:2000], timeout=self.timeout)
            await stream.finish(timeout=DEFAULT_TIMEOUTS.courtesy)
            return
        await stream.send(FrameKind.DATA, reply.to_wire(), timeout=self.timeout)

    def _not_coordinator(self) -> str:
        return f"peer {self.transport.peer_id[-8:]} does not hold the coordinator lease; ask the lease holder"

    async def submit(self, request: JobRequest) -> JobReply:
        """Plans ``request`` and publishes the plan; the reply names its epoch.

        Raises:
            LimitError: not the coordinator, this data owner has a request waiting already
                (one slot per identity), or too many jobs are waiting to be planned.
            ConfigError: an unknown family or a bad config.
            PlanningError: too few idle peers, or the model fits nowhere.
        """
        if not self.keeper.holds():
            raise LimitError(self._not_coordinator())
        owner = request.owner.peer_id
        if owner in self._waiting:
            raise LimitError("this data owner has a job waiting to be planned already: one at a time")
        if len(self._waiting) >= _MAX_IN_FLIGHT:
            raise LimitError(f"{len(self._waiting)} jobs are being sized or planned; submit again later")
        self._waiting.add(owner)
        job: TraceJob | None = None
        try:
            job = await TraceJob.start(request.spec, self.registry, self.budget)
            async with self._queue.turn(job.model_bytes):
                return await self._plan(request, job)
        finally:
            if job is not None:
                job.close()
            self._waiting.discard(owner)

    async def _reusable_job(self, request: JobRequest) -> str:
        """The job a re-plan replaces, if its plan in the DHT names the sender as data owner."""
        if not request.replaces:
            return ""
        plans = await self._plans_of(request.replaces)
        if not any(r.data_owner == request.owner.peer_id for r in plans):
            raise ConfigError(f"job {request.replaces} has no published plan with this data owner")
        return request.replaces

    async def _plans_of(self, job: str) -> list[PlanStageRecord]:
        """Every published plan record of ``job`` and of its replicas."""
        plans = await self.directory.fetch_all_plans()
        return [r for (plan_id, _, _), records in plans.items() if in_job(plan_id, job) for r in records]

    async def _candidates(self, request: JobRequest, unread: Unread) -> tuple[_Candidates, ViewState]:
        """The idle peers ``request`` may be planned on: live, measured from the data owner's
        side, not excluded, and idle (or in the very job a re-plan replaces)."""
        owner = request.owner.peer_id
        view = await self.view.refresh(unread)
        live = self.view.peers()
        reusable = await self._reusable_job(request)
        excluded = set(request.exclude) | {owner}
        # links count once both ends vouch for them: the data owner's (its job) and this peer's own as sent
        measured = vouched_links(
            [*self.view.links(), *request.owner_links], trusted={owner, self.transport.peer_id}
        )
        reached = connected_to(owner, measured)  # a peer nobody measured yet cannot be placed
        idle = [
            _scaled(p, dict(request.speeds))
            for pid, p in live.items()
            if pid not in excluded
            and pid in reached
            and (not request.only or pid in request.only)
            and (p.state == "idle" or (reusable and in_job(p.job, reusable)))
        ]
        idle = sorted(idle, key=lambda p: (-p.fp32_flops, p.peer_id))[:MAX_PLAN_PEERS]
        if not idle:
            raise PlanningError(
                f"no idle peer to run job {request.job} on ({len(live)} live, all busy or not yet measured)"
            )
        everyone = {
            **{pid: p for pid, p in live.items() if pid in reached},
            **{p.peer_id: p for p in idle},
            owner: request.owner,
        }
        return _Candidates(idle, everyone, measured, reached), view

    @staticmethod
    def _plan_over(
        request: JobRequest, dag: OpDag, found: _Candidates, cost: CostConfig
    ) -> tuple[Plan | ReplicatedPlan, list[PeerRecord], list[LinkRecord]]:
        """The plan (the method the request asks for; with replicas, ``plan_replicated_job``)
        over the idle peers, and the records it was made from: the candidates' and every
        pair between them, measured or inferred from every measured link. It is planned on
        exactly those records, so the data owner gets the same plan from the reply
        (``training.verify``).

        Raises:
            PlanningError: the model fits in no split, or the replicas asked for do not fit.
        """
        owner = request.owner.peer_id
        everyone = found.everyone
        swarm = Topology.from_records(
            list(everyone.values()), [lk for lk in found.measured if lk.src in everyone]
        )
        ids = sorted([owner, *(p.peer_id for p in found.idle)])
        peers = [everyone[pid] for pid in ids]
        links = swarm.subset(ids).link_records(get_dht_time())
        candidates = Topology.from_records(peers, links)
        began = time.perf_counter()
        if request.replicas != 1:
            replicated = plan_replicated_job(
                dag, candidates, owner, replicas=replicas_request(request.replicas), cost=cost
            )
            logger.info(
                "planned %s with %d replica(s) of %d stage(s) on %d peer(s) in %.2f s, %.3f s per step "
                "(estimate, averaging included)",
                dag.name,
                replicated.replicas,
                len(replicated.plans[0].stages),
                len(candidates) - 1,
                time.perf_counter() - began,
                replicated.expected_s,
            )
            return replicated, peers, links
        plan = plan_job(dag, candidates, owner, method=request.method, cost=cost)
        logger.info(
            "planned %s with %s on %d peer(s) in %.2f s: %d stage(s), %.3f s per iteration (estimate)",
            dag.name,
            request.method,
            len(candidates) - 1,
            time.perf_counter() - began,
            len(plan.stages),
            plan.expected_s,
        )
        if not plan.estimate.fits:
            chosen = [candidates.peer_ids.index(p.peer_id) for p in found.idle]
            why = explain_no_fit(dag, candidates, cost, chosen)
            raise PlanningError(
                f"job {request.job} fits in no split over the {len(found.idle)} idle peers: {why}"
            )
        return plan, peers, links

    async def _publish(self, request: JobRequest, plan: Plan | ReplicatedPlan) -> int:
        """Publishes ``plan`` (every replica's, each under its own job id) signed and stamped
        with this peer's epoch; the epoch.

        Raises:
            LimitError: the lease ran out while planning (this plan must not count).
            PlanningError: the DHT did not keep the plan.
        """
        if not self.keeper.holds():
            raise LimitError(self._not_coordinator())
        epoch, me = self.keeper.epoch, self.transport.peer_id
        made_at, owner = get_dht_time(), request.owner.peer_id
        if isinstance(plan, ReplicatedPlan):
            records = plan.to_records(
                job=request.job, epoch=epoch, made_by=me, made_at=made_at, data_owner=owner
            )
        else:
            records = plan.to_records(
                plan_id=request.job, epoch=epoch, made_by=me, made_at=made_at, data_owner=owner
            )
        await self.directory.publish_plan(records, get_dht_time() + PLAN_TTL)
        held = await self.directory.fetch_all_plans()
        kept = sum(len(held.get((job, epoch, me), [])) for job in {r.plan_id for r in records})
        if kept != len(records):
            raise PlanningError(
                f"the DHT did not keep job {request.job}'s plan (epoch {epoch}); submit again"
            )
        return epoch

    async def _check_job_id(self, request: JobRequest) -> None:
        """A job id, and its replicas' ids, belong to the data owner it was first planned for.

        Raises:
            ConfigError: a plan of this id or of its replicas names another data owner.
        """
        owners = {r.data_owner for r in await self._plans_of(request.job)}
        if owners - {request.owner.peer_id}:
            raise ConfigError(f"job id {request.job} belongs to another data owner; submit under another id")

    async def _plan(self, request: JobRequest, job: TraceJob) -> JobReply:
        owner = request.owner.peer_id
        await self._check_job_id(request)
        dag = await job.trace()
        unread = Unread()  # directory keys it plans without: the reply says so
        found, view = await self._candidates(request, unread)
        cost = CostConfig(
            n_micro_batches=request.n_micro_batches,
            compression=compression_policy(request.compression, request.max_ratio),
            averaging=request.averaging,
        )
        plan, peers, links = await asyncio.to_thread(self._plan_over, request, dag, found, cost)
        epoch = await self._publish(request, plan)
        replicas = plan.plans if isinstance(plan, ReplicatedPlan) else (plan,)
        logger.info(
            "planned job %s%s for %s (epoch %d): %d replica(s) of %d stage(s) on %d idle peer(s), "
            "%.3f s per step%s",
            request.job,
            f" (re-plan of {request.replaces}, without {len(request.exclude)} peer(s))"
            if request.replaces
            else "",
            owner[-8:],
            epoch,
            len(replicas),
            len(replicas[0].stages),
            len(found.idle),
            plan.expected_s,
            f", without {len(unread.keys)} unreadable directory key(s)" if unread.keys else "",
        )
        logger.info(
            "view of the swarm: %d live peers, %d measured links (%d sources read now, %d peers without "
            "links read, oldest read %.0f s ago), %d reachable, read in %.2f s",
            view.peers,
            view.links,
            view.link_reads,
            view.without_links,
            view.oldest_read_s,
            len(found.reached),
            view.seconds,
        )
        return JobReply(
            job=request.job,
            epoch=epoch,
            n_stages=len(replicas[0].stages),
            coordinator=self.transport.peer_id,
            peers=tuple(peers),
            links=tuple(links),
            unread=tuple(unread.keys[:MAX_UNREAD]),
            replicas=len(replicas),
        )
