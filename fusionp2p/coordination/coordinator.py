"""The coordinator's work: plan a submitted job over the idle peers, publish the plan.

Every peer that stands for election serves ``COORD_PROTOCOL``; only the lease holder
plans (the others answer with who holds the lease). Planning traces the spec fake (no
weights allocated; the same OP-DAG fingerprint on every peer), reads the live records,
keeps the idle peers (a peer busy in a job is left out, unless the request re-plans that
very job for its data owner; excluded peers always are), adds the data owner's own record
and links, runs OP-Fence (or the baseline asked for) and publishes the plan to the DHT,
signed by this peer and stamped with its epoch. One job is planned at a time; a few more
wait their turn, the rest are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from hivemind.utils import get_dht_time

from fusionp2p.coordination.election import LeaseKeeper
from fusionp2p.coordination.protocol import (
    COORD_PROTOCOL,
    MAX_REQUEST_BYTES,
    MAX_UNREAD,
    JobReply,
    JobRequest,
)
from fusionp2p.data_owner import plan_job
from fusionp2p.errors import ConfigError, FusionP2PError, LimitError, ProtocolError, RecordError
from fusionp2p.net.directory import SwarmDirectory, Unread
from fusionp2p.net.directory_view import DirectoryView
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.limits import StreamGate
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import CostConfig, PlanningError, Topology
from fusionp2p.planning.fit import explain_no_fit
from fusionp2p.planning.topology import connected_to
from fusionp2p.records import PeerRecord
from fusionp2p.training.job_spec import compression_policy

__all__ = ["Coordinator"]

logger = logging.getLogger(__name__)

MAX_PLAN_PEERS = 1024  # the fastest idle peers a plan considers (OP-Fence: ~1 s at 1,000)
REPLY_PEERS = 32  # peers a reply names (the plan's always): every pair between them, < 1,000 links
MAX_REPLY_PEERS = 64  # 64 x 63 pairs fit a reply's 4,096 link records
PLAN_TTL = 3600.0  # a plan's records live this long in the DHT
_MAX_WAITING = 4
VIEW_PERIOD = 5.0  # seconds between refreshes of the lease holder's view of the swarm


def _scaled(peer: PeerRecord, speeds: dict[str, float]) -> PeerRecord:
    """``peer`` with its profiled speeds scaled by the data owner's measured factor, if any."""
    factor = speeds.get(peer.peer_id)
    if factor is None:
        return peer
    return replace(peer, flops={k: v * factor for k, v in peer.flops.items()})


