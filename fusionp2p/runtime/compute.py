"""The compute side of a serving peer: one thread, one bounded queue, and readiness per job.

Every executor's work (accepting an OpData, a data owner's local call, a step) runs on one
compute thread, fed from a bounded queue, backward before forward (1F1B: a backward frees
a micro-batch's memory) and in arrival order otherwise, several items per hop; what it
returns is handed back to the event loop (messages to send, whether the iteration's
backward is done), never read from the executor by the loop. A full queue holds the
reader of the next OpData back, and so its sender: back-pressure, not memory growth.

1F1B per stage: a forward OpData of micro-batch m waits (held aside, its body counted in
its sender's inbound budget) until fewer than the stage's ``setup.in_flight``
micro-batches hold activations here, i.e. until ``m < done + in_flight`` with ``done`` the
micro-batches whose backward finished here. Stage k of S holds ``min(n_b, S - k)``
(``planning.cost.in_flight``), what the planner and the memory check count. A held
forward only ever waits for the backward of an earlier micro-batch, and backwards are
never held, so this cannot deadlock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from fusionp2p.errors import LimitError, ProtocolError
from fusionp2p.net.transport import Transport
from fusionp2p.runtime.executor import Executor, Message
from fusionp2p.runtime.jobs import Job, Work
from fusionp2p.runtime.throttle import Throttle

if TYPE_CHECKING:
    from fusionp2p.runtime.averaging import AveragingResult

__all__ = ["ComputeQueue"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_BATCH = 32  # queued items run per hop to the compute thread


class ComputeQueue:
    """Runs jobs' work on one thread; ``run()`` is its loop (a task the owner tracks)."""

    def __init__(
        self, transport: Transport, *, depth: int, timeout: float, throttle: Throttle | None = None
    ) -> None:
        self.transport = transport
        self.throttle = throttle or Throttle()  # an emulated slower device (testbeds)
        self.timeout = timeout
        self.rejected = 0  # OpData whose body the executor refused
        self._inbox: asyncio.PriorityQueue[tuple[int, int, Work]] = asyncio.PriorityQueue(depth)
        self._seq = 0  # keeps arrival order within a priority
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fusionp2p-exec")
        self._progress = asyncio.Condition()
        self._waiting: list[Work] = []  # forwards waiting for their stage's 1F1B window

    async def in_pool(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def put(self, work: Work) -> None:
        """Queues ``work``, waiting at most the timeout for room.

        Raises:
            LimitError: the queue stayed full.
        """
        work.job.queued += 1
        self._seq += 1
        backward = work.header is not None and work.header.direction == "backward"
        item = (0 if backward else 1, self._seq, work)  # backward first (1F1B): it frees memory
        if not self._inbox.full():
            self._inbox.put_nowait(item)
            return
        try:
            await asyncio.wait_for(self._inbox.put(item), self.timeout)
        except TimeoutError:
            work.job.queued -= 1
            raise LimitError(f"compute queue full for {self.timeout:.0f} s") from None

    async def run(self) -> None:
        while True:
            batch = self._released()
            while not batch:
                self._take((await self._inbox.get())[-1], batch)
            while len(batch) < _BATCH and not self._inbox.empty():
                self._take(self._inbox.get_nowait()[-1], batch)
            try:
                await self._run_batch(batch)
            finally:
                for item in batch:
                    self._finish(item)
                await self.notify()

    @staticmethod
    def _gated(work: Work) -> bool:
        """Whether ``work`` is a forward its stage's 1F1B window does not admit yet."""
        job, micro_batch = work.job, work.forward_of
        if work.header is None or micro_batch is None or job.closed or job.failure is not None:
            return False  # the data owner's own starts are gated by its driver
        return micro_batch >= job.micro_batches_done + job.setup.in_flight

    def _take(self, work: Work, batch: list[Work]) -> None:
        if self._gated(work):
            self._waiting.append(work)
            work.job.gated += 1
        else:
            self._admitted(work)
            batch.append(work)

    def _released(self) -> list[Work]:
        """Held forwards their window now admits (or whose job ended: they run as no-ops)."""
        out = [w for w in self._waiting if not self._gated(w)]
        if out:
            self._waiting = [w for w in self._waiting if self._gated(w)]
            for work in out:
                work.job.gated -= 1
                self._admitted(work)
        return out

    def discard(self, job: Job) -> None:
        """Drops the forwards of ``job`` held for its window (the job ended: no backward
        will ever admit them), releasing their queue slots and inbound budget."""
        mine = [w for w in self._waiting if w.job is job]
        self._waiting = [w for w in self._waiting if w.job is not job]
        for work in mine:
            job.gated -= 1
            self._finish(work)

    def _admitted(self, work: Work) -> None:
        job, micro_batch = work.job, work.forward_of
        if micro_batch is not None:
            job.forwards.add(micro_batch)
            job.held_peak = max(job.held_peak, len(job.forwards) - job.micro_batches_done)

    @staticmethod
    def _finish(work: Work) -> None:
        work.job.queued -= 1
        if work.reservation is not None:
            work.reservation.release()

    async def _run_batch(self, batch: list[Work]) -> None:
        """Runs queued items in one hop to the compute thread (each one's failure is its own)."""
        steps: list[tuple[Callable[[], list[Message]], Executor, int] | None] = []
        for item in batch:
            job = item.job
            if job.closed:
                steps.append(None)
                continue
            if item.call is not None:
                work = item.call
            else:
                assert item.header is not None
                work = functools.partial(job.executor.accept, item.header, item.body)
            steps.append((work, job.executor, job.iteration))

        def run() -> list[tuple[list[Message], int, Exception | None, float] | None]:
            results: list[tuple[list[Message], int, Exception | None, float] | None] = []
            for step in steps:
                if step is None:
                    results.append(None)
                    continue
                work, executor, iteration = step
                began = time.perf_counter()
                try:
                    out = self.throttle.run(work)
                    done = executor.micro_batches_done(iteration)
                    results.append((out, done, None, time.perf_counter() - began))
                except Exception as e:
                    results.append(([], 0, e, time.perf_counter() - began))
            return results

        for item, result in zip(batch, await self.in_pool(run), strict=True):
            if result is None:
                continue
            job = item.job
            out, done, error, seconds = result
            job.compute_s += seconds
            if isinstance(error, ProtocolError):
                self.rejected += 1
                job.fail(
                    f"rejected OpData from stage {item.header.src_stage if item.header else '?'}: {error}"
                )
                continue
            if error is not None:
                logger.error("job %s: the executor failed", job.name, exc_info=error)
                job.fail(f"{type(error).__name__}: {error}")
                continue
            job.micro_batches_done = done
            for message in out:
                await job.send(message, self.transport, self.timeout, self.notify)

    async def notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def wait_done(self, job: Job, micro_batches: int) -> None:
        """Waits until at least ``micro_batches`` of ``job``'s iteration finished backward here.

        Raises:
            ProtocolError: the job failed or was torn down, or did not get there in time.
        """
        await self._wait(
            job, lambda: job.micro_batches_done >= micro_batches, f"{micro_batches} micro-batch(es)"
        )

    async def wait_ready(self, job: Job) -> None:
        """Waits until ``job``'s iteration is done here: backward, queued work and sends.

        Raises:
            ProtocolError: the job failed or was torn down, or did not finish in time.
        """
        await self._wait(job, job.ready, "its iteration")

    async def _wait(self, job: Job, condition: Callable[[], bool], what: str) -> None:
        def settled() -> bool:
            return job.failure is not None or job.closed or condition()

        async with self._progress:
            try:
                await asyncio.wait_for(self._progress.wait_for(settled), self.timeout)
            except TimeoutError:
                raise ProtocolError(
                    f"stage {job.setup.stage} did not finish {what} of iteration {job.iteration} of job "
                    f"{job.name} in {self.timeout:.0f} s"
                ) from None
        if job.failure is not None:
            raise ProtocolError(f"stage {job.setup.stage} of job {job.name} failed: {job.failure}")
        if job.closed:
            raise ProtocolError(f"job {job.name} was torn down")

    async def step(self, job: Job) -> float:
        """Once ``job``'s iteration is done here, applies the optimizer and moves on; the
        seconds this stage computed in the iteration, its optimizer step included.

        Raises:
            ProtocolError: the job failed, its state is incomplete, or its iteration did not
                finish in time.
        """
        if job.state_missing:
            raise ProtocolError(f"stage {job.setup.stage} still misses {job.state_missing} of its tensors")
        await self.wait_ready(job)
        executor, iteration = job.executor, job.iteration

        averager = job.averager

        def step() -> tuple[int, float, AveragingResult | None]:
            averaged = None
            if averager is not None:  # the replicas' mean gradient, before the optimizer applies it
                averaged = averager.average(executor.grad_tensors(), weight=job.setup.n_micro_batches)
            began = time.perf_counter()
            self.throttle.run(lambda: executor.step(iteration))
            return executor.micro_batches_done(iteration + 1), time.perf_counter() - began, averaged

        job.micro_batches_done, seconds, job.last_averaging = await self.in_pool(step)
        job.iteration = iteration + 1
        job.seen.clear()
        job.forwards.clear()
        job.last_held_peak, job.held_peak = job.held_peak, 0
        job.last_step_s, job.compute_s = job.compute_s + seconds, 0.0
        return job.last_step_s

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
