"""The compute side of a serving peer: one thread, one bounded queue, and readiness per job.

Every executor's work (accepting an OpData, a data owner's local call, a step) runs on one
compute thread, fed in order from a bounded queue; what it returns is handed back to the
event loop (messages to send, whether the iteration's backward is done), never read from
the executor by the loop. A full queue holds the reader of the next OpData back, and so
its sender: back-pressure, not memory growth.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fusionp2p.errors import LimitError, ProtocolError
from fusionp2p.net.transport import Transport
from fusionp2p.runtime.executor import Message
from fusionp2p.runtime.jobs import Job, Work

__all__ = ["ComputeQueue"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ComputeQueue:
    """Runs jobs' work on one thread; ``run()`` is its loop (a task the owner tracks)."""

    def __init__(self, transport: Transport, *, depth: int, timeout: float) -> None:
        self.transport = transport
        self.timeout = timeout
        self.rejected = 0  # OpData whose body the executor refused
        self._inbox: asyncio.Queue[Work] = asyncio.Queue(depth)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fusionp2p-exec")
        self._progress = asyncio.Condition()

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def put(self, work: Work) -> None:
        """Queues ``work``, waiting at most the timeout for room.

        Raises:
            LimitError: the queue stayed full.
        """
        work.job.queued += 1
        try:
            await asyncio.wait_for(self._inbox.put(work), self.timeout)
        except TimeoutError:
            work.job.queued -= 1
            raise LimitError(f"compute queue full for {self.timeout:.0f} s") from None

    async def run(self) -> None:
        while True:
            item = await self._inbox.get()
            job = item.job
            try:
                if not job.closed:
                    await self._run(item)
            finally:
                job.queued -= 1
                if item.reservation is not None:
                    item.reservation.release()
                await self.notify()

    async def _run(self, item: Work) -> None:
        job = item.job
        executor, iteration, n = job.executor, job.iteration, job.setup.n_micro_batches
        if item.call is not None:
            work = item.call
        else:
            assert item.header is not None
            work = functools.partial(executor.accept, item.header, item.body)

        def run() -> tuple[list[Message], bool]:
            return work(), executor.ready_to_step(iteration, n)

        try:
            out, job.backward_done = await self.in_pool(run)
        except ProtocolError as e:
            self.rejected += 1
            job.fail(f"rejected OpData from stage {item.header.src_stage if item.header else '?'}: {e}")
            return
        except Exception as e:
            logger.exception("job %s: the executor failed", job.name)
            job.fail(f"{type(e).__name__}: {e}")
            return
        notify: Callable[[], Awaitable[None]] = self.notify
        for message in out:
            job.send(message, self.transport, self.timeout, notify)

    async def notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def wait_ready(self, job: Job) -> None:
        """Waits until ``job``'s iteration is done here: backward, queued work and sends.

        Raises:
            ProtocolError: the job failed or was torn down, or did not finish in time.
        """
        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(job.ready), self.timeout)
            except TimeoutError:
                raise ProtocolError(
                    f"stage {job.setup.stage} did not finish iteration {job.iteration} of job {job.name} "
                    f"in {self.timeout:.0f} s"
                ) from None
        if job.failure is not None:
            raise ProtocolError(f"stage {job.setup.stage} of job {job.name} failed: {job.failure}")
        if job.closed:
            raise ProtocolError(f"job {job.name} was torn down")

    async def step(self, job: Job) -> None:
        """Once ``job``'s iteration is done here, applies the optimizer and moves on.

        Raises:
            ProtocolError: the job failed, or its iteration did not finish in time.
        """
        await self.wait_ready(job)
        executor, iteration, n = job.executor, job.iteration, job.setup.n_micro_batches

        def step() -> bool:
            executor.step(iteration)
            return executor.ready_to_step(iteration + 1, n)

        job.backward_done = await self.in_pool(step)
        job.iteration = iteration + 1
        job.seen.clear()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
