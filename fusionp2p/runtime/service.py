"""Serves stages of jobs on the exec protocol: who may ask what, how much, and the compute queue.

Who may send what is decided by ``runtime.admission`` from the stream's authenticated
PeerID, before a body is read.

Every message is read in three steps, so nothing is buffered before it is allowed: the
frame header (length against the largest message this peer could accept now), the
message header (who, what, which edge), then the body, whose bytes are first reserved
in an ``InboundBudget``. Anything over a limit gets an ERROR reply naming it and the
stream is closed; a refused but well-framed request gets its ERROR and the stream lives
on. An OpData is acknowledged only after every check, duplicates included; it is then
queued (bounded) for the single compute thread, never computed while its sender waits,
so two stages sending to each other cannot deadlock. A setup that follows a coordinator's
published plan (a nonzero epoch) is first checked against the DHT by ``plan_check``, which
a peer also asks about an unplanned one (epoch 0): a swarm with a coordinator runs plans.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from fusionp2p.config import DEFAULT_TIMEOUTS, format_bytes
from fusionp2p.errors import FusionP2PError, LimitError, PeerUnreachableError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.limits import InboundBudget, RejectionLog, Reservation, StreamGate
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.records import (
    CREDIT,
    EXEC_PROTOCOL,
    FETCHABLE,
    FINGERPRINT,
    MAX_RECORD_BYTES,
    STEP_REPLY,
    ExecControl,
    ExecHeader,
    JobSetup,
    LocalWeights,
    OpData,
    ReplicaGroup,
    ShardRequest,
    pack_message,
)
from fusionp2p.runtime.admission import (
    ServicePolicy,
    admit_control,
    admit_opdata,
    admit_setup,
    check_setup,
    find_job,
)
from fusionp2p.runtime.averaging import GradientAverager, parameter_fingerprint
from fusionp2p.runtime.codec import ExecClient, read_message_header, unpack_message
from fusionp2p.runtime.compute import ComputeQueue
from fusionp2p.runtime.engines import ENGINES, BuildStage
from fusionp2p.runtime.executor import Executor, Message
from fusionp2p.runtime.jobs import Job, Work, opdata_key
from fusionp2p.runtime.local_weights import load_local_weights
from fusionp2p.runtime.shard_store import ShardStore
from fusionp2p.runtime.shards import ShardKeeper
from fusionp2p.runtime.throttle import Throttle

__all__ = ["ExecutorService", "ServicePolicy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
PlanCheck = Callable[[JobSetup, str], Awaitable[None]]  # (setup, sender) -> None, or ProtocolError
# (setup, its owner, the built executor) -> the stage's averager (blocking: it starts a process)
Averagers = Callable[[JobSetup, str, Executor], GradientAverager]
_REAP_PERIOD = 5.0
_LEAVING_NOTICE_S = 3.0  # how long a leaving peer waits for a job owner to hear it


class ExecutorService:
    """Serves jobs' stages on ``transport``. Create with ``await ExecutorService(...).start()``."""

    def __init__(
        self,
        transport: Transport,
        policy: ServicePolicy | None = None,
        *,
        registry: ModelRegistry | None = None,
        engines: Mapping[str, BuildStage] = ENGINES,
        gate: StreamGate | None = None,
        plan_check: PlanCheck | None = None,
        on_jobs_changed: Callable[[], None] | None = None,
        averagers: Averagers | None = None,
    ) -> None:
        self.transport = transport
        self.policy = policy or ServicePolicy()
        self.registry = registry or ModelRegistry(entry_points=False)
        self.jobs: dict[str, Job] = {}
        self.rejected = 0  # messages refused with an ERROR reply
        limits = self.policy.limits
        self._engines = dict(engines)
        self._gate = gate or StreamGate(per_peer=limits.streams_per_peer, total=limits.streams_total)
        self._budget = InboundBudget(total=limits.inbound_bytes, per_peer=limits.inbound_bytes_per_peer)
        depth = limits.inbox_depth * self.policy.max_jobs
        self.compute = ComputeQueue(
            transport, depth=depth, timeout=self.policy.timeout, throttle=Throttle(self.policy.emulated_speed)
        )
        self._setting_up: dict[str, str] = {}  # job -> its data owner, while it is set up
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = RejectionLog(logger, "protocol error: rejected exec message")
        self._plan_check = plan_check
        self._on_jobs_changed = on_jobs_changed
        self._averagers = averagers
        store = ShardStore(self.policy.shard_dir) if self.policy.shard_dir else None
        self.shards = ShardKeeper(transport, store, limits, self.policy.timeout, self.in_pool)

    async def start(self) -> ExecutorService:
        self._gate.privileged = self._works_for_a_job
        await self.transport.serve(EXEC_PROTOCOL, self._serve_stream, gate=self._gate)
        for coro, name in ((self.compute.run(), "exec-compute"), (self._reap(), "exec-reaper")):
            task = asyncio.create_task(coro, name=f"fusionp2p.{name}")
            self._tasks.add(task)
        return self

    async def aclose(self) -> None:
        """Stops serving, tells the owners of the jobs it runs a stage of that it is
        leaving, ends every job's senders and the compute thread."""
        await self.transport.stop_serving(EXEC_PROTOCOL)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._say_leaving()
        for job in list(self.jobs.values()):
            await self._drop(job, "this peer is shutting down")
        self.compute.shutdown()

    async def _say_leaving(self) -> None:
        """Each job's owner learns now, not at its step deadline, that this stage is gone."""
        me = self.transport.peer_id

        async def tell(job: Job) -> None:
            client = ExecClient(
                self.transport, job.owner, timeout=min(self.policy.timeout, _LEAVING_NOTICE_S)
            )
            try:
                await client.request(ExecControl(command="leaving", job=job.name))
            except FusionP2PError as e:
                logger.info("could not tell %s that this peer leaves job %s: %s", job.owner[-8:], job.name, e)
            finally:
                await client.aclose()

        await asyncio.gather(*(tell(job) for job in self.jobs.values() if job.owner != me))

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the compute thread (the one every executor's work runs on)."""
        return await self.compute.in_pool(fn)

    # ------------------------------------------------------------ reading one message
    def _max_frame(self) -> int:
        largest = max(
            [
                self.policy.limits.control_bytes,
                self.policy.limits.setup_bytes,
                ShardRequest.MAX_BYTES,
                *(j.max_body for j in self.jobs.values()),
            ]
        )
        return 2 + MAX_RECORD_BYTES + largest

    async def _refuse(self, stream: FrameStream, reason: str, detail: str, *, close: bool) -> None:
        self.rejected += 1
        self._log.reject(reason, f"from {stream.remote}: {detail}" + (" (stream closed)" if close else ""))
        with contextlib.suppress(FusionP2PError):
            await stream.send(
                FrameKind.ERROR, f"{reason}: {detail}".encode()[:2000], timeout=DEFAULT_TIMEOUTS.courtesy
            )
        if close:
            await stream.finish(timeout=self.policy.limits.stall_timeout / 10)

    async def _serve_stream(self, stream: FrameStream) -> None:
        limits = self.policy.limits
        stall = limits.stall_timeout
        while True:
            try:
                kind, length = await stream.recv_header(timeout=limits.idle_timeout)
                if kind is FrameKind.END:
                    return
                if kind is not FrameKind.DATA:
                    raise ProtocolError(f"expected a DATA frame, got {kind.name}")
                if length > self._max_frame():
                    return await self._refuse(
                        stream, "oversized frame", f"{length} bytes > limit {self._max_frame()}", close=True
                    )
                if length <= limits.control_bytes:  # small: one read (the limit allowed this much anyway)
                    header, prefetched = unpack_message(
                        await stream.recv_exactly(
                            length, stall_timeout=stall, min_rate=limits.min_inbound_rate
                        )
                    )
                else:
                    header, prefetched = await read_message_header(stream, length, stall_timeout=stall), None
            except PeerUnreachableError:
                return  # gone, stalled, or idle past the limit
            except ProtocolError as e:
                return await self._refuse(stream, "malformed", str(e), close=True)
            try:
                limit = self._admit(stream.remote, header)
            except Exception as e:  # FusionP2PError as designed; anything else is a header we did not foresee
                if not isinstance(e, FusionP2PError):
                    e = ProtocolError(f"cannot check this {header.KIND}: {type(e).__name__}: {e}")
                if prefetched is None and header.body_bytes > limits.control_bytes:
                    return await self._refuse(stream, "refused", str(e), close=True)
                with contextlib.suppress(PeerUnreachableError):
                    if prefetched is None:
                        await stream.skip(header.body_bytes, stall_timeout=stall)
                    await self._refuse(stream, "refused", str(e), close=False)
                    continue
                return
            if header.body_bytes > limit:
                detail = f"{header.KIND} body of {header.body_bytes} bytes > limit {limit}"
                return await self._refuse(stream, "oversized body", detail, close=True)
            try:
                reservation = await self._budget.reserve(stream.remote, header.body_bytes, timeout=stall)
            except LimitError as e:
                return await self._refuse(stream, "over budget", str(e), close=True)
            try:
                body = (
                    prefetched
                    if prefetched is not None
                    else await stream.recv_exactly(
                        header.body_bytes, stall_timeout=stall, min_rate=limits.min_inbound_rate
                    )
                )
            except PeerUnreachableError:
                reservation.release()
                return
            try:
                if isinstance(header, OpData):
                    await self._take_opdata(stream.remote, header, body, reservation)
                    reply_kind, reply = FrameKind.ACK, CREDIT.pack(self._budget.free_for(stream.remote))
                else:
                    try:
                        reply_kind, reply = await self._control(stream.remote, header, body)
                    finally:
                        reservation.release()
            except FusionP2PError as e:
                reservation.release()
                await self._refuse(stream, "refused", str(e), close=False)
                continue
            except Exception as e:  # a bug, not the sender's fault: say so, keep serving
                reservation.release()
                logger.warning(
                    "exec %s from %s failed: %s: %s", header.KIND, stream.remote, type(e).__name__, e
                )
                await self._refuse(stream, "failed", f"{type(e).__name__}: {e}", close=False)
                continue
            try:
                await stream.send(reply_kind, reply, timeout=self.policy.timeout)
            except PeerUnreachableError:
                return

    def _works_for_a_job(self, remote: str) -> bool:
        """Whether ``remote`` owns a job here or runs one of its stages."""
        return any(remote == peer for job in self.jobs.values() for peer, _ in job.setup.peers)

    def _job(self, name: str) -> Job:
        return find_job(self.jobs, name)

    def _admit(self, remote: str, header: ExecHeader) -> int:
        """Whether ``remote`` may send this message, and the largest body it may carry.

        Raises:
            ProtocolError / LimitError: it may not (the reason is sent back).
        """
        if isinstance(header, OpData):
            return admit_opdata(self._job(header.job), remote, header)
        return admit_control(self.policy, self.jobs, self._setting_up, remote, header)

    # ------------------------------------------------------------ OpData
    async def _take_opdata(
        self, remote: str, header: OpData, body: bytes | bytearray, reservation: Reservation
    ) -> None:
        self._admit(remote, header)  # the job may have moved on while the body arrived
        job = self.jobs[header.job]
        job.seen.add(opdata_key(header))
        job.touch()
        try:
            await self.compute.put(Work(job, header, body, reservation=reservation))
        except LimitError:
            job.seen.discard(opdata_key(header))
            raise

    async def submit(
        self, job_name: str, call: Callable[[], list[Message]], *, starts: int | None = None
    ) -> None:
        """Runs ``call`` on the compute thread in turn with incoming OpData; sends what it
        returns. ``starts``: the micro-batch whose forward the call starts."""
        await self.compute.put(Work(self._job(job_name), call=call, starts=starts))

    async def wait_done(self, job_name: str, micro_batches: int) -> None:
        """Waits until ``micro_batches`` of the job's iteration finished backward here."""
        await self.compute.wait_done(self._job(job_name), micro_batches)

    async def wait_ready(self, job_name: str) -> None:
        """Waits until this stage finished the job's iteration: backward, queue and sends.

        Raises:
            ProtocolError: the job failed, or did not finish within the timeout.
        """
        await self.compute.wait_ready(self._job(job_name))

    def leaving(self, job_name: str) -> set[str]:
        """The stage owners of a job owned here that said they leave the swarm (none if
        the job is gone)."""
        job = self.jobs.get(job_name)
        return set(job.leaving) if job is not None else set()

    async def step(self, job_name: str) -> tuple[float, int, float, int]:
        """Once the job's iteration is done here, applies the optimizer and moves on; the
        seconds this stage computed in the iteration, the most micro-batches whose
        activations it held at once (at most its setup's ``in_flight``), and for a
        replicated stage the seconds it averaged and the replicas in that average (0, 0
        if it is not replicated).

        Raises:
            ProtocolError: the job failed, or its iteration did not finish in time.
        """
        job = self._job(job_name)
        seconds = await self.compute.step(job)
        averaged = job.last_averaging
        if averaged is None:
            return seconds, job.last_held_peak, 0.0, 0
        return seconds, job.last_held_peak, averaged.seconds, averaged.group_size

    # ------------------------------------------------------------ control
    async def _control(
        self, remote: str, header: ExecControl, body: bytes | bytearray
    ) -> tuple[FrameKind, bytes]:
        if header.command == "ping":
            return FrameKind.ACK, b""
        if header.command == "setup":
            await self._setup(remote, header.job, body)
            return FrameKind.ACK, b""
        if header.command == "grant":
            await self.shards.grant(body)
            return FrameKind.ACK, b""
        if header.command == "shard_get":
            return FrameKind.DATA, await self.shards.get(remote, body)
        job = self._job(header.job)
        if header.command == "leaving":  # admitted: a stage owner of a job this peer owns
            job.leaving.add(remote)
            job.fail(f"stage owner {remote} is leaving the swarm")
            await self.compute.notify()
            return FrameKind.ACK, b""
        progress = header.command != "fetch"  # reading a job's state does not keep it alive
        if progress:
            job.touch()
        job.busy += 1
        try:
            return await self._job_control(job, remote, header, body)
        finally:
            job.busy -= 1
            if progress:
                job.touch()

    async def _job_control(
        self, job: Job, remote: str, header: ExecControl, body: bytes | bytearray
    ) -> tuple[FrameKind, bytes]:
        executor = job.executor
        if header.command == "checkpoint":
            return FrameKind.DATA, await self.shards.checkpoint(job, body)
        if header.command == "shard_put":
            await self.shards.put(job, remote, header, body)
            return FrameKind.ACK, b""
        if header.command == "load_local":
            load = functools.partial(
                load_local_weights,
                executor,
                LocalWeights.from_wire(body),
                self.policy.weights_dir,
                self.policy.limits.weights_chunk_bytes,
            )
            count = await self.in_pool(load)
            job.state_missing = executor.missing_state()
            logger.info("job %s: %d pretrained tensors loaded from this peer's copy", job.name, count)
            return FrameKind.ACK, b""
        if header.command == "weights":
            job.state_missing = await self.in_pool(functools.partial(executor.load_state, body))
            return FrameKind.ACK, b""
        if header.command == "teardown":
            await self._drop(job, "its owner tore it down")
            return FrameKind.ACK, b""
        if header.command == "regroup":
            await self._regroup(job, ReplicaGroup.from_wire(body))
            return FrameKind.ACK, b""
        if header.command == "fetch":
            if header.what not in FETCHABLE:
                raise ProtocolError(f"cannot fetch {header.what!r:.40}")
            if header.what == "grads":
                await self.wait_ready(job.name)
            read = {
                "params": executor.state_dict,
                "grads": executor.grads,
                "state": executor.full_state,
                "fingerprint": lambda: FINGERPRINT.pack(*parameter_fingerprint(executor.param_tensors())),
            }
            data = await self.in_pool(read[header.what])
            reply = ExecControl(command="fetch", job=job.name, what=header.what, body_bytes=len(data))
            return FrameKind.DATA, pack_message(reply, data)
        return FrameKind.ACK, STEP_REPLY.pack(*await self.step(job.name))

    async def _setup(self, remote: str, name: str, body: bytes | bytearray) -> None:
        admit_setup(self.policy, self.jobs, self._setting_up, remote, name)
        setup = JobSetup.from_wire(body)
        check_setup(setup, name, me=self.transport.peer_id, sender=remote, limits=self.policy.limits)
        if setup.epoch and self._plan_check is None:
            raise ProtocolError("this peer follows no coordinator: it cannot check a planned setup")
        if setup.replicas > 1 and self._averagers is None:
            raise ProtocolError("this peer has no DHT to average a replicated stage's gradients on")
        build = self._engines.get(setup.engine)
        if build is None:
            raise ProtocolError(
                f"this peer runs no {setup.engine!r} engine (it offers {sorted(self._engines)})"
            )
        self._setting_up[name] = remote
        try:
            if self._plan_check is not None:
                try:
                    await asyncio.wait_for(self._plan_check(setup, remote), self.policy.timeout)
                except TimeoutError:
                    raise ProtocolError(
                        f"job {name}: its plan could not be read from the DHT in time"
                    ) from None
            executor = await self.in_pool(
                functools.partial(
                    build, setup, self.registry, self.policy.max_memory_bytes, self.policy.device
                )
            )
            if setup.weights == "shards":
                await self.shards.restore(executor, setup)
            averager = None
            if setup.replicas > 1:
                assert self._averagers is not None
                averager = await asyncio.to_thread(self._averagers, setup, remote, executor)
            try:
                await self._connect(setup)
            except BaseException:
                if averager is not None:
                    await asyncio.to_thread(averager.close)
                raise
            self.install(executor, setup, owner=remote).averager = averager
        except LimitError as e:
            logger.warning("refused job %s from %s: %s", name, remote, e)
            raise
        finally:
            self._setting_up.pop(name, None)

    async def _connect(self, setup: JobSetup) -> None:
        async def dial(peer_id: str, maddrs: tuple[str, ...]) -> None:
            with contextlib.suppress(PeerUnreachableError):
                await self.transport.connect(peer_id, maddrs, timeout=self.policy.timeout)

        await asyncio.gather(
            *(
                dial(peer_id, maddrs)
                for stage, (peer_id, maddrs) in enumerate(setup.peers)
                if stage != setup.stage and maddrs and peer_id != self.transport.peer_id
            )
        )

    async def _regroup(self, job: Job, group: ReplicaGroup) -> None:
        """A replicated stage averages with ``group`` from now on (a replica was lost): only
        with peers it averaged with before, in a new averaging group; alone, it stops
        averaging.

        Raises:
            ProtocolError: the job is not replicated, or the group is not a smaller part of
                its old one with this peer at its place, or not of a later generation.
        """
        setup, peers = job.setup, group.averaging_peers
        if (
            setup.replicas < 2
            or not set(peers) <= set(setup.averaging_peers)
            or len(peers) >= setup.replicas
            or peers[group.replica] != self.transport.peer_id
            or group.generation <= setup.generation
        ):
            raise ProtocolError(f"job {job.name}: not a smaller averaging group of its replicas")
        old, job.averager = job.averager, None
        if old is not None:
            await asyncio.to_thread(old.close)
        job.setup = dataclasses.replace(
            setup,
            replicas=len(peers),
            replica=group.replica,
            averaging_peers=peers,
            generation=group.generation,
        )
        if len(peers) > 1 and self._averagers is not None:
            job.averager = await asyncio.to_thread(self._averagers, job.setup, job.owner, job.executor)
        logger.info("job %s: stage %d averages with %d replica(s) now", job.name, setup.stage, len(peers))

    async def remove(self, job_name: str, why: str) -> None:
        """Stops serving a job here (a data owner dropping one of its replicas)."""
        job = self.jobs.get(job_name)
        if job is not None:
            await self._drop(job, why)

    def install(self, executor: Executor, setup: JobSetup, *, owner: str) -> Job:
        """Serves ``executor`` as stage ``setup.stage`` of ``setup.job``, obeying ``owner``
        (a data owner installs its own stage this way, with ``owner`` itself)."""
        job = Job(setup, executor, owner, self.policy.limits)
        job.micro_batches_done = executor.micro_batches_done(0)
        job.state_missing = executor.missing_state()
        self.jobs[setup.job] = job
        logger.info(
            "stage %d of job %s set up for %s (inbound limit per message %s)",
            setup.stage,
            setup.job,
            owner,
            format_bytes(job.max_body),
        )
        self._jobs_changed()
        return job

    def _jobs_changed(self) -> None:
        if self._on_jobs_changed is not None:
            self._on_jobs_changed()

    async def _drop(self, job: Job, why: str) -> None:
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        await job.aclose()
        self.compute.discard(job)
        await self.compute.notify()
        self._jobs_changed()
        logger.info("job %s (stage %d) ended: %s; its memory is freed", job.name, job.setup.stage, why)

    async def _reap(self) -> None:
        """Frees jobs whose owner and neighbours went silent (a data owner that died)."""
        limit = self.policy.limits.job_idle_timeout
        while True:
            await asyncio.sleep(min(_REAP_PERIOD, limit))
            now = time.monotonic()
            for job in list(self.jobs.values()):
                idle = now - job.last_active
                stuck = job.queued == job.gated  # nothing runs; gated forwards wait for a backward
                if job.owner != self.transport.peer_id and not job.busy and stuck and idle > limit:
                    await self._drop(job, f"nothing from its owner or neighbours for {idle:.0f} s")
