"""A data owner submits a job: wait for peers, find the coordinator, get the signed plan.

The data owner measures itself and its links to the idle peers (only it can), sends the
coordinator a ``JobRequest``, and on success reads the plan back from the DHT: it counts
only if the lease holder signed it in the epoch in force. The plan is rebuilt here over
the records the coordinator planned on (the reply carries them), so its estimate is the
coordinator's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.coordination.election import LeaseJudge, find_coordinator, read_lease
from fusionp2p.errors import CoordinatorError, PeerUnreachableError, RecordError, SwarmError
from fusionp2p.net.directory import SwarmDirectory, Unread
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.trace import TracedModel, trace_spec
from fusionp2p.planning import CostConfig, Plan, Topology, compression_policy
from fusionp2p.planning.replicated_plan import ReplicatedPlan
from fusionp2p.records import COORD_PROTOCOL, JobReply, JobRequest, LeaseRecord, PeerRecord, replica_job
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.owner_records import probe_from, self_record
from fusionp2p.training.verify import PlanRefused, check_reply_records, verified_plan, verified_replicas

__all__ = ["SubmittedJob", "new_run_id", "plan_job_id", "submit_job", "wait_for_peers"]

logger = logging.getLogger(__name__)

MAX_PROBED_PEERS = 16


@dataclass(frozen=True)
class SubmittedJob:
    """A planned job: its run id, the coordinator's plan and what it was planned on."""

    run_id: str  # the job's id on the wire: the JobSpec's name and a random suffix
    plan: Plan
    reply: JobReply
    topology: Topology
    traced: TracedModel  # the fake trace the plan was checked against
    data_owner: str  # this process's PeerID: the plan's data owner
    cost: CostConfig  # what the plan's estimate assumed
    replicated: ReplicatedPlan | None = None  # a job with replicas: every replica (``plan`` is replica 0)

    @property
    def replicas(self) -> tuple[Plan, ...]:
        """Every replica's plan (one without replicas)."""
        return self.replicated.plans if self.replicated is not None else (self.plan,)

    @property
    def expected_s(self) -> float:
        """What a step is expected to take (with replicas: the slowest replica's and averaging)."""
        return self.replicated.expected_s if self.replicated is not None else self.plan.expected_s

    @property
    def epoch(self) -> int:
        return self.reply.epoch

    def facts(self) -> dict[str, Any]:
        """What a run's ``planned`` event records of the plan."""
        plan = self.plan
        return {
            "epoch": self.epoch,
            "coordinator": self.reply.coordinator,
            "method": plan.method,
            "estimate_s": self.expected_s,
            "replicas": len(self.replicas),
            "stage_compute_estimate_s": [  # what a stage reports: its compute and its Top-K coding
                round((c + k) * plan.n_micro_batches, 4)
                for c, k in zip(plan.estimate.compute_s, plan.estimate.codec_s, strict=True)
            ],
            "ratios": sorted({round(r, 2) for r in plan.ratios.values()}),
        }


def new_run_id(name: str) -> str:
    """A fresh run id for a job named ``name``: the name and a random suffix (room is left
    for ``plan_job_id``'s plan-version suffix within the 64-character name limit)."""
    return f"{name[:48]}-{uuid.uuid4().hex[:6]}"


def plan_job_id(run_id: str, version: int) -> str:
    """The wire id of plan ``version`` of run ``run_id``: every re-plan is a new job on the
    peers (its own setup, plan records and OpData), the run and its files stay one."""
    return run_id if version == 1 else f"{run_id}-p{version}"


