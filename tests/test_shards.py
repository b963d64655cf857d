"""Checkpoint shards kept by the stages: written where each stage runs, copied to one
replica, read peer to peer by a new split of the model, never through the data owner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from exec_helpers import Identities, user_model_swarm

from fusionp2p.errors import ProtocolError
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.split import op_node_names
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import ModelSpec, ShardReport
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.restore import Restore
from fusionp2p.runtime.shard_store import ShardStore, namespace_of, tensor_digests

GPT2 = ModelSpec(
    "gpt2",
    {"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_layer": 3, "n_head": 2},
    input_shape=(2, 8),
    seed=2,
)
N_MB = 2


def test_a_store_keeps_two_steps_and_serves_only_granted_readers(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    secret = b"s" * 32
    ns = namespace_of(secret)
    part = safetensors.torch.save({"w": torch.arange(4.0), "w#step": torch.tensor(3.0)})
    for step in (1, 2, 3):
        store.write(ns, "run1", step, "v1-s1", 0, part)
    assert sorted(p.name for p in (tmp_path / ns / "run1").iterdir()) == ["step-000002", "step-000003"]
    with pytest.raises(ProtocolError, match="may not read"):
        store.read(ns, "run1", 3, "v1-s1", ["w"], reader="QmReader")
    with pytest.raises(ProtocolError, match="holds no shard"):
        store.grant(b"t" * 32, "run1", 3, "v1-s1", ["QmReader"])  # another run's secret names nothing here
    store.grant(secret, "run1", 3, "v1-s1", ["QmReader"])
    got = safetensors.torch.load(store.read(ns, "run1", 3, "v1-s1", ["w"], reader="QmReader"))
    assert torch.equal(got["w"], torch.arange(4.0)) and set(got) == {"w"}
    with pytest.raises(ProtocolError, match="holds no"):
        store.read(ns, "run1", 3, "v1-s1", ["x"], reader="QmReader")
    with pytest.raises(ProtocolError, match="not safetensors"):
        store.write(ns, "run1", 3, "v1-s2", 0, b"\x00" * 64)
    assert not store.parts(ns, "run1", 3, "v1-s2")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("shards"))
    with user_model_swarm(2, swarm="shards", workdir=workdir) as s:
        yield s


@pytest.fixture(scope="module")
def owner(swarm: LocalSwarm) -> Iterator[tuple[asyncio.AbstractEventLoop, P2PTransport]]:
    clients = Identities(swarm.initial_peers, 1)
    yield clients.loop, clients.transports[0]
    clients.close()


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + step)
    ids = [torch.randint(0, 97, GPT2.input_shape, generator=g) for _ in range(N_MB)]
    return [(x, x) for x in ids]


def test_a_new_split_restores_from_the_replica_of_a_lost_stage(
    owner, swarm: LocalSwarm, tmp_path: Path
) -> None:
    loop, transport = owner
    first, second = swarm.peers
    n = len(op_node_names(trace_spec(GPT2, fake=True).program.graph))
    secret = b"k" * 32
    options = dict(
        n_micro_batches=N_MB,
        timeout=120,
        run="run-shards",
        shard_secret=secret,
        shard_dir=str(tmp_path / "own"),
    )

    async def before() -> tuple[list[ShardReport], list[float], int]:
        layout = RuntimeLayout(
            (transport.peer_id, first.peer_id, second.peer_id),
            [0] * 4 + [1 if i < n // 2 else 2 for i in range(4, n)],
        )
        driver = await PipelineDriver.create(
            transport,
            GPT2,
            layout,
            JobOptions(job="shards-a", **options),
            addresses={p.peer_id: p.multiaddrs for p in swarm.peers},
        )
        try:
            for step in range(2):
                await driver.train_step(_batches(step))
            received = transport.bytes_received
            reports = await driver.checkpoint(2, {1: second.peer_id, 2: first.peer_id})
            through = transport.bytes_received - received
            losses = [await driver.train_step(_batches(step)) for step in (2, 3)]
        finally:
            await driver.aclose()
        return reports, losses, through

    reports, want, through = loop.run_until_complete(before())
    assert [r.shard for r in reports] == ["v1-s0", "v1-s1", "v1-s2"]
    assert reports[0].holders == (transport.peer_id,)  # the data owner's own shard stays with it
    assert reports[1].holders == (first.peer_id, second.peer_id)  # each stage's: its own and a replica
    assert reports[2].holders == (second.peer_id, first.peer_id)
    weights = sum(r.nbytes for r in reports[1:])
    assert (
        through < 8 * sum(len(r.to_wire()) for r in reports) and through < weights / 20
    )  # reports, no tensors

    async def after() -> list[float]:  # the first peer is lost: its stage's shard is read from the replica
        layout = RuntimeLayout((transport.peer_id, second.peer_id), [0] * 4 + [1] * (n - 4))
        driver = await PipelineDriver.create(
            transport,
            GPT2,
            layout,
            JobOptions(job="shards-b", plan_version=2, **options),
            addresses={second.peer_id: second.multiaddrs},
            restore=Restore(2, tuple(reports)),
            exclude=(first.peer_id,),
        )
        try:
            return [await driver.train_step(_batches(step)) for step in (2, 3)]
        finally:
            await driver.aclose()

    assert loop.run_until_complete(after()) == pytest.approx(want, rel=1e-5)


def test_digests_name_each_tensor() -> None:
    digests = dict(tensor_digests({"a": torch.zeros(3), "b": torch.ones(3)}))
    assert digests["a"] != digests["b"] and len(digests["a"]) == 64
