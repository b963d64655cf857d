"""Talking the exec protocol by hand, as the tests and benchmarks/hostile_peer.py do.

Shared so that what a forger sends and what a data owner would send are written once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hivemind.p2p import P2P

from fusionp2p.config import OptimizerConfig
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.split import Partition, op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import JobSetup, ModelSpec, OpData
from fusionp2p.runtime.job_setup import JobOptions, stage_setups

T = TypeVar("T")


def user_model_swarm(n: int, *, swarm: str, workdir: str, peer_args: Sequence[str] = ()) -> LocalSwarm:
    """``n`` peers that can import ``tests/user_models.py`` and serve ``user_models:SkipNet``,
    with no coordinator: a test's data owner sets its own splits up (unplanned jobs)."""
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH", "")]))}
    return LocalSwarm(
        n,
        swarm=swarm,
        workdir=workdir,
        peer_args=[["--probe-period", "30", "--no-coordinator", *peer_args]] * n,
        env=env,
        allow_models=["user_models:SkipNet"],
    )


def first_forward(part: Partition, job: str, *, largest: bool = False) -> OpData:
    """The header of a forward OpData stage 0 sends stage 1 (micro-batch 0, iteration 0):
    the first such value, or the largest; its body is ``header.body_bytes`` dense bytes."""
    values = [v for v in part.values if part.stage_of[v] == 0 and part.reader_nodes(v, 1)]
    value = max(values, key=lambda v: part.values[v].numel_bytes()) if largest else values[0]
    info = part.values[value]
    return OpData(
        job=job,
        direction="forward",
        producer=value,
        consumers=part.reader_nodes(value, 1),
        requires_grad=info.is_float,
        iteration=0,
        micro_batch=0,
        shape=info.shape,
        dtype=info.dtype,
        body_bytes=info.numel_bytes(),
        src_stage=0,
        dst_stage=1,
    )


def fake_setups(
    spec: ModelSpec,
    peers: Sequence[tuple[str, Sequence[str]]],
    *,
    job: str,
    n_micro_batches: int = 1,
    registry: Any = None,
) -> list[JobSetup]:
    """What a data owner sends for a contiguous split of ``spec`` over ``peers``, traced
    under a fake tensor mode here (a model of any size costs no memory)."""
    traced = trace_spec(spec, registry, fake=True)
    n = len(op_node_names(traced.program.graph))
    assignment = [i * len(peers) // n for i in range(n)]
    part = partition(traced.program, assignment, len(peers))
    layout = RuntimeLayout(tuple(p for p, _ in peers), assignment)
    options = JobOptions(job=job, n_micro_batches=n_micro_batches)
    addresses = {p: tuple(m) for p, m in peers}
    return stage_setups(spec, traced.dag.fingerprint, assignment, part, layout, options, addresses)


def stranger_setup(family: str, config: dict, stranger: str, target: str, *, job: str = "evil") -> bytes:
    """A well-formed setup from ``stranger`` (as its data owner) naming ``target`` for stage 1."""
    return JobSetup(
        job=job,
        spec=ModelSpec(family, config, input_shape=(1, 4)),
        node_ranges=((0, 1), (1, 2)),
        stage=1,
        data_stage=0,
        peers=((stranger, ()), (target, ())),
        n_micro_batches=1,
        optimizer=OptimizerConfig(),
        fingerprint="0" * 16,
    ).to_wire()


class Identities:
    """``n`` libp2p identities of this process on a swarm, and the one loop they live on."""

    def __init__(self, initial_peers: Sequence[str], n: int) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.p2ps = [self.run(self._p2p(initial_peers)) for _ in range(n)]
        self.transports = [P2PTransport(p) for p in self.p2ps]

    @staticmethod
    async def _p2p(initial_peers: Sequence[str]) -> P2P:
        return await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=list(initial_peers)
        )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        for p2p in self.p2ps:
            self.run(p2p.shutdown())
        self.loop.close()
