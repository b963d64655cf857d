"""A stage runs a setup only if it is the coordinator's published plan as a runtime runs it:
the same stage owners, positions, Top-K ratios and micro-batches in flight."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hivemind.utils import get_dht_time
from job_helpers import peer_record

from fusionp2p.config import OptimizerConfig
from fusionp2p.coordination.election import LeaseJudge
from fusionp2p.coordination.plan_check import check_planned_setup, published_layout
from fusionp2p.errors import ProtocolError
from fusionp2p.records import JobSetup, LeaseRecord, ModelSpec, PeerRecord, PlanStageRecord

OWNER, B, C, COORDINATOR = ("Qm" + c * 44 for c in "abcd")
EPOCH = 3


def _stage(k: int, peer: str, ranges: tuple[int, ...], links: dict[str, float]) -> PlanStageRecord:
    return PlanStageRecord(
        "job-1", EPOCH, k, 2, peer, "gpt2@fp", ranges, links, 4, 0.5, COORDINATOR, 0.0, OWNER
    )


PLAN = [_stage(0, B, (0, 3), {"1": 4.0}), _stage(1, C, (3, 5), {})]
D, E = ("Qm" + c * 44 for c in "ef")
# the same split as two replicas: replica 0 on B and C, replica 1 on D and E
REPLICAS = [
    dataclasses.replace(r, plan_id=f"job-1-r{k}", peer_id=peer, replicas=2, replica=k)
    for k, peers in enumerate(((B, C), (D, E)))
    for r, peer in zip(PLAN, peers, strict=True)
]


class _Directory:
    """The lease and the plans a stage reads from the DHT."""

    async def fetch_all_plans(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        plans: dict[tuple[str, int, str], list[PlanStageRecord]] = {("job-1", EPOCH, COORDINATOR): PLAN}
        for r in REPLICAS:
            plans.setdefault((r.plan_id, EPOCH, COORDINATOR), []).append(r)
        return plans

    async def fetch_leases(self) -> list[LeaseRecord]:
        return [LeaseRecord(COORDINATOR, EPOCH, 0.0, get_dht_time() + 10, period_s=10.0)]

    async def fetch_peer(self, peer_id: str) -> PeerRecord | None:
        return peer_record(peer_id) if peer_id == COORDINATOR else None

    async def fetch_plans(self, job: str) -> dict[tuple[int, str], list[PlanStageRecord]]:
        return {(EPOCH, COORDINATOR): PLAN} if job == "job-1" else {}


def _setup(**changes: object) -> JobSetup:
    """What the data owner sends B for the plan (runtime stage 1)."""
    setup = JobSetup(
        job="job-1",
        spec=ModelSpec("gpt2", {}, (1, 4)),
        peers=((OWNER, ()), (B, ()), (C, ())),
        node_ranges=((), (0, 3), (3, 5)),
        stage=1,
        data_stage=0,
        n_micro_batches=4,
        optimizer=OptimizerConfig(),
        fingerprint="gpt2@fp",
        ratios=((2, 4.0),),
        in_flight=2,
        epoch=EPOCH,
    )
    return dataclasses.replace(setup, **changes)


def _check(setup: JobSetup, me: str = B) -> None:
    asyncio.run(check_planned_setup(_Directory(), setup, sender=OWNER, me=me, judge=LeaseJudge()))


def test_the_published_plan_as_a_runtime_runs_it() -> None:
    layout = published_layout(PLAN, OWNER)
    assert layout.peers == (OWNER, B, C)
    assert tuple(layout.assignment) == (1, 1, 1, 2, 2)
    assert dict(layout.ratios) == {(1, 2): 4.0}
    assert layout.in_flight == (3, 2, 1)  # the data owner's window, then 1F1B's depths
    with pytest.raises(ProtocolError, match="links to"):
        published_layout([_stage(0, B, (0, 3), {"7": 4.0}), PLAN[1]], OWNER)


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"ratios": ((2, 8.0),)}, "Top-K ratios"),
        ({"ratios": ()}, "Top-K ratios"),
        ({"in_flight": 1}, "in flight"),
        ({"node_ranges": ((), (0, 2), (2, 5))}, "other nodes"),
        ({"peers": ((OWNER, ()), (B, ()), ("Qm" + "e" * 44, ()))}, "stage owners"),
        ({"epoch": EPOCH - 1}, "epoch"),
        ({"n_micro_batches": 8, "in_flight": 2}, "micro-batches"),
    ],
)
def test_a_setup_that_is_not_the_plan_is_refused(changes: dict, refusal: str) -> None:
    _check(_setup())  # the plan itself is taken
    with pytest.raises(ProtocolError, match=refusal):
        _check(_setup(**changes))


def test_a_setup_from_someone_but_the_plans_data_owner_is_refused() -> None:
    with pytest.raises(ProtocolError, match="data owner"):
        asyncio.run(check_planned_setup(_Directory(), _setup(), sender=C, me=B, judge=LeaseJudge()))


def _replica_setup(replica: int, **changes: object) -> JobSetup:
    """What the data owner sends the peer of runtime stage 1 in replica ``replica``."""
    owners = ((B, C), (D, E))[replica]
    fields: dict[str, object] = {
        "job": f"job-1-r{replica}",
        "peers": ((OWNER, ()), (owners[0], ()), (owners[1], ())),
        "replicas": 2,
        "replica": replica,
        "group": "job-1",
        "averaging_peers": (B, D),
    }
    return _setup(**{**fields, **changes})


def test_a_replica_averages_only_with_the_peers_the_plan_gives_its_stage() -> None:
    """A replica's setup is checked against its own replica's plan, and whom it averages
    with against the other replicas' plans of the same epoch."""
    _check(_replica_setup(0), me=B)
    _check(_replica_setup(1), me=D)
    with pytest.raises(ProtocolError, match="averages with"):
        _check(_replica_setup(1, averaging_peers=(C, D)), me=D)  # C runs stage 2 in replica 0
    with pytest.raises(ProtocolError, match="replica 0 of 3, the plan 0 of 2"):
        _check(_replica_setup(0, replicas=3, averaging_peers=(B, D, E)), me=B)
    with pytest.raises(ProtocolError, match="not the name of replica 1"):
        _check(_replica_setup(1, job="job-1-r7"), me=D)
    with pytest.raises(ProtocolError, match="averages with codec 'fp16', the plan with \\['none'\\]"):
        _check(_replica_setup(0, averaging_codec="fp16"), me=B)  # the plan sends fp32
