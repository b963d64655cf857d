"""Serves an executor on the exec protocol: OpData and control messages over frame streams.

    message = header_len:u16 | header (an OpData or ExecControl record) | body

Every message gets one reply frame: ACK, ERROR (a UTF-8 reason) or DATA (a fetch). An
OpData is validated (``Executor.check``) and queued before the ACK, never computed while
the sender waits, so two stages sending to each other cannot deadlock. One worker task
feeds the queue to the executor in a single compute thread; what it returns goes to one
outbox per destination stage, whose sender keeps a long-lived stream to that stage.

Setup (the job's model spec, the assignment, the stage peers) builds the executor here
from the spec: the model is traced on this peer, and the data owner's graph fingerprint
must match it. Weights arrive as safetensors bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from fusionp2p.config import OptimizerConfig, load_json_object
from fusionp2p.errors import ConfigError, FusionP2PError, PeerUnreachableError, ProtocolError, RecordError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.opdag.split import partition
from fusionp2p.opdag.trace import trace_module
from fusionp2p.records import ExecControl, OpData, decode_record
from fusionp2p.runtime.executor import Executor, Message
from fusionp2p.runtime.torch_executor import TorchExecutor

__all__ = [
    "EXEC_PROTOCOL",
    "ExecutorService",
    "JobSetup",
    "pack_message",
    "request",
    "unpack_message",
]

logger = logging.getLogger(__name__)

EXEC_PROTOCOL = "/fusionp2p/exec/1"
_LEN = struct.Struct("!H")
DEFAULT_MAX_MESSAGE = 512 << 20
_MAX_SETUP = 4 << 20
T = TypeVar("T")


def pack_message(header: OpData | ExecControl, body: bytes = b"") -> bytes:
    wire = header.to_wire()
    return _LEN.pack(len(wire)) + wire + body


def unpack_message(payload: bytes) -> tuple[OpData | ExecControl, bytes]:
    """Splits a message and decodes its header.

    Raises:
        ProtocolError: too short, a header that is not an OpData or ExecControl record, or
            a body whose length disagrees with the header.
    """
    if len(payload) < _LEN.size:
        raise ProtocolError(f"message of {len(payload)} bytes has no header")
    (size,) = _LEN.unpack_from(payload)
    if _LEN.size + size > len(payload):
        raise ProtocolError(f"header of {size} bytes in a message of {len(payload)}")
    try:
        header = decode_record(payload[_LEN.size : _LEN.size + size])
    except RecordError as e:
        raise ProtocolError(f"bad message header: {e}") from e
    if not isinstance(header, (OpData, ExecControl)):
        raise ProtocolError(f"a {header.KIND!r} record is not an exec message")
    body = payload[_LEN.size + size :]
    if len(body) != header.body_bytes:
        raise ProtocolError(f"body of {len(body)} bytes, header says {header.body_bytes}")
    return header, body


async def request(
    stream: FrameStream, header: OpData | ExecControl, body: bytes = b"", *, timeout: float
) -> tuple[FrameKind, bytes]:
    """Sends one message and returns the reply frame (ERROR raises ProtocolError)."""
    await stream.send(FrameKind.DATA, pack_message(header, body), timeout=timeout)
    kind, reply = await stream.recv(max_payload=DEFAULT_MAX_MESSAGE, timeout=timeout)
    if kind is FrameKind.ERROR:
        raise ProtocolError(
            f"stage peer {stream.remote[:12]} refused {header.KIND}: {reply.decode(errors='replace')}"
        )
    return kind, reply


@dataclass(frozen=True)
class JobSetup:
    """What a stage needs to build its executor (the body of a ``setup`` control message).

    JSON, not a msgpack record: the assignment has one entry per operator node, far more
    than a record holds. It carries its own schema version ``v`` all the same.
    """

    VERSION: ClassVar[int] = 1

    job: str
    spec_json: str  # ModelSpec.to_json()
    assignment: tuple[int, ...]  # a stage per operator node, in graph order
    n_stages: int
    stage: int
    data_stage: int
    peers: tuple[tuple[str, tuple[str, ...]], ...]  # per stage: (peer id, multiaddrs)
    n_micro_batches: int
    optimizer: OptimizerConfig
    fingerprint: str  # of the data owner's traced graph
    ratios: tuple[tuple[int, float], ...] = ()  # Top-K ratio per destination stage

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "v": self.VERSION,
                "job": self.job,
                "spec": self.spec_json,
                "assignment": list(self.assignment),
                "n_stages": self.n_stages,
                "stage": self.stage,
                "data_stage": self.data_stage,
                "peers": [[p, list(m)] for p, m in self.peers],
                "n_micro_batches": self.n_micro_batches,
                "optimizer": self.optimizer.to_dict(),
                "fingerprint": self.fingerprint,
                "ratios": [[s, r] for s, r in self.ratios],
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobSetup:
        """Raises ConfigError on anything malformed (it comes from another peer)."""
        body = load_json_object(data, "setup", _MAX_SETUP)
        version = body.get("v")
        if not isinstance(version, int) or not 1 <= version <= cls.VERSION:
            raise ConfigError(f"setup schema version {version!r:.20}, this peer reads 1..{cls.VERSION}")
        try:
            setup = cls(
                job=str(body["job"]),
                spec_json=str(body["spec"]),
                assignment=tuple(int(s) for s in body["assignment"]),
                n_stages=int(body["n_stages"]),
                stage=int(body["stage"]),
                data_stage=int(body["data_stage"]),
                peers=tuple((str(p), tuple(str(m) for m in maddrs)) for p, maddrs in body["peers"]),
                n_micro_batches=int(body["n_micro_batches"]),
                optimizer=OptimizerConfig.from_dict(body["optimizer"]),
                fingerprint=str(body["fingerprint"]),
                ratios=tuple((int(s), float(r)) for s, r in body.get("ratios", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"setup misses or mistypes a field: {e!r}") from e
        if len(setup.peers) != setup.n_stages or not 0 <= setup.stage < setup.n_stages:
            raise ConfigError(
                f"setup has {len(setup.peers)} peers for {setup.n_stages} stages, stage {setup.stage}"
            )
        if setup.n_micro_batches < 1 or any(r < 1 for _, r in setup.ratios):
            raise ConfigError("setup needs n_micro_batches >= 1 and ratios >= 1")
        return setup


def build_torch_executor(setup: JobSetup) -> Executor:
    """Traces the spec here, checks the fingerprint and builds this stage's executor."""
    spec = ModelSpec.from_json(setup.spec_json)
    traced = trace_module(spec.build(), [spec.example_input()], strip_prefix=spec.strip_prefix)
    part = partition(traced.program, setup.assignment, setup.n_stages, data_stage=setup.data_stage)
    if part.fingerprint != setup.fingerprint:
        raise ConfigError(
            f"model {spec.name!r} traced to graph {part.fingerprint} here but {setup.fingerprint} at the "
            "data owner (different torch/transformers versions?)"
        )
    return TorchExecutor(
        traced.program,
        part,
        setup.stage,
        job=setup.job,
        n_micro_batches=setup.n_micro_batches,
        optimizer=setup.optimizer,
        ratios=dict(setup.ratios),
    )