async def wait_for_peers(
    directory: SwarmDirectory, n: int, timeout: float, *, only: Collection[str] = ()
) -> list[PeerRecord]:
    """The idle peers (of ``only``, if given) once there are at least ``n`` (fastest first).

    Raises:
        SwarmError: fewer than ``n`` idle peers after ``timeout`` s; the message says how many.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        peers = await directory.fetch_peers(unread=Unread())  # a shard that timed out: count the rest
        idle = sorted(
            (p for p in peers.values() if p.state == "idle" and (not only or p.peer_id in only)),
            key=lambda p: -p.fp32_flops,
        )
        if len(idle) >= n:
            return idle
        if loop.time() >= deadline:
            hint = (
                f"; no peer of swarm {directory.swarm!r} is live at all: peers of other swarms are "
                "invisible, so check the swarm name (--swarm) and --initial-peers"
                if not peers
                else ""
            )
            raise SwarmError(
                f"too few peers: the job needs {n} idle peer(s), the swarm has {len(idle)} "
                f"({len(peers)} live) after {timeout:.0f} s{hint}"
            )
        await asyncio.sleep(1.0)


async def submit_job(
    transport: Transport,
    directory: SwarmDirectory,
    job: JobSpec,
    *,
    registry: ModelRegistry | None = None,
    timeout: float = DEFAULT_TIMEOUTS.request,
    run_id: str | None = None,
    replaces: str = "",
    exclude: tuple[str, ...] = (),
    speeds: tuple[tuple[str, float], ...] = (),
    site: str = "",
) -> SubmittedJob:
    """Submits ``job`` to the swarm's coordinator and returns the plan it published.

    ``run_id`` is the job's id on the wire (default: its name and a random suffix). A
    re-plan of a running job names that job's wire id in ``replaces``: it does not wait for
    ``min_peers`` idle peers, may reuse the job's own stage owners, leaves out the peers in
    ``exclude`` and scales peers' speeds by the measured ``speeds`` factors. ``site`` is
    the data owner's declared data centre (``PeerRecord.site``).

    Raises:
        ConfigError: the job's model family or config is refused here.
        SwarmError: too few idle peers within the job's ``wait_peers_s``.
        PeerUnreachableError: the lease holder could not be reached, and no other took the
            lease within ``wait_peers_s``.
        CoordinatorError: no coordinator, it refused the job (its reason is in the
            message), its plan is not in the DHT under the epoch in force, or it was not
            the plan this data owner makes of the records the coordinator cites
            (``training.verify``) and no other peer took the lease within the job's
            ``wait_peers_s``: a coordinator caught twice is never asked again (nor given
            a stage) by this submission, which waits for the next lease holder instead.
            (Once is not enough: an honest coordinator's view can be seconds older than
            the links this data owner checks it against, and a loopback or busy link's
            re-measurement has been seen to move 8x and more in between.)
    """
    spec = job.model_spec()
    registry = registry or ModelRegistry.for_data_owner(spec.family)
    traced = await asyncio.to_thread(trace_spec, spec, registry, fake=True)
    if replaces:
        live = await directory.fetch_peers(unread=Unread())  # the coordinator reads for itself
        peers = sorted(
            (p for p in live.values() if p.state == "idle" or p.job == replaces), key=lambda p: -p.fp32_flops
        )
    else:
        peers = await wait_for_peers(directory, job.min_peers, job.wait_peers_s, only=job.stage_peers)
    judge = LeaseJudge(allowed=frozenset(job.coordinators))
    me = await asyncio.to_thread(self_record, transport.peer_id, site=site, max_memory=job.max_memory_bytes)
    attempt = _Attempt(transport, directory, job, traced, judge, me, run_id or new_run_id(job.name), timeout)
    caught: dict[str, PlanRefused] = {}  # coordinators whose reply this data owner refused twice
    refused: set[str] = set()  # ... and once
    loop = asyncio.get_running_loop()
    patience = loop.time() + max(job.wait_peers_s, 1.0)
    while True:
        lease = await find_coordinator(directory, timeout=max(job.wait_peers_s, 1.0), judge=judge)
        if lease.holder in caught:
            if loop.time() >= patience:
                raise CoordinatorError(
                    f"{caught[lease.holder]}; no other peer took the lease within {job.wait_peers_s:.0f} s"
                )
            await asyncio.sleep(1.0)
            continue
        candidates = [
            p
            for p in peers
            if p.peer_id != transport.peer_id
            and p.peer_id not in exclude
            and p.peer_id not in caught
            and (not job.stage_peers or p.peer_id in job.stage_peers)
        ]
        try:
            return await attempt.ask(lease, candidates, replaces, (*exclude, *caught), speeds)
        except PeerUnreachableError as e:  # it died or left while planning: its successor plans
            if loop.time() >= patience:
                raise
            logger.warning(
                "the coordinator %s is unreachable (%s); waiting for the lease holder", lease.holder[-8:], e
            )
            await asyncio.sleep(1.0)
        except PlanRefused as e:
            if lease.holder not in refused:
                refused.add(lease.holder)
                logger.warning("%s; asking it once more, on the swarm as it is now", e)
                continue
            caught[lease.holder] = e
            logger.warning(
                "%s; job %s waits up to %.0f s for another peer to hold the coordinator lease",
                e,
                attempt.run_id,
                patience - loop.time(),
            )


@dataclass(frozen=True)
class _Attempt:
    """One job's submission to one coordinator after another (``submit_job``)."""

    transport: Transport
    directory: SwarmDirectory
    job: JobSpec
    traced: TracedModel
    judge: LeaseJudge
    me: PeerRecord
    run_id: str
    timeout: float

    async def ask(
        self,
        lease: LeaseRecord,
        candidates: list[PeerRecord],
        replaces: str,
        exclude: tuple[str, ...],
        speeds: tuple[tuple[str, float], ...],
    ) -> SubmittedJob:
        """The plan ``lease``'s holder makes of this job, checked.

        Raises:
            PlanRefused: it is not the plan the swarm's records make (``training.verify``).
            CoordinatorError: anything else went wrong with this coordinator.
        """
        job, transport, directory = self.job, self.transport, self.directory
        links = await probe_from(transport, candidates[:MAX_PROBED_PEERS])
        request = JobRequest(
            job=self.run_id,
            spec=job.model_spec(),
            n_micro_batches=job.n_micro_batches,
            compression=job.compression,
            method=job.plan_method,
            owner=self.me,
            owner_links=tuple(links),
            replaces=replaces,
            exclude=exclude,
            speeds=speeds,
            max_ratio=job.max_ratio,
            only=job.stage_peers,
            replicas=job.replicas_wire,
            averaging=job.averaging,
        )
        reply = await _ask(transport, lease, request, self.timeout)
        if reply.unread:
            logger.warning(
                "the coordinator planned job %s without %d directory key(s) it could not read in time "
                "(their peers and links are unknown to the plan): %s",
                self.run_id,
                len(reply.unread),
                ", ".join(reply.unread[:5]),
            )
        now_lease = await read_lease(directory, self.judge)
        if now_lease is None or (now_lease.epoch, now_lease.holder) != (reply.epoch, reply.coordinator):
            raise CoordinatorError(f"the coordinator changed while planning job {job.name}; submit it again")
        published = await directory.fetch_all_plans()
        ids = [replica_job(self.run_id, k, reply.replicas) for k in range(reply.replicas)]
        replicas = [published.get((i, reply.epoch, reply.coordinator), []) for i in ids]
        if not all(replicas):
            raise CoordinatorError(f"job {self.run_id}'s plan (epoch {reply.epoch}) is not in the DHT")
        cited = [p.peer_id for p in reply.peers if p.peer_id != transport.peer_id]
        drifted = check_reply_records(
            reply,
            request,
            await directory.fetch_peers(unread=Unread()),
            await directory.fetch_links(cited, unread=Unread()),
            [lk.dst for lk in links],
        )
        policy = compression_policy(job.compression, job.max_ratio)
        cost = CostConfig(n_micro_batches=job.n_micro_batches, compression=policy, averaging=job.averaging)
        dag = self.traced.dag
        if request.replicas == 1:
            if reply.replicas != 1:
                raise PlanRefused(
                    f"the coordinator {reply.coordinator[-8:]} planned replicas nobody asked for"
                )
            plan, topo = await asyncio.to_thread(
                verified_plan, replicas[0], dag, reply, request, cost, drifted
            )
            return SubmittedJob(self.run_id, plan, reply, topo, self.traced, transport.peer_id, cost)
        replicated, topo = await asyncio.to_thread(
            verified_replicas, replicas, dag, reply, request, cost, drifted
        )
        plan = replicated.plans[0]
        return SubmittedJob(self.run_id, plan, reply, topo, self.traced, transport.peer_id, cost, replicated)


