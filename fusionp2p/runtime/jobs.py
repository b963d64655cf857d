"""One job's state on a serving peer: its executor, owner, iteration, and outgoing OpData.

The executor is touched only on the compute thread; everything here only on the event
loop. What the compute thread learns (whether this iteration's backward is done) comes
back as the result of the work item, never by reading the executor from the loop.
Outgoing OpData leaves through one windowed ``OpDataSender`` stream per destination stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusionp2p.config import ExecLimits
from fusionp2p.net.limits import Reservation
from fusionp2p.net.transport import Transport
from fusionp2p.records import JobSetup, OpData
from fusionp2p.runtime.executor import Body, Executor, Message
from fusionp2p.runtime.opdata_stream import OpDataSender

if TYPE_CHECKING:
    from fusionp2p.runtime.averaging import AveragingResult, GradientAverager

__all__ = ["Job", "Notify", "Work"]

logger = logging.getLogger(__name__)

_WEIGHTS_SLACK = 64 << 10  # safetensors header of a chunk
Notify = Callable[[], Awaitable[None]]


def opdata_key(header: OpData) -> tuple[object, ...]:
    """What makes an OpData unique within one iteration of a job."""
    return (header.direction, header.producer, header.micro_batch, header.src_stage, header.consumers)


@dataclass
class Work:
    """One item for the compute thread: an OpData to accept, or a local call (data owner)."""

    job: Job
    header: OpData | None = None
    body: Body = b""
    call: Callable[[], list[Message]] | None = None
    reservation: Reservation | None = None
    starts: int | None = None  # the micro-batch whose forward a data owner's call starts

    @property
    def forward_of(self) -> int | None:
        """The micro-batch whose forward this item is part of (None: a backward or a step)."""
        if self.header is not None:
            return self.header.micro_batch if self.header.direction == "forward" else None
        return self.starts


@dataclass
class Job:
    """A job set up on this peer."""

    setup: JobSetup
    executor: Executor
    owner: str  # PeerID of the peer that set it up: the only one whose control it obeys
    limits: ExecLimits
    iteration: int = 0
    failure: str | None = None  # the first error; the job is broken from then on
    micro_batches_done: int = 0  # of this iteration, backward finished here (from the compute thread)
    state_missing: int = 0  # tensors of this stage its owner has not sent yet: it cannot run before
    queued: int = 0  # work items waiting or running
    gated: int = 0  # ... of them, forwards waiting for the stage's 1F1B window
    pending_sends: int = 0  # OpData handed to senders and not yet acknowledged
    busy: int = 0  # control requests being handled
    compute_s: float = 0.0  # compute-thread seconds spent on this iteration so far
    last_step_s: float = 0.0  # compute seconds of the last finished iteration
    seen: set[tuple[object, ...]] = field(default_factory=set)  # OpData accepted this iteration
    forwards: set[int] = field(default_factory=set)  # micro-batches whose forward began here this iteration
    held_peak: int = 0  # the most micro-batches holding activations here at once, this iteration
    last_held_peak: int = 0  # ... in the last finished iteration
    last_active: float = field(default_factory=time.monotonic)
    leaving: set[str] = field(default_factory=set)  # stage owners that said they leave the swarm
    closed: bool = False
    averager: GradientAverager | None = None  # a replicated job's: averages grads before each step
    last_averaging: AveragingResult | None = None  # ... what it did in the last step
    max_body: int = 0  # the largest body any message of this job may carry
    weights_limit: int = 0
    shard_limit: int = 0  # one part of a shard replica from another stage
    _senders: dict[int, OpDataSender] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = self.executor.state_sizes()
        self.weights_limit = max(self.limits.weights_chunk_bytes, *sizes.values(), 0) + _WEIGHTS_SLACK
        largest = max(self.limits.weights_chunk_bytes, self.executor.largest_tensor_bytes())
        self.shard_limit = largest + _WEIGHTS_SLACK
        self.max_body = max(
            self.weights_limit, self.shard_limit, self.executor.max_message_bytes(), self.limits.control_bytes
        )

    @property
    def name(self) -> str:
        return self.setup.job

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            logger.warning("job %s, stage %d failed: %s", self.name, self.setup.stage, reason)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def ready(self) -> bool:
        """Whether this iteration is done here: backward, every queued item and every send."""
        done = self.micro_batches_done >= self.setup.n_micro_batches
        return (
            self.failure is not None or self.closed or (done and self.queued == 0 and self.pending_sends == 0)
        )

    async def send(self, message: Message, transport: Transport, timeout: float, notify: Notify) -> None:
        """Queues ``message`` on its destination stage's stream (opened on first use)."""
        stage = message.header.dst_stage
        sender = self._senders.get(stage)
        if sender is None:

            async def done(_: int) -> None:
                self.pending_sends -= 1
                await notify()

            async def error(reason: str) -> None:
                self.fail(f"sending to stage {stage}: {reason}")
                await notify()

            sender = OpDataSender(
                transport, self.setup.peer_of(stage), timeout=timeout, on_done=done, on_error=error
            )
            self._senders[stage] = sender
        self.pending_sends += 1
        await sender.put(message)

    def sending_bytes(self) -> int:
        """Bytes of OpData queued to be sent or sent and not yet acknowledged, all stages."""
        return sum(s.queued_bytes + s.in_flight_bytes for s in self._senders.values())

    async def aclose(self) -> None:
        """Stops the senders and closes their streams, and the averager's process."""
        self.closed = True
        senders, self._senders = list(self._senders.values()), {}
        await asyncio.gather(*(s.aclose() for s in senders))
        averager, self.averager = self.averager, None
        if averager is not None:
            await asyncio.to_thread(averager.close)