class ExecutorService:
    """Serves one executor at a time on ``transport`` (a new setup replaces the old job)."""

    def __init__(
        self,
        transport: Transport,
        *,
        build: Callable[[JobSetup], Executor] = build_torch_executor,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        timeout: float = 60.0,
        idle_timeout: float = 3600.0,
    ) -> None:
        self.transport = transport
        self.executor: Executor | None = None
        self.setup: JobSetup | None = None
        self.failure: str | None = None  # the first error of the current iteration
        self._build = build
        self._max_message = max_message_bytes
        self._timeout = timeout
        self._idle_timeout = idle_timeout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fusionp2p-exec")
        self._inbox: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._outboxes: dict[int, asyncio.Queue[Message]] = {}
        self._senders: dict[int, asyncio.Task[None]] = {}
        self._incoming: set[FrameStream] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._progress = asyncio.Condition()
        self._pending_sends = 0
        self.rejected = 0  # OpData and control messages refused with a protocol error

    async def start(self) -> ExecutorService:
        await self.transport.serve(EXEC_PROTOCOL, self._handle)
        self._spawn(self._work(), "exec-worker")
        return self

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=f"fusionp2p.{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stops serving the exec protocol and ends the worker and the senders."""
        await self.transport.stop_serving(EXEC_PROTOCOL)
        senders = list(self._senders.values())
        self._drop_senders()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *senders, return_exceptions=True)
        for stream in list(self._incoming):
            await stream.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the compute thread (the one the executor's work runs on)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    # ------------------------------------------------------------ incoming
    async def _handle(self, stream: FrameStream) -> None:
        self._incoming.add(stream)
        try:
            await self._serve_stream(stream)
        finally:
            self._incoming.discard(stream)

    async def _serve_stream(self, stream: FrameStream) -> None:
        while True:
            try:
                kind, payload = await stream.recv(max_payload=self._max_message, timeout=self._idle_timeout)
            except ProtocolError as e:
                self.rejected += 1
                logger.warning("protocol error: rejected exec frame from %s: %s", stream.remote[:12], e)
                with contextlib.suppress(FusionP2PError):
                    await stream.send(FrameKind.ERROR, str(e).encode()[:2000], timeout=self._timeout)
                return  # the framing may be lost: drop the stream
            except PeerUnreachableError:
                return
            if kind is FrameKind.END:
                return
            try:
                if kind is not FrameKind.DATA:
                    raise ProtocolError(f"expected a DATA frame, got {kind.name}")
                header, body = unpack_message(payload)
                if isinstance(header, OpData):
                    self._check(header)
                    self._inbox.put_nowait(("opdata", header, body))
                    await stream.send(FrameKind.ACK, timeout=self._timeout)
                else:
                    reply_kind, reply = await self._control(header, body)
                    await stream.send(reply_kind, reply, timeout=self._timeout)
            except (ProtocolError, ConfigError) as e:
                self.rejected += 1
                logger.warning("protocol error: rejected message from %s: %s", stream.remote[:12], e)
                await stream.send(FrameKind.ERROR, str(e).encode()[:2000], timeout=self._timeout)

    def _check(self, header: OpData) -> None:
        if self.executor is None:
            raise ProtocolError("no job is set up on this peer")
        self.executor.check(header)

    async def _control(self, header: ExecControl, body: bytes) -> tuple[FrameKind, bytes]:
        if header.command == "ping":
            return FrameKind.ACK, b""
        if header.command == "setup":
            setup = JobSetup.from_json(body)
            if setup.job != header.job:
                raise ProtocolError(f"setup body for job {setup.job!r} under header job {header.job!r}")
            await self._install(setup)
            return FrameKind.ACK, b""
        executor = self.executor
        if executor is None or header.job != executor.job:
            raise ProtocolError(f"job {header.job!r} is not set up on this peer")
        if header.command == "weights":
            await self.in_pool(lambda: executor.load_state(body))
            return FrameKind.ACK, b""
        if header.command == "fetch":
            if header.what == "params":
                data = await self.in_pool(executor.state_dict)
            elif header.what == "grads":
                await self.wait_ready(header.iteration, header.n_micro_batches)
                data = await self.in_pool(executor.grads)
            else:
                raise ProtocolError(f"cannot fetch {header.what!r}")
            reply = ExecControl(command="fetch", job=header.job, what=header.what, body_bytes=len(data))
            return FrameKind.DATA, pack_message(reply, data)
        # step
        await self.wait_ready(header.iteration, header.n_micro_batches)
        await self.in_pool(lambda: executor.step(header.iteration))
        return FrameKind.ACK, b""

    async def _install(self, setup: JobSetup) -> None:
        connect = getattr(self.transport, "connect", None)
        executor = await self.in_pool(lambda: self._build(setup))
        if connect is not None:
            for stage, (peer_id, maddrs) in enumerate(setup.peers):
                if stage != setup.stage and maddrs and peer_id != self.transport.peer_id:
                    with contextlib.suppress(PeerUnreachableError):
                        await connect(peer_id, maddrs, timeout=self._timeout)
        self.install(executor, setup)

    def install(self, executor: Executor, setup: JobSetup) -> None:
        """Makes ``executor`` the one this service feeds (the data owner installs its own)."""
        self._drop_senders()
        self.executor = executor
        self.setup = setup
        self.failure = None
        logger.info("stage %d of job %s set up", setup.stage, setup.job)

    async def wait_ready(self, iteration: int, n_micro_batches: int) -> None:
        """Waits until the executor finished backward for the iteration and nothing is in flight.

        Raises:
            ProtocolError: a failure in this iteration, or not ready within the timeout.
        """
        executor = self.executor
        assert executor is not None

        def ready() -> bool:
            return self.failure is not None or (
                executor.ready_to_step(iteration, n_micro_batches)
                and self._inbox.empty()
                and self._pending_sends == 0
            )

        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(ready), self._timeout)
            except TimeoutError:
                raise ProtocolError(
                    f"stage {executor.stage} did not finish iteration {iteration} in {self._timeout:.0f} s"
                ) from None
        if self.failure is not None:
            raise ProtocolError(f"stage {executor.stage} failed: {self.failure}")

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    # ------------------------------------------------------------ compute and outgoing
    def submit(self, fn: Callable[[], list[Message]]) -> None:
        """Runs ``fn`` on the compute thread in turn with incoming OpData; sends what it returns."""
        self._inbox.put_nowait(("call", fn))

    async def _work(self) -> None:
        while True:
            item = await self._inbox.get()
            executor = self.executor
            try:
                if item[0] == "call":
                    out = await self.in_pool(item[1])
                else:
                    header, body = item[1], item[2]
                    if executor is None:
                        raise ProtocolError("no job is set up on this peer")
                    out = await self.in_pool(functools.partial(executor.accept, header, body))
                for message in out:
                    self._outbox(message.header.dst_stage).put_nowait(message)
                    self._pending_sends += 1
            except ProtocolError as e:
                self.rejected += 1
                logger.warning("protocol error: rejected OpData: %s", e)
            except Exception as e:
                logger.exception("executor failed")
                self.failure = self.failure or f"{type(e).__name__}: {e}"
            await self._notify()

    def _outbox(self, stage: int) -> asyncio.Queue[Message]:
        if stage not in self._outboxes:
            self._outboxes[stage] = asyncio.Queue()
            self._senders[stage] = asyncio.create_task(
                self._send_loop(stage, self._outboxes[stage]), name=f"fusionp2p.exec-send-{stage}"
            )
        return self._outboxes[stage]

    def _drop_senders(self) -> None:
        """Ends the streams of the previous job (their peers may have changed)."""
        for task in self._senders.values():
            task.cancel()
        self._senders.clear()
        self._outboxes.clear()
        self._pending_sends = 0

    async def _send_loop(self, stage: int, queue: asyncio.Queue[Message]) -> None:
        stream: FrameStream | None = None
        try:
            while True:
                message = await queue.get()
                try:
                    for attempt in range(2):
                        try:
                            if stream is None:
                                assert self.setup is not None
                                peer_id = self.setup.peers[stage][0]
                                stream = await self.transport.open(
                                    peer_id, EXEC_PROTOCOL, timeout=self._timeout
                                )
                            await request(stream, message.header, message.body, timeout=self._timeout)
                            break
                        except PeerUnreachableError:
                            if stream is not None:
                                await stream.close()
                            stream = None
                            if attempt:
                                raise
                except FusionP2PError as e:
                    logger.warning("OpData to stage %d failed: %s", stage, e)
                    self.failure = self.failure or f"sending to stage {stage}: {e}"
                finally:
                    self._pending_sends -= 1
                    await self._notify()
        finally:
            if stream is not None:
                await stream.close()
