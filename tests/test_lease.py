"""Every reader bounds a lease claim: a big epoch, a far-future lease or a holder that is no
(old enough) live peer counts for nothing, and coordination goes on around it."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import msgpack
import pytest
from hivemind.utils import get_dht_time
from job_helpers import peer_record

from fusionp2p.coordination.election import (
    EPOCH_STEP,
    FIRST_EPOCH,
    LeaseJudge,
    LeaseKeeper,
    read_lease,
)
from fusionp2p.errors import RecordError
from fusionp2p.records import LeaseRecord, PeerRecord

A, B, C, ATTACKER = ("Qm" + c * 44 for c in "abcz")
PERIOD = 0.4


def _lease(holder: str, epoch: int, ahead: float = PERIOD, period: float = PERIOD) -> LeaseRecord:
    now = get_dht_time()
    return LeaseRecord(
        holder=holder, epoch=epoch, granted_at=now - 1, valid_until=now + ahead, period_s=period
    )


def _live(*peers: str, age: float = 1e6) -> dict[str, PeerRecord]:
    """Live records of ``peers``, who joined ``age`` seconds ago."""
    now = get_dht_time()
    return {p: dataclasses.replace(peer_record(p), started_at=now - age) for p in peers}


def test_a_first_contact_takes_a_bounded_epoch_from_a_live_peer_and_then_steps() -> None:
    judge, now = LeaseJudge(), get_dht_time()
    assert judge.in_force([_lease(ATTACKER, 1 << 40)], _live(ATTACKER), now) is None
    assert judge.seen_epoch == 0  # a refused epoch counts for nothing
    assert judge.in_force([_lease(A, 5)], _live(A), now).holder == A
    assert judge.in_force([_lease(B, 5 + EPOCH_STEP + 1)], _live(A, B), now) is None
    assert judge.in_force([_lease(B, 5 + EPOCH_STEP)], _live(A, B), now).holder == B
    assert LeaseJudge().in_force([_lease(A, FIRST_EPOCH)], _live(A), now).epoch == FIRST_EPOCH


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("far ahead", "ahead"),
        ("long period", "lease period"),
        ("no peer", "no live peer"),
        ("new peer", "joined"),
    ],
)
def test_a_lease_out_of_bounds_or_of_no_live_peer_is_refused(case: str, why: str) -> None:
    lease = {
        "far ahead": _lease(ATTACKER, 2, ahead=1e9),
        "long period": _lease(ATTACKER, 2, period=1e6),
    }.get(case, _lease(ATTACKER, 2))
    live = {} if case == "no peer" else _live(ATTACKER, age=0.1 if case == "new peer" else 1e6)
    judge = LeaseJudge(seen_epoch=1)
    assert why in (judge.refusal(lease, live.get(lease.holder), get_dht_time()) or "")
    assert judge.in_force([lease], live, get_dht_time()) is None


def test_a_private_swarm_takes_the_lease_only_from_its_listed_coordinators() -> None:
    judge, now = LeaseJudge(allowed=frozenset({A})), get_dht_time()
    assert judge.in_force([_lease(B, 3)], _live(A, B), now) is None
    assert judge.in_force([_lease(B, 4), _lease(A, 3)], _live(A, B), now).holder == A


def test_a_dead_coordinators_epoch_is_never_claimed_again() -> None:
    judge, now = LeaseJudge(), get_dht_time()
    gone = LeaseRecord(holder=A, epoch=7, granted_at=now - 60, valid_until=now - 30, period_s=PERIOD)
    assert judge.in_force([gone], {}, now) is None and judge.seen_epoch == 7


def test_an_epoch_that_does_not_fit_is_malformed_on_the_wire() -> None:
    body = msgpack.unpackb(_lease(ATTACKER, 3).to_wire())
    for epoch in (2**64 - 1, 2**53 + 1, 0):
        with pytest.raises(RecordError, match="epoch"):
            LeaseRecord.from_wire(msgpack.packb({**body, "epoch": epoch}))


class _Directory:
    """The lease part of a SwarmDirectory, in memory, with the live peers' records."""

    def __init__(self, live: dict[str, PeerRecord], flaky: int = 0) -> None:
        self.entries: dict[str, LeaseRecord] = {}
        self.live = live
        self.flaky = flaky  # this many reads fail with a bug-like error first

    async def publish_lease(self, record: LeaseRecord, expiration: float) -> bool:
        self.entries[record.holder] = record
        return True

    async def fetch_leases(self) -> list[LeaseRecord]:
        if self.flaky:
            self.flaky -= 1
            raise RuntimeError("a bug in a lease round")
        return list(self.entries.values())

    async def fetch_peer(self, peer_id: str) -> PeerRecord | None:
        return self.live.get(peer_id)


def test_keepers_elect_around_a_huge_far_future_lease_and_survive_a_crashing_round() -> None:
    directory = _Directory(_live(A, B, C, ATTACKER), flaky=3)
    now = get_dht_time()
    directory.entries[ATTACKER] = LeaseRecord(
        holder=ATTACKER, epoch=1 << 40, granted_at=now, valid_until=now + 1e9, period_s=PERIOD
    )
    keepers = [
        LeaseKeeper(directory, p, lease_s=PERIOD, rng=random.Random(i))  # type: ignore[arg-type]
        for i, p in enumerate((A, B, C))
    ]

    async def run() -> None:
        tasks = [asyncio.create_task(k.run()) for k in keepers]
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if any(k.holds() for k in keepers):
                    break
            holders = [k for k in keepers if k.holds()]
            assert len(holders) == 1 and holders[0].epoch == 1
            assert all(not t.done() for t in tasks)  # the crashing rounds killed no keeper
            lease = await read_lease(directory, LeaseJudge())  # type: ignore[arg-type]
            assert lease is not None and lease.holder == holders[0].peer_id
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
