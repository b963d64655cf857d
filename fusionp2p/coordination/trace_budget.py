"""Tracing a stranger's model within the coordinator operator's budget.

A job request names a model family and a config; tracing it is the coordinator's cost
(a schema-maximum request took 52 s of CPU). So each request is traced in its own child
process, forked from a server that imported torch once (``multiprocessing``'s
forkserver), in two steps. First the child builds the model under ``FakeTensorMode`` and
reports its parameter bytes: a model over ``TraceBudget.max_model_bytes`` is refused there,
and the size is what the planning queue orders requests by (``coordination.queue``). Then,
once the request's turn comes, the child traces and sends the OP-DAG back; a trace that
uses more than ``TraceBudget.seconds`` of CPU time is killed and refused. CPU time, not wall
time: on a busy machine (the other requests' children sizing at once) a small model's trace
waits for a core but still costs well under its budget, while a heavy one is cut off at the
same cost however busy the machine is. A child that gets no CPU for ``_WALL_FACTOR`` times
its budget is refused as well. The child is this peer's
own code on a validated spec; what it sends back is the only thing unpickled, and it
comes from that child, never from the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import threading
from typing import Any

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusionp2p.config import TraceBudget, format_bytes
from fusionp2p.errors import ConfigError, FusionP2PError, LimitError
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.ir import OpDag
from fusionp2p.opdag.spec import skeleton_model
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec

__all__ = ["TraceJob", "warm_up"]

_PRELOAD = ["fusionp2p.opdag.trace", "fusionp2p.coordination.tracer_preload"]
_EXIT_S = 5.0  # seconds a killed child gets to be reaped
_POLL_S = 0.1  # how often a waiting parent reads its child's CPU time
_WALL_FACTOR = 10.0  # wall-clock seconds per budgeted CPU second before a child is refused anyway


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _ready() -> None:
    """A child that does nothing: it starts once the fork server finished its preload."""


_warming = threading.Lock()
_warm = False


def warm_up() -> None:
    """Starts the fork server and waits until it has imported torch and built each family
    (seconds, once per process), so that no request's budget pays for it. Blocking."""
    global _warm
    with _warming:
        if not _warm:
            child = _context().Process(target=_ready, daemon=True)
            child.start()
            child.join()
            child.close()
            _warm = True


def _child(conn: multiprocessing.connection.Connection, spec_wire: bytes, allow: tuple[str, ...]) -> None:
    """Runs in the child: size, wait for the go, trace. Every outcome is one message."""
    try:
        spec = ModelSpec.from_wire(spec_wire)
        registry = ModelRegistry(allow=allow)
        with FakeTensorMode():
            module: torch.nn.Module = skeleton_model(spec, registry)
            size = sum(p.numel() * p.element_size() for p in module.parameters())
        del module
        conn.send(("size", size))
        if conn.recv() != "go":
            return
        conn.send(("dag", trace_spec(spec, registry, fake=True).dag))
    except Exception as e:  # the parent turns it into a refusal
        conn.send(("error", type(e).__name__, str(e)[:500], isinstance(e, FusionP2PError)))


class TraceJob:
    """One request's child process: ``await TraceJob.start(...)``, then ``await job.trace()``;
    ``close()`` always (it kills the child if it still runs)."""

    def __init__(self, budget: TraceBudget) -> None:
        self.budget = budget
        self.model_bytes = 0
        self._conn: multiprocessing.connection.Connection | None = None
        self._process: Any = None

    @classmethod
    async def start(cls, spec: ModelSpec, registry: ModelRegistry, budget: TraceBudget) -> TraceJob:
        """A child that built ``spec``'s model (fake) and measured it.

        Raises:
            LimitError: the model is over the size budget, or building it took too long.
            ConfigError: the spec does not build (its family's own complaint).
        """
        allow = tuple(item for item in registry.allow if isinstance(item, str))
        job = cls(budget)
        await asyncio.to_thread(warm_up)  # the fork server's start is not this request's cost
        context = _context()
        parent, child = context.Pipe()
        job._conn = parent
        job._process = context.Process(target=_child, args=(child, spec.to_wire(), allow), daemon=True)
        try:
            await asyncio.to_thread(job._process.start)
            child.close()
            reply = await job._receive(budget.size_seconds, "building the model")
            job.model_bytes = int(reply[1])
            if job.model_bytes > budget.max_model_bytes:
                raise LimitError(
                    f"the model has {format_bytes(job.model_bytes)} of parameters, more than this "
                    f"coordinator plans ({format_bytes(budget.max_model_bytes)}, --coordinator-max-model)"
                )
        except BaseException:
            job.close()
            raise
        return job

    async def trace(self) -> OpDag:
        """The model's OP-DAG, traced (fake) within the budget.

        Raises:
            LimitError: the trace took longer than ``TraceBudget.seconds``.
            ConfigError: the trace failed (its message).
        """
        assert self._conn is not None
        self._conn.send("go")
        reply = await self._receive(self.budget.seconds, "tracing the model")
        return reply[1]

    async def _receive(self, seconds: float, doing: str) -> tuple[Any, ...]:
        assert self._conn is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + seconds * _WALL_FACTOR
        while not await asyncio.to_thread(self._conn.poll, _POLL_S):
            if self._cpu_seconds() > seconds or loop.time() > give_up:
                raise LimitError(
                    f"{doing} took more than {seconds:g} s of CPU time, this coordinator's budget "
                    "(--coordinator-trace-seconds)"
                )
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            raise ConfigError(f"{doing} failed: the tracing process died ({e or 'no reply'})") from e
        if reply[0] == "error":
            _, name, message, ours = reply
            raise ConfigError(message if ours else f"{doing} failed: {name}: {message}")
        return tuple(reply)

    def _cpu_seconds(self) -> float:
        """The child's CPU time so far (user + system, all its threads); 0 once it is gone."""
        try:
            times = psutil.Process(self._process.pid).cpu_times()
        except (psutil.Error, ValueError):
            return 0.0
        return float(times.user + times.system)

    def close(self) -> None:
        """Ends the child (killed if it still runs) and its pipe."""
        if self._process is not None:
            with contextlib.suppress(Exception):
                if self._process.is_alive():
                    self._process.kill()
                self._process.join(_EXIT_S)
                self._process.close()
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