class Coordinator:
    """Plans jobs while ``keeper`` holds the lease. Start with ``await Coordinator(...).start()``."""

    def __init__(
        self,
        transport: Transport,
        directory: SwarmDirectory,
        keeper: LeaseKeeper,
        registry: ModelRegistry,
        *,
        timeout: float = 60.0,
        gate: StreamGate | None = None,
    ) -> None:
        self.transport = transport
        self.directory = directory
        self.view = DirectoryView(directory)
        self.keeper = keeper
        self.registry = registry
        self.timeout = timeout
        self._gate = gate
        self._lock = asyncio.Lock()
        self._waiting = 0
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
                await self.view.refresh(Unread())
            except (FusionP2PError, asyncio.TimeoutError, OSError) as e:
                logger.warning("refreshing the coordinator's view failed, will retry: %s", e)

    async def _serve(self, stream: FrameStream) -> None:
        kind, body = await stream.recv(max_payload=MAX_REQUEST_BYTES, timeout=self.timeout)
        if kind is not FrameKind.DATA:
            raise ProtocolError(f"a job request is one DATA frame, got {kind.name}")
        try:
            request = JobRequest.from_json(body, sender=stream.remote)
            reply = await self.submit(request)
        except (ConfigError, PlanningError, LimitError, RecordError) as e:
            logger.info("refused job from %s: %s", stream.remote[-8:], e)
            await stream.send(FrameKind.ERROR, str(e).encode()[:2000], timeout=self.timeout)
            await stream.finish(timeout=1.0)
            return
        await stream.send(FrameKind.DATA, reply.to_json(), timeout=self.timeout)

    def _not_coordinator(self) -> str:
        return f"peer {self.transport.peer_id[-8:]} does not hold the coordinator lease; ask the lease holder"

    async def submit(self, request: JobRequest) -> JobReply:
        """Plans ``request`` and publishes the plan; the reply names its epoch.

        Raises:
            LimitError: not the coordinator, or too many jobs waiting to be planned.
            ConfigError: an unknown family or a bad config.
            PlanningError: too few idle peers, or the model fits nowhere.
        """
        if not self.keeper.holds():
            raise LimitError(self._not_coordinator())
        if self._waiting >= _MAX_WAITING:
            raise LimitError(f"{self._waiting} jobs are waiting to be planned; submit again later")
        self._waiting += 1
        try:
            async with self._lock:
                return await self._plan(request)
        finally:
            self._waiting -= 1

    async def _reusable_job(self, request: JobRequest) -> str:
        """The job a re-plan replaces, if its plan in the DHT names the sender as data owner."""
        if not request.replaces:
            return ""
        plans = await self.directory.fetch_plans(request.replaces)
        if not any(r.data_owner == request.owner.peer_id for records in plans.values() for r in records):
            raise ConfigError(f"job {request.replaces} has no published plan with this data owner")
        return request.replaces

    async def _plan(self, request: JobRequest) -> JobReply:
        owner = request.owner.peer_id
        traced = await asyncio.to_thread(trace_spec, request.spec, self.registry, fake=True)
        unread = Unread()  # directory keys it plans without: the reply says so
        view = await self.view.refresh(unread)
        live = self.view.peers()
        reusable = await self._reusable_job(request)
        excluded = set(request.exclude) | {owner}
        measured = [*self.view.links(), *request.owner_links]
        reached = connected_to(owner, measured)  # a peer nobody measured yet cannot be placed
        idle = [
            _scaled(p, dict(request.speeds))
            for pid, p in live.items()
            if pid not in excluded
            and pid in reached
            and (p.state == "idle" or (reusable and p.job == reusable))
        ]
        idle = sorted(idle, key=lambda p: (-p.fp32_flops, p.peer_id))[:MAX_PLAN_PEERS]
        if not idle:
            raise PlanningError(
                f"no idle peer to run job {request.job} on ({len(live)} live, all busy or not yet measured)"
            )
        # infer the pairs nobody measured from every measured link, then plan on the idle peers
        everyone = {
            **{pid: p for pid, p in live.items() if pid in reached},
            **{p.peer_id: p for p in idle},
            owner: request.owner,
        }
        swarm = await asyncio.to_thread(
            Topology.from_records, list(everyone.values()), [lk for lk in measured if lk.src in everyone]
        )
        candidates = swarm.subset(sorted([owner, *(p.peer_id for p in idle)]))
        cost = CostConfig(
            n_micro_batches=request.n_micro_batches,
            compression=compression_policy(request.compression, request.max_ratio),
        )
        plan = await asyncio.to_thread(
            plan_job, traced.dag, candidates, owner, method=request.method, cost=cost
        )
        if not plan.estimate.fits:
            chosen = [candidates.peer_ids.index(p.peer_id) for p in idle]
            why = explain_no_fit(traced.dag, candidates, cost, chosen)
            raise PlanningError(f"job {request.job} fits in no split over the {len(idle)} idle peers: {why}")
        # the reply: the plan's peers, the data owner, the fastest other idle peers up to a bound,
        # and every pair between them (what anyone re-plans from)
        kept = {owner, *plan.peer_ids}
        if len(kept) > MAX_REPLY_PEERS:
            raise PlanningError(
                f"the {request.method} plan of job {request.job} uses {len(kept) - 1} peers; a plan may "
                f"use at most {MAX_REPLY_PEERS - 1} (OP-Fence stays well below)"
            )
        for p in idle:
            if len(kept) >= REPLY_PEERS:
                break
            kept.add(p.peer_id)
        peers = tuple(everyone[pid] for pid in sorted(kept))
        all_links = tuple(swarm.subset(sorted(kept)).link_records(get_dht_time()))
        if not self.keeper.holds():  # the lease ran out while planning: this plan must not count
            raise LimitError(self._not_coordinator())
        epoch = self.keeper.epoch
        records = plan.to_records(
            plan_id=request.job,
            epoch=epoch,
            made_by=self.transport.peer_id,
            made_at=get_dht_time(),
            data_owner=owner,
        )
        await self.directory.publish_plan(records, get_dht_time() + PLAN_TTL)
        held = await self.directory.fetch_plans(request.job)
        if len(held.get((epoch, self.transport.peer_id), [])) != len(records):
            raise PlanningError(
                f"the DHT did not keep job {request.job}'s plan (epoch {epoch}); submit again"
            )
        logger.info(
            "planned job %s%s for %s (epoch %d): %d stage(s) on %d idle peer(s), %.3f s per iteration%s",
            request.job,
            f" (re-plan of {request.replaces}, without {len(request.exclude)} peer(s))"
            if request.replaces
            else "",
            owner[-8:],
            epoch,
            len(records),
            len(idle),
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
            len(reached),
            view.seconds,
        )
        return JobReply(
            job=request.job,
            epoch=epoch,
            unread=tuple(unread.keys[:MAX_UNREAD]),
            n_stages=len(records),
            coordinator=self.transport.peer_id,
            peers=peers,
            links=all_links,
        )
