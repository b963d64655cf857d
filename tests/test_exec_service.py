"""The exec service's rules, over in-memory streams with short limits: who may do what, and how much.

The same rules are exercised against real peer processes in test_security.py; here each
one is checked in isolation, in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import struct
import time
from collections.abc import AsyncIterator

import msgpack
import psutil
import pytest
import safetensors.torch
import torch
from exec_helpers import first_forward, stranger_setup

from fusionp2p.config import ExecLimits, OptimizerConfig, RatioWarmup
from fusionp2p.errors import LimitError, PeerUnreachableError, ProtocolError, RecordError
from fusionp2p.net.framing import FRAME_VERSION, HEADER, FrameKind
from fusionp2p.net.limits import InboundBudget
from fusionp2p.net.memory_transport import MemoryTransport
from fusionp2p.net.transport import FrameStream
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import EXEC_PROTOCOL, ExecControl, JobSetup, ModelSpec, ReplicaGroup, pack_message
from fusionp2p.runtime.admission import admit_setup
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.service import ExecutorService, ServicePolicy

OWNER, STAGE, STRANGER = "Qm" + "a" * 44, "Qm" + "b" * 44, "Qm" + "c" * 44
LIMITS = ExecLimits(
    idle_timeout=0.5, stall_timeout=0.3, streams_per_peer=3, control_bytes=4096, job_idle_timeout=0.6
)
SPEC = ModelSpec("digits-cnn", {"channels": 2}, input_shape=(4, 1, 8, 8), input_dtype="float32")


@dataclasses.dataclass
class Net:
    owner: MemoryTransport
    stage: MemoryTransport
    stranger: MemoryTransport
    service: ExecutorService


@contextlib.asynccontextmanager
async def net(
    policy: ServicePolicy | None = None, registry: ModelRegistry | None = None
) -> AsyncIterator[Net]:
    hub: dict = {}
    owner, stage, stranger = (MemoryTransport(p, hub) for p in (OWNER, STAGE, STRANGER))
    policy = policy or ServicePolicy(limits=LIMITS, timeout=5.0)
    service = await ExecutorService(stage, policy, registry=registry).start()
    try:
        yield Net(owner, stage, stranger, service)
    finally:
        await service.aclose()
        for t in (owner, stage, stranger):
            await t.aclose()


async def ask(stream: FrameStream, header, body: bytes = b"") -> tuple[FrameKind, bytes]:
    await stream.send(FrameKind.DATA, pack_message(header, body), timeout=2)
    return await stream.recv(max_payload=1 << 20, timeout=2)


async def closed(stream: FrameStream, within: float = 2.0) -> bool:
    try:
        await stream.recv(max_payload=1 << 20, timeout=within)
    except PeerUnreachableError as e:
        return "closed" in str(e)
    return False


async def driver(n: Net) -> PipelineDriver:
    return await PipelineDriver.create(
        n.owner,
        SPEC,
        RuntimeLayout((OWNER, STAGE)),
        JobOptions(
            n_micro_batches=2,
            optimizer=OptimizerConfig(lr=0.1),
            loss="classification",
            timeout=5.0,
            limits=LIMITS,
        ),
    )


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(2)]


def test_a_declared_length_over_the_limit_is_refused_before_its_body() -> None:
    async def run() -> None:
        async with net() as n:
            stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            stream._writer.write(
                HEADER.pack(FRAME_VERSION, int(FrameKind.DATA), 512 << 20)
            )  # and nothing else
            kind, reply = await stream.recv(max_payload=1 << 20, timeout=2)
            assert kind is FrameKind.ERROR and b"oversized frame" in reply
            assert await closed(stream)
            assert n.service._budget.held == 0

    asyncio.run(run())


def test_a_stalled_frame_and_an_idle_stream_are_dropped() -> None:
    async def run() -> None:
        async with net() as n:
            stalled = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            stalled._writer.write(HEADER.pack(FRAME_VERSION, int(FrameKind.DATA), 100) + b"\x00")
            idle = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            start = time.monotonic()
            assert await closed(stalled) and await closed(idle)
            assert time.monotonic() - start < 1.5
            assert n.service._gate.open_streams() == 0

    asyncio.run(run())


def test_streams_per_peer_are_bounded() -> None:
    async def run() -> None:
        async with net() as n:
            streams = [await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2) for _ in range(3)]
            await asyncio.sleep(0.05)
            extra = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            kind, reply = await extra.recv(max_payload=4096, timeout=2)
            assert kind is FrameKind.ERROR and b"limit 3" in reply
            ok = await n.owner.open(STAGE, EXEC_PROTOCOL, timeout=2)  # another peer is still served
            assert (await ask(ok, ExecControl(command="ping", job="x")))[0] is FrameKind.ACK
            for s in [*streams, extra, ok]:
                await s.close()

    asyncio.run(run())


def _setup_body(family: str, config: dict, job: str = "evil") -> bytes:
    return stranger_setup(family, config, STRANGER, STAGE, job=job)


def test_an_unknown_family_is_refused_with_the_flag_that_enables_it() -> None:
    async def run() -> None:
        async with net() as n:
            stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            body = _setup_body("os:system", {"command": "touch /tmp/fusionp2p-pwned"})
            kind, reply = await ask(
                stream, ExecControl(command="setup", job="evil", body_bytes=len(body)), body
            )
            assert kind is FrameKind.ERROR
            assert b"'os:system' is not served" in reply and b"--allow-model os:system" in reply
            body = _setup_body("gpt2", {"command": "touch /tmp/fusionp2p-pwned"})
            kind, reply = await ask(
                stream, ExecControl(command="setup", job="evil", body_bytes=len(body)), body
            )
            assert kind is FrameKind.ERROR and b"no config key 'command'" in reply
            assert not n.service.jobs

    asyncio.run(run())


def test_a_stage_cannot_put_another_stages_optimizer_state_into_a_checkpoint() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            try:
                await d.train_step(batches())
                assert set(await d.fetch("state"))  # honest state is taken
                stage = n.service.jobs[d.job].executor
                honest = stage.full_state
                owners = next(p for p in d.partition.params[0] if "weight" in p)  # the data owner's
                poisoned = safetensors.torch.save(
                    {
                        **safetensors.torch.load(honest()),
                        f"{owners}#exp_avg": torch.full(d.executor.state.tensors[owners].shape, math.nan),
                    }
                )
                stage.full_state = lambda: poisoned
                with pytest.raises(ProtocolError, match="not this stage's"):
                    await d.fetch("state")
            finally:
                await d.aclose()

    asyncio.run(run())


def test_a_running_job_obeys_only_its_owner_and_takes_opdata_only_from_neighbours() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            try:
                await d.run_iteration(batches())
                job = d.job
                stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
                for command in ("step", "teardown", "fetch"):
                    header = ExecControl(command=command, job=job, what="params")
                    kind, reply = await ask(stream, header)
                    assert kind is FrameKind.ERROR and b"only the peer that set job" in reply, command
                weights = b"\x00" * 64
                kind, reply = await ask(
                    stream, ExecControl(command="weights", job=job, body_bytes=64), weights
                )
                assert kind is FrameKind.ERROR
                body = _setup_body("digits-cnn", {}, job="second")
                kind, reply = await ask(
                    stream, ExecControl(command="setup", job="second", body_bytes=len(body)), body
                )
                assert kind is FrameKind.ERROR and b"busy" in reply
                body = _setup_body("digits-cnn", {}, job=job)
                kind, reply = await ask(
                    stream, ExecControl(command="setup", job=job, body_bytes=len(body)), body
                )
                assert kind is FrameKind.ERROR and b"already set up" in reply
                forged = dataclasses.replace(first_forward(d.partition, job), micro_batch=1)
                kind, reply = await ask(stream, forged, bytes(forged.body_bytes))
                assert kind is FrameKind.ERROR and b"runs no stage 0" in reply
                await d.step()  # the job goes on, untouched
                assert len(await d.run_iteration(batches(1))) == 2
            finally:
                await d.aclose()
            assert not n.service.jobs  # teardown by its owner

    asyncio.run(run())


def test_a_stage_owner_that_leaves_fails_the_owners_iteration_at_once() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            try:
                header = ExecControl(command="leaving", job=d.job)
                stream = await n.stranger.open(OWNER, EXEC_PROTOCOL, timeout=2)
                kind, reply = await ask(stream, header)  # only a stage owner of the job may say it
                assert kind is FrameKind.ERROR and b"runs no stage of a job" in reply
                await d.train_step(batches())
                stream = await n.stage.open(OWNER, EXEC_PROTOCOL, timeout=2)
                assert (await ask(stream, header))[0] is FrameKind.ACK
                began = time.monotonic()
                with pytest.raises(ProtocolError, match="leaving the swarm"):
                    await d.run_iteration(batches(1))
                assert time.monotonic() - began < 2.0  # not at the 5 s timeout
                assert await d.unresponsive(1.0) == [STAGE]  # lost, though it still answers pings
            finally:
                await d.aclose()

    asyncio.run(run())


def test_a_duplicate_opdata_is_refused_before_its_body_is_read() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            try:
                header = first_forward(d.partition, d.job)
                stream = await n.owner.open(STAGE, EXEC_PROTOCOL, timeout=2)
                body = torch.zeros(header.shape).numpy().tobytes()
                assert (await ask(stream, header, body))[0] is FrameKind.ACK
                kind, reply = await ask(stream, header, body)
                assert kind is FrameKind.ERROR and b"duplicate" in reply
                bigger = dataclasses.replace(header, micro_batch=1, body_bytes=10 * header.body_bytes)
                kind, reply = await ask(stream, bigger, bytes(bigger.body_bytes))
                assert kind is FrameKind.ERROR  # declares more than the edge carries
            finally:
                await d.aclose()

    asyncio.run(run())


def test_a_silent_owner_loses_its_job_after_the_idle_timeout(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            assert n.service.jobs
            await asyncio.sleep(4 * LIMITS.job_idle_timeout)  # the reaper looks every idle timeout
            assert not n.service.jobs
            await d.service.aclose()

    with caplog.at_level("INFO", logger="fusionp2p"):
        asyncio.run(run())
    assert "nothing from its owner or neighbours" in caplog.text


def test_an_owner_that_only_fetches_does_not_keep_its_job_alive() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            stream = await n.owner.open(STAGE, EXEC_PROTOCOL, timeout=2)
            fetch = ExecControl(command="fetch", job=d.job, what="params")
            deadline = time.monotonic() + 4 * LIMITS.job_idle_timeout  # the reaper looks every idle timeout
            while n.service.jobs and time.monotonic() < deadline:
                await ask(stream, fetch)  # a stranger's trick to hold a peer: no progress, only reads
                await asyncio.sleep(LIMITS.job_idle_timeout / 4)
            assert not n.service.jobs
            await d.service.aclose()

    asyncio.run(run())


def test_a_job_whose_forward_waits_for_its_window_is_still_freed_when_its_owner_dies() -> None:
    async def run() -> None:
        async with net() as n:
            d = await driver(n)
            (job,) = n.service.jobs.values()
            assert job.setup.in_flight == 1  # the last of 2 stages holds one micro-batch
            header = dataclasses.replace(first_forward(d.partition, d.job), micro_batch=1)
            stream = await n.owner.open(STAGE, EXEC_PROTOCOL, timeout=2)
            body = torch.zeros(header.shape).numpy().tobytes()
            assert (await ask(stream, header, body))[0] is FrameKind.ACK
            await asyncio.sleep(0.1)
            assert job.gated == 1 and job.queued == 1  # micro-batch 1 waits for micro-batch 0's backward
            await asyncio.sleep(4 * LIMITS.job_idle_timeout)  # ... which never comes: the owner is silent
            assert not n.service.jobs and (job.queued, job.gated) == (0, 0)  # freed, its slot released
            await d.service.aclose()

    asyncio.run(run())


def test_private_swarm_takes_jobs_only_from_its_list() -> None:
    async def run() -> None:
        policy = ServicePolicy(limits=LIMITS, timeout=5.0, accept_jobs_from=frozenset({OWNER}))
        async with net(policy) as n:
            stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            body = _setup_body("digits-cnn", {})
            kind, reply = await ask(
                stream, ExecControl(command="setup", job="evil", body_bytes=len(body)), body
            )
            assert kind is FrameKind.ERROR and b"--accept-jobs-from" in reply
            d = await driver(n)  # the listed owner is served
            await d.aclose()

    asyncio.run(run())


def test_a_setup_whose_fake_trace_fails_is_refused_without_building_the_model() -> None:
    """The biggest digits CNN, with token ids (1 x 4) for input: no fake trace, and the peer
    never builds the ~100 MB model to find out its size."""

    async def setup(stream: FrameStream, channels: int) -> tuple[FrameKind, bytes]:
        body = _setup_body("digits-cnn", {"channels": channels}, job="no-fake")
        header = ExecControl(command="setup", job="no-fake", body_bytes=len(body))
        await stream.send(FrameKind.DATA, pack_message(header, body), timeout=2)
        return await stream.recv(max_payload=1 << 20, timeout=60)

    async def run() -> None:
        async with net() as n:
            stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
            await setup(stream, 1)  # the first trace in a process loads torch.export's machinery
            before = psutil.Process().memory_info().rss
            kind, reply = await setup(stream, 1024)
            assert kind is FrameKind.ERROR and b"cannot be traced without allocating" in reply
            assert psutil.Process().memory_info().rss - before < 50 << 20
            assert not n.service.jobs

    asyncio.run(run())


def test_a_stage_too_large_for_max_memory_is_refused() -> None:
    async def run() -> None:
        policy = ServicePolicy(limits=LIMITS, timeout=5.0, max_memory_bytes=200_000)
        async with net(policy) as n:
            with pytest.raises(Exception, match=r"needs .* more than the 195.3 KiB this peer allows"):
                await PipelineDriver.create(
                    n.owner,
                    ModelSpec(
                        "digits-cnn", {"channels": 64}, input_shape=(4, 1, 8, 8), input_dtype="float32"
                    ),
                    RuntimeLayout((OWNER, STAGE)),
                    JobOptions(loss="classification", timeout=5.0),
                )
            assert not n.service.jobs

    asyncio.run(run())


_GOOD = JobSetup(
    job="j1",
    spec=ModelSpec("gpt2", {}, input_shape=(1, 4)),
    peers=((OWNER, ()), (STAGE, ("/ip4/127.0.0.1/tcp/1",))),
    node_ranges=((0, 3), (3, 5)),
    stage=1,
    data_stage=0,
    n_micro_batches=2,
    optimizer=OptimizerConfig(name="sgd", lr=0.1),
    fingerprint="gpt2@0123456789abcdef:0123456789abcdef",
    ratios=((0, 4.0),),
    in_flight=2,
    ratio_warmup=RatioWarmup(20, 5),
).to_body()
_WRONG = [None, True, -1, 2**64 - 1, 1.5, "x" * 300, [], [[]], {}, {"a": [1]}, "../../etc"]
# a wrong value that decodes as the field's default: a config map missing every key
_HARMLESS = {("ratios", "[]"), ("restore", "[]"), ("averaging_peers", "[]"), ("averaging_s", "1.5")} | {
    (k, v) for k in ("optimizer", "ratio_warmup") for v in ("{}", "{'a': [1]}")
}


def _setup(body: dict) -> JobSetup:
    return JobSetup.from_wire(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("key", sorted(_GOOD))
def test_every_setup_field_of_a_wrong_type_is_a_record_error(key: str) -> None:
    assert _setup(_GOOD).assignment == (0, 0, 0, 1, 1)
    for wrong in _WRONG:
        try:
            _setup({**_GOOD, key: wrong})
        except RecordError:
            continue
        assert (key, repr(wrong)) in _HARMLESS, (key, wrong)


def test_a_setup_round_trips_and_refuses_a_newer_major_version() -> None:
    setup = _setup(_GOOD)
    assert JobSetup.from_wire(setup.to_wire()) == setup
    assert (setup.in_flight, setup.ratio_warmup) == (2, RatioWarmup(20, 5))
    with pytest.raises(RecordError, match=f"major version {JobSetup.VERSION + 1} is newer"):
        _setup({**_GOOD, "v": JobSetup.VERSION + 1})


def test_a_replicated_setup_names_its_group_and_the_peers_it_averages_with() -> None:
    other = "Qm" + "r" * 44
    good = {**_GOOD, "replicas": 2, "replica": 1, "group": "run-1", "averaging_peers": [other, STAGE]}
    setup = _setup(good)
    assert (setup.replicas, setup.replica, setup.averaging_peers) == (2, 1, (other, STAGE))
    assert JobSetup.from_wire(setup.to_wire()) == setup
    for wrong in (
        {"replica": 2},  # past the replicas
        {"group": ""},  # no group to average in
        {"averaging_peers": [other]},  # one peer for two replicas
        {"averaging_peers": [STAGE, other]},  # this stage's peer at the other replica's place
        {"averaging_peers": [other, "not-a-peer"]},
    ):
        with pytest.raises(RecordError, match=r"replica|averaging peers|group"):
            _setup({**good, **wrong})
    assert _setup({**good, "averaging_codec": "fp16"}).averaging_codec == "fp16"
    with pytest.raises(RecordError, match="averaging codec 'int4' is not one of"):
        _setup({**good, "averaging_codec": "int4"})


def test_a_replica_group_names_this_stage_among_the_replicas_left() -> None:
    group = ReplicaGroup(generation=2, replica=1, averaging_peers=(OWNER, STAGE))
    assert ReplicaGroup.from_wire(group.to_wire()) == group
    for wrong in (
        {"replica": 2},  # no such place
        {"averaging_peers": []},
        {"averaging_peers": [OWNER, "not-a-peer"]},
        {"generation": 0},  # a regroup starts a later generation than the setup's 0
    ):
        with pytest.raises(RecordError):
            ReplicaGroup.from_body({**group.to_body(), **wrong})


def test_setup_sizes_are_bounded() -> None:
    with pytest.raises(RecordError, match="at most"):
        _setup({**_GOOD, "peers": [[OWNER, []]] * 2000})
    with pytest.raises(RecordError, match=r"\[start, end\) pairs"):
        _setup({**_GOOD, "node_ranges": [[0, 1 << 30], [1 << 30, (1 << 30) + 1]]})
    with pytest.raises(RecordError, match="to two stages"):
        _setup({**_GOOD, "node_ranges": [[0, 3], [2, 5]]})
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(RecordError, match="levels"):
        _setup({**_GOOD, "spec": {**_GOOD["spec"], "config": {"x": deep}}})
    with pytest.raises(RecordError, match="exceeds the limit"):
        JobSetup.from_wire(b" " * (JobSetup.MAX_BYTES + 1))


def test_inbound_budget_holds_back_and_releases() -> None:
    async def run() -> None:
        budget = InboundBudget(total=100, per_peer=60)
        first = await budget.reserve("a", 50, timeout=1)
        with pytest.raises(LimitError, match="did not fit"):
            await budget.reserve("a", 20, timeout=0.1)  # over this peer's 60
        other = await budget.reserve("b", 50, timeout=1)  # another peer still fits the total
        waiting = asyncio.create_task(budget.reserve("c", 40, timeout=2))  # over the total of 100
        await asyncio.sleep(0.05)
        assert not waiting.done()
        first.release()
        first.release()  # idempotent
        (await waiting).release()
        other.release()
        alone = await budget.reserve("c", 1000, timeout=1)  # larger than any budget, but alone: admitted
        assert budget.held == 1000
        alone.release()
        assert budget.held == 0

    asyncio.run(run())


def test_malformed_message_headers_close_the_stream() -> None:
    async def run() -> None:
        async with net() as n:
            cases = [
                b"\xff\xff",  # header length beyond the frame
                struct.pack("!H", 3) + b"\x81\xa4kind" + b"\x91\x01",  # a list as kind
                pack_message(ExecControl(command="ping", job="x"))[:-1],
            ]
            for payload in cases:
                stream = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
                await stream.send(FrameKind.DATA, payload, timeout=2)
                kind, _ = await stream.recv(max_payload=4096, timeout=2)
                assert kind is FrameKind.ERROR
                assert await closed(stream)
            assert n.service.rejected == len(cases)

    asyncio.run(run())


def test_strangers_filling_every_stream_cannot_cut_a_job_off() -> None:
    async def run() -> None:
        limits = dataclasses.replace(LIMITS, streams_total=4, idle_timeout=5.0)
        async with net(ServicePolicy(limits=limits, timeout=5.0)) as n:
            d = await driver(n)
            try:
                hub = n.stranger._hub
                sybils = [MemoryTransport(f"Qm{i}" + "d" * 44, hub) for i in range(2)]
                held = [await s.open(STAGE, EXEC_PROTOCOL, timeout=2) for s in sybils for _ in range(3)]
                await asyncio.sleep(0.05)
                assert n.service._gate.open_streams() >= 4
                late = await n.stranger.open(STAGE, EXEC_PROTOCOL, timeout=2)
                kind, reply = await late.recv(max_payload=4096, timeout=2)
                assert kind is FrameKind.ERROR and b"inbound streams already open" in reply
                assert len(await d.run_iteration(batches())) == 2  # the job's streams still get through
                await d.step()
                for stream in held:
                    await stream.close()
            finally:
                await d.aclose()

    asyncio.run(run())


def test_one_data_owner_sets_up_one_job_at_a_time_even_on_a_peer_with_free_slots() -> None:
    policy = ServicePolicy(max_jobs=4)
    stranger, honest = "Qm" + "s" * 44, "Qm" + "h" * 44
    setting_up = {"job-a": stranger}
    with pytest.raises(LimitError, match="one setup at a time"):
        admit_setup(policy, {}, setting_up, stranger, "job-b")  # a second slot for the same identity
    admit_setup(policy, {}, setting_up, honest, "job-c")  # another data owner still gets one
    with pytest.raises(ProtocolError, match="already set up"):
        admit_setup(policy, {}, setting_up, honest, "job-a")
