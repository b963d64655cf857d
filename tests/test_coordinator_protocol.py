"""The coordinator protocol's rules, in memory: every refusal says why, one identity holds
at most one place in the planning queue, the lightest model is planned next, and a trace
over the operator's budget is cut off, so a flood of heavy requests does not starve a light one."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from job_helpers import peer_record

from fusionp2p.config import TraceBudget
from fusionp2p.coordination.coordinator import Coordinator
from fusionp2p.coordination.queue import PlanningQueue
from fusionp2p.coordination.trace_budget import TraceJob
from fusionp2p.errors import ConfigError, LimitError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.memory_transport import MemoryTransport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.records import COORD_PROTOCOL, JobReply, JobRequest, ModelSpec, PlanStageRecord

COORDINATOR, OWNER, OTHER = ("Qm" + c * 44 for c in "cab")


class _Keeper:
    epoch = 1

    def holds(self) -> bool:
        return True


def _request(owner: str, spec: ModelSpec) -> JobRequest:
    return JobRequest(
        f"job-{owner[-4:]}", spec, 2, "none", "op-fence", peer_record(owner), (), max_ratio=20.0
    )


class _Plans:
    """The plans part of a SwarmDirectory: one job id already planned for OWNER."""

    async def fetch_all_plans(self) -> dict:
        """Job "taken", and replica 1 of job "replica-taken", planned for OWNER."""
        return {
            (job, 1, COORDINATOR): [
                PlanStageRecord(job, 1, 0, 1, OTHER, "gpt2@x", (0, 4), {}, 2, 0.1, COORDINATOR, 0.0, OWNER)
            ]
            for job in ("taken", "replica-taken-r1")
        }

    async def fetch_peers(self, **_: object) -> dict:  # the lease holder's view: an empty swarm
        return {}

    async def fetch_links_by_source(self, sources: list[str], **_: object) -> dict:
        return {}


def _coordinator(hub: dict, budget: TraceBudget | None = None) -> Coordinator:
    transport = MemoryTransport(COORDINATOR, hub)
    return Coordinator(
        transport,
        _Plans(),  # type: ignore[arg-type]
        _Keeper(),  # type: ignore[arg-type]
        ModelRegistry(),
        timeout=30,
        budget=budget,
    )


def test_a_request_whose_model_cannot_be_traced_gets_an_error_reply() -> None:
    async def run() -> None:
        hub: dict = {}
        coordinator = await _coordinator(hub).start()
        owner = MemoryTransport(OWNER, hub)
        try:
            spec = ModelSpec("digits-cnn", {}, input_shape=(1, 4))  # token ids into a CNN: no trace
            stream = await owner.open(COORDINATOR, COORD_PROTOCOL, timeout=5)
            await stream.send(FrameKind.DATA, _request(OWNER, spec).to_wire(), timeout=5)
            kind, reply = await stream.recv(max_payload=JobReply.MAX_BYTES, timeout=60)
            assert kind is FrameKind.ERROR and b"tracing the model failed: RuntimeError" in reply
        finally:
            await coordinator.aclose()
            await owner.aclose()

    asyncio.run(run())


def test_a_job_id_belongs_to_the_data_owner_it_was_planned_for() -> None:
    coordinator = Coordinator(
        MemoryTransport(COORDINATOR, {}),
        _Plans(),
        _Keeper(),
        ModelRegistry(),  # type: ignore[arg-type]
    )
    spec = ModelSpec("gpt2", {}, input_shape=(1, 4))
    taken = dataclasses.replace(_request(OTHER, spec), job="taken")
    with pytest.raises(ConfigError, match="belongs to another data owner"):
        asyncio.run(coordinator._check_job_id(taken))
    asyncio.run(coordinator._check_job_id(dataclasses.replace(taken, owner=peer_record(OWNER))))
    # a replica's plan claims its job's id too, and not a mere prefix of it
    with pytest.raises(ConfigError, match="belongs to another data owner"):
        asyncio.run(coordinator._check_job_id(dataclasses.replace(taken, job="replica-taken")))
    asyncio.run(coordinator._check_job_id(dataclasses.replace(taken, job="replica")))


def test_one_identity_holds_one_place_in_the_planning_queue() -> None:
    async def run() -> None:
        coordinator = _coordinator({})
        planning, release = asyncio.Event(), asyncio.Event()
        planned: list[str] = []

        async def slow_plan(request: JobRequest, job: TraceJob) -> JobReply:  # a heavy trace, held open
            planning.set()
            await release.wait()
            planned.append(request.owner.peer_id)
            return JobReply(request.job, 1, 1, COORDINATOR, (request.owner,), ())

        coordinator._plan = slow_plan  # type: ignore[method-assign]
        spec = ModelSpec("gpt2", {}, input_shape=(1, 4))
        first = asyncio.create_task(coordinator.submit(_request(OWNER, spec)))
        await planning.wait()
        with pytest.raises(LimitError, match="one at a time"):
            await coordinator.submit(_request(OWNER, spec))  # the same identity again
        other = asyncio.create_task(coordinator.submit(_request(OTHER, spec)))  # another waits its turn
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(first, other)
        assert planned == [OWNER, OTHER]

    asyncio.run(run())


def test_the_queue_plans_the_lightest_next_and_a_full_queue_keeps_the_lightest() -> None:
    async def run() -> None:
        queue, order = PlanningQueue(capacity=2), []
        release = asyncio.Event()

        async def job(name: str, weight: int) -> None:
            async with queue.turn(weight):
                order.append(name)
                await release.wait()

        running = asyncio.create_task(job("first", 50))
        await asyncio.sleep(0)
        heavy = asyncio.create_task(job("heavy", 40))
        medium = asyncio.create_task(job("medium", 20))
        await asyncio.sleep(0)
        light = asyncio.create_task(job("light", 10))  # full: takes the heaviest's place
        await asyncio.sleep(0)
        with pytest.raises(LimitError, match="2 jobs are waiting"):
            await job("heavier", 30)  # heavier than everyone waiting: refused
        with pytest.raises(LimitError, match="smaller model took this one's place"):
            await heavy
        release.set()
        await asyncio.gather(running, medium, light)
        assert order == ["first", "light", "medium"] and len(queue) == 0

    asyncio.run(run())


def _gpt2(n_layer: int, seq: int) -> ModelSpec:
    config = {"n_layer": n_layer, "n_embd": 256, "n_head": 4, "vocab_size": 1024, "n_positions": seq}
    return ModelSpec("gpt2", config, input_shape=(1, seq))


@pytest.mark.slow
def test_a_flood_of_heavy_requests_does_not_starve_a_light_one() -> None:
    """Five identities ask for a model whose trace runs past the operator's 3 s budget, an
    honest data owner asks for a small one just after: it is planned next, and every heavy
    trace is cut off at the budget instead of running to its end."""

    async def run() -> None:
        coordinator = _coordinator({}, TraceBudget(seconds=3.0, size_seconds=60.0))
        traced: list[str] = []

        async def plan(request: JobRequest, job: TraceJob) -> JobReply:
            await job.trace()
            traced.append(request.owner.peer_id)
            return JobReply(request.job, 1, 1, COORDINATOR, (request.owner,), ())

        coordinator._plan = plan  # type: ignore[method-assign]
        flood = ["Qm" + chr(ord("d") + i) * 44 for i in range(5)]
        heavy = [asyncio.create_task(coordinator.submit(_request(o, _gpt2(96, 1024)))) for o in flood]
        await asyncio.sleep(0.5)
        honest = asyncio.create_task(coordinator.submit(_request(OWNER, _gpt2(2, 16))))
        loop = asyncio.get_running_loop()
        began = loop.time()
        reply = await asyncio.wait_for(honest, 120)
        honest_s = loop.time() - began
        results = await asyncio.gather(*heavy, return_exceptions=True)
        assert reply.coordinator == COORDINATOR and traced == [OWNER]
        assert all(isinstance(r, LimitError) for r in results), results
        cut = [r for r in results if "took more than 3 s" in str(r)]
        assert cut and all("jobs are waiting" in str(r) or r in cut for r in results)
        # planned ahead of the heavy ones that waited: at most the one trace in progress before it
        assert honest_s < 30, honest_s

    asyncio.run(run())