async def _ask(transport: Transport, lease: LeaseRecord, request: JobRequest, timeout: float) -> JobReply:
    """The coordinator's reply to ``request``.

    Raises:
        CoordinatorError: it refused the job (its reason is in the message) or answered
            something else than a reply.
    """
    holder = lease.holder
    logger.info("submitting job %s to coordinator %s (epoch %d)", request.job, holder[-8:], lease.epoch)
    if lease.maddrs:
        await transport.connect(holder, lease.maddrs, timeout=timeout)
    stream = await transport.open(holder, COORD_PROTOCOL, timeout=timeout)
    try:
        await stream.send(FrameKind.DATA, request.to_wire(), timeout=timeout)
        kind, body = await stream.recv(max_payload=JobReply.MAX_BYTES, timeout=timeout)
    finally:
        await stream.close()
    if kind is FrameKind.ERROR:
        reason = bytes(body).decode("utf-8", "replace")[:500]
        raise CoordinatorError(f"the coordinator {holder[-8:]} refused job {request.job}: {reason}")
    if kind is not FrameKind.DATA:
        raise CoordinatorError(f"the coordinator {holder[-8:]} answered with a {kind.name} frame")
    try:
        return JobReply.from_wire(body)
    except RecordError as e:
        raise CoordinatorError(f"the coordinator {holder[-8:]} sent a malformed reply: {e}") from e
