"""The coordinator protocol's rules, in memory: every refusal says why, and one identity holds
at most one place in the planning queue."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from job_helpers import peer_record

from fusionp2p.coordination.coordinator import Coordinator
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

    async def fetch_plans(self, job: str) -> dict:
        record = PlanStageRecord(job, 1, 0, 1, OTHER, "gpt2@x", (0, 4), {}, 2, 0.1, COORDINATOR, 0.0, OWNER)
        return {(1, COORDINATOR): [record]} if job == "taken" else {}


def _coordinator(hub: dict) -> Coordinator:
    transport = MemoryTransport(COORDINATOR, hub)
    return Coordinator(transport, _Plans(), _Keeper(), ModelRegistry(), timeout=30)  # type: ignore[arg-type]


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
            assert kind is FrameKind.ERROR and b"planning failed: RuntimeError" in reply
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


def test_one_identity_holds_one_place_in_the_planning_queue() -> None:
    async def run() -> None:
        coordinator = _coordinator({})
        planning, release = asyncio.Event(), asyncio.Event()
        planned: list[str] = []

        async def slow_plan(request: JobRequest) -> JobReply:  # a heavy trace, held open
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
