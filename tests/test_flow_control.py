"""Back-pressure instead of memory growth: a slow receiver holds its sender back.

- the OpData sender writes no more than the receiver's credit ahead of its ACKs;
- with a stage peer stopped (SIGSTOP), the data owner holds at most its 1F1B window of
  micro-batches, not the whole iteration; resumed (SIGCONT), the iteration finishes exactly.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from exec_helpers import Identities, user_model_swarm

from fusionp2p.config import OptimizerConfig
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.memory_transport import MemoryTransport
from fusionp2p.net.transport import FrameStream
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import CREDIT, EXEC_PROTOCOL, ModelSpec, OpData
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.executor import Message
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.opdata_stream import INITIAL_CREDIT, OpDataSender

LOCAL = ModelRegistry(allow=["user_models:SkipNet"])


def _opdata(i: int, size: int) -> Message:
    header = OpData(
        job="j",
        direction="forward",
        producer=f"p{i}",
        consumers=("c",),
        requires_grad=False,
        iteration=0,
        micro_batch=0,
        shape=(size // 4,),
        dtype="float32",
        body_bytes=size,
    )
    return Message(header, bytes(size))


def test_the_sender_stays_within_the_receivers_credit() -> None:
    async def run() -> None:
        hub: dict = {}
        sender_side, receiver = MemoryTransport("QmA", hub), MemoryTransport("QmB", hub)
        received: list[int] = []
        release = asyncio.Event()

        async def slow_receiver(stream: FrameStream) -> None:
            while True:
                _, payload = await stream.recv(max_payload=64 << 20, timeout=30)
                received.append(len(payload))
                await release.wait()  # a receiver that stopped reading... until released
                await stream.send(FrameKind.ACK, CREDIT.pack(2 << 20))

        await receiver.serve(EXEC_PROTOCOL, slow_receiver)
        done: list[int] = []

        async def on_done(size: int) -> None:
            done.append(size)

        async def on_error(reason: str) -> None:
            raise AssertionError(reason)

        sender = OpDataSender(sender_side, "QmB", timeout=10, on_done=on_done, on_error=on_error)
        for i in range(40):
            await sender.put(_opdata(i, 1 << 20))
        await asyncio.sleep(0.3)
        assert sender.in_flight_bytes <= INITIAL_CREDIT  # 16 written ahead, the rest waits
        assert sender.queued_bytes == (40 << 20) - sender.in_flight_bytes
        release.set()
        await asyncio.wait_for(sender.drained(), 10)
        assert len(done) == 40 and sum(received) > 40 << 20
        await sender.aclose()
        await sender_side.aclose()
        await receiver.aclose()

    asyncio.run(run())


N_MB = 16
SPEC = ModelSpec(
    "user_models:SkipNet", {"hidden": 2048}, input_shape=(512, 12), input_dtype="float32", seed=2
)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with user_model_swarm(1, swarm="flow", workdir=str(tmp_path_factory.mktemp("flow"))) as s:
        yield s


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(512, 12, generator=g), torch.randint(0, 5, (512,), generator=g)) for _ in range(N_MB)
    ]


def test_a_stopped_stage_bounds_what_the_data_owner_holds(swarm: LocalSwarm) -> None:
    peer = swarm.peers[0]
    clients = Identities(swarm.initial_peers, 1)
    transport = clients.transports[0]
    model = build_model(SPEC, LOCAL)
    ref = [LOSSES["classification"]([model(x)], y).item() for x, y in _batches()]

    async def main() -> tuple[int, int, int, list[float]]:
        driver = await PipelineDriver.create(
            transport,
            SPEC,
            RuntimeLayout((transport.peer_id, peer.peer_id)),
            JobOptions(n_micro_batches=N_MB, optimizer=OptimizerConfig(), loss="classification", timeout=60),
            addresses={peer.peer_id: peer.multiaddrs},
            registry=LOCAL,
        )
        try:
            window = driver.setups[0].in_flight
            per_micro_batch = sum(
                info.numel_bytes()
                for v, info in driver.partition.values.items()
                if driver.partition.stage_of[v] == 0 and driver.partition.reader_nodes(v, 1)
            )
            swarm.signal(0, signal.SIGSTOP)
            try:
                iteration = asyncio.create_task(driver.run_iteration(_batches()))
                deadline = time.monotonic() + 4
                held = 0
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    held = max(held, driver.service.jobs[driver.job].sending_bytes())
                assert not iteration.done()
            finally:
                swarm.signal(0, signal.SIGCONT)
            losses = await asyncio.wait_for(iteration, 60)
            return window, per_micro_batch, held, losses
        finally:
            await driver.aclose()

    try:
        window, per_micro_batch, held, losses = clients.run(main())
    finally:
        clients.close()
    assert window == 2  # min(micro-batches, stages): 1F1B over 2 stages
    assert per_micro_batch >= 4 << 20
    assert 0 < held <= window * per_micro_batch, (held, per_micro_batch)  # not N_MB of them
    assert losses == pytest.approx(ref, rel=1e-5)
