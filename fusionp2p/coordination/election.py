"""Coordinator election: one expiring lease in the DHT, fenced by a growing epoch.

Every candidate writes only its own signed subkey of ``{swarm}.coordinator`` (the DHT
keeps, per subkey, the entry with the highest expiration, so a renewal always carries a
later one). A ``LeaseRecord`` says who holds which epoch until when; the lease in force is
the valid one with the highest epoch (ties: the lowest PeerID). Entries stay in the DHT
for ``KEEP_PERIODS`` lease periods after they stop being valid, so the epoch a new holder
claims is above every recent one. A holder renews every third of a period; when its lease
runs out (the holder died or left) each candidate waits a random part of a period, then
claims ``highest epoch + 1`` and reads back: one of two simultaneous claimants yields.

Anyone who can write to the DHT can write a lease of its own, so every reader bounds
what it accepts (``LeaseJudge``): a lease valid at most ``HORIZON_PERIODS`` periods ahead
of the reader's clock, an epoch at most ``EPOCH_STEP`` above the highest the reader
accepted before (at most ``FIRST_EPOCH`` on first contact), held by a live peer that has
been in the swarm for at least one lease period (and, in a private swarm, one of the
reader's listed coordinators). A refused lease counts for nothing, not
even for the next epoch's number, so epochs stay far below ``records.MAX_EPOCH``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from fusionp2p.config import MAX_LEASE_SECONDS, PeerConfig
from fusionp2p.errors import CoordinatorError, FusionP2PError
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.records import MAX_EPOCH, LeaseRecord, PeerRecord

__all__ = [
    "EPOCH_STEP",
    "FIRST_EPOCH",
    "HORIZON_PERIODS",
    "KEEP_PERIODS",
    "LeaseJudge",
    "LeaseKeeper",
    "find_coordinator",
    "lease_in_force",
    "read_lease",
]

logger = logging.getLogger(__name__)

KEEP_PERIODS = 10  # lease periods an entry outlives its validity in the DHT
HORIZON_PERIODS = 3  # a lease may be valid at most this many of its periods ahead
EPOCH_STEP = 8  # an epoch may be at most this far above the highest a reader accepted
FIRST_EPOCH = 1 << 32  # ... and at most this on a reader's first contact with the swarm
CLOCK_SKEW_S = 3.0  # how far another peer's clock may be off (the DHT refuses more)
MAX_LEASE_READS = 8  # holders whose records a reader looks up, highest epochs first
DEFAULT_PERIOD_S = PeerConfig().lease_seconds  # the period of a lease that names none


def lease_in_force(leases: Sequence[LeaseRecord], now: float) -> LeaseRecord | None:
    """Of ``leases`` (already judged acceptable), the one that holds at DHT time ``now``:
    valid, highest epoch, then lowest PeerID."""
    valid = [lease for lease in leases if lease.valid_until > now]
    if not valid:
        return None
    return min(valid, key=lambda lease: (-lease.epoch, lease.holder))


@dataclass
class LeaseJudge:
    """What one reader accepts of the lease entries it reads; it remembers the highest
    epoch it accepted, so an epoch far above it is refused however it is signed."""

    seen_epoch: int = 0  # the highest epoch of an acceptable lease this reader read
    allowed: frozenset[str] = frozenset()  # the only holders this reader accepts (empty: any)

    def _numbers_refusal(self, lease: LeaseRecord, now: float) -> str | None:
        period = lease.period_s or DEFAULT_PERIOD_S
        if not 0 < period <= MAX_LEASE_SECONDS:
            return f"a lease period of {period:g} s (at most {MAX_LEASE_SECONDS:g} s)"
        if lease.valid_until > now + HORIZON_PERIODS * period + CLOCK_SKEW_S:
            return f"valid {lease.valid_until - now:.0f} s ahead, more than {HORIZON_PERIODS} periods"
        if lease.granted_at > now + CLOCK_SKEW_S:
            return "granted in the future"
        most = self.seen_epoch + EPOCH_STEP if self.seen_epoch else FIRST_EPOCH
        if lease.epoch > most:
            return f"epoch {lease.epoch} above {most}"
        return None

    def refusal(self, lease: LeaseRecord, holder: PeerRecord | None, now: float) -> str | None:
        """Why ``lease`` (held by ``holder``'s live record, or None) is refused at ``now``;
        None if it is acceptable."""
        why = self._numbers_refusal(lease, now)
        if why is not None:
            return why
        if self.allowed and lease.holder not in self.allowed:
            return "its holder is not one of this reader's coordinators"
        if holder is None:
            return "its holder is no live peer"
        period = lease.period_s or DEFAULT_PERIOD_S
        if now - holder.started_at < period:
            return f"its holder joined {max(0.0, now - holder.started_at):.0f} s ago, less than a period"
        return None

    def in_force(
        self, leases: Sequence[LeaseRecord], holders: Mapping[str, PeerRecord], now: float
    ) -> LeaseRecord | None:
        """The lease in force among the acceptable ones of ``leases`` (``holders``: the live
        records of their holders). The highest epoch among those whose numbers are in
        bounds is remembered, whoever holds them (a dead coordinator's epoch is never
        claimed again)."""
        accepted, numbered = [], []
        for lease in leases:
            if self._numbers_refusal(lease, now) is not None:
                continue
            numbered.append(lease.epoch)
            why = self.refusal(lease, holders.get(lease.holder), now)
            if why is None:
                accepted.append(lease)
            elif lease.valid_until > now:
                logger.debug("ignoring %s's lease of epoch %d: %s", lease.holder[-8:], lease.epoch, why)
        self.seen_epoch = max([self.seen_epoch, *numbered])
        return lease_in_force(accepted, now)


async def holder_records(directory: SwarmDirectory, leases: Sequence[LeaseRecord]) -> dict[str, PeerRecord]:
    """The live records of the holders of the ``MAX_LEASE_READS`` highest epochs."""
    holders = list(dict.fromkeys(lease.holder for lease in sorted(leases, key=lambda le: -le.epoch)))
    found = await asyncio.gather(*(directory.fetch_peer(h) for h in holders[:MAX_LEASE_READS]))
    return {record.peer_id: record for record in found if record is not None}


async def read_lease(directory: SwarmDirectory, judge: LeaseJudge) -> LeaseRecord | None:
    """The lease in force as ``judge`` reads the DHT now, or None."""
    leases = await directory.fetch_leases()
    return judge.in_force(leases, await holder_records(directory, leases), get_dht_time())


class LeaseKeeper:
    """Runs one peer's candidacy: takes the lease when it is free, renews it while held.

    ``holds()`` says whether this peer is the coordinator now (its own lease valid and in
    force at the last read, with a margin); ``epoch`` is the epoch it holds.
    """

    def __init__(
        self,
        directory: SwarmDirectory,
        peer_id: str,
        *,
        lease_s: float,
        maddrs: Callable[[], Sequence[str]] = tuple,
        rng: random.Random | None = None,
        judge: LeaseJudge | None = None,
    ) -> None:
        self.directory = directory
        self.peer_id = peer_id
        self.lease_s = lease_s
        self.judge = judge or LeaseJudge()
        self._maddrs = maddrs
        self._rng = rng or random.Random()
        self._held: LeaseRecord | None = None
        self._expiration = 0.0

    @property
    def epoch(self) -> int:
        return self._held.epoch if self._held is not None else 0

    def holds(self) -> bool:
        """Whether this peer holds the lease, with a tenth of a period to spare."""
        held = self._held
        return held is not None and held.valid_until - 0.1 * self.lease_s > get_dht_time()

    async def _judged(self, *extra: LeaseRecord) -> LeaseRecord | None:
        """The lease in force with ``extra`` (this peer's own last write) among the DHT's."""
        leases = [*await self.directory.fetch_leases(), *extra]
        holders = await holder_records(self.directory, leases)
        if self.peer_id not in holders and (own := await self.directory.fetch_peer(self.peer_id)):
            holders[self.peer_id] = own
        return self.judge.in_force(leases, holders, get_dht_time())

    async def _write(self, epoch: int, granted_at: float, *, lasts: float | None = None) -> LeaseRecord:
        now = get_dht_time()
        record = LeaseRecord(
            holder=self.peer_id,
            epoch=epoch,
            granted_at=min(granted_at, now),
            valid_until=now + (self.lease_s if lasts is None else lasts),
            maddrs=tuple(self._maddrs())[:8],
            period_s=self.lease_s,
        )
        self._expiration = max(now + KEEP_PERIODS * self.lease_s, self._expiration + 1e-3)
        await self.directory.publish_lease(record, self._expiration)
        return record

    def _set(self, held: LeaseRecord | None) -> None:
        if held is not None and (self._held is None or held.epoch != self._held.epoch):
            logger.info("this peer is the coordinator (epoch %d)", held.epoch)
        self._held = held

    async def step(self) -> None:
        """One round: renew the lease if held, else claim it when it is free."""
        if self._held is not None:  # renew first, then look: a slow read must not let it lapse
            renewed = await self._write(self._held.epoch, self._held.granted_at)
            current = await self._judged(renewed)
            if current is not None and current.holder != self.peer_id:
                logger.info("coordinator lease lost to %s (epoch %d)", current.holder[-8:], current.epoch)
                self._set(None)
            else:
                self._set(renewed)
            return
        if await self._judged() is not None:
            return
        own = await self.directory.fetch_peer(self.peer_id)
        if own is None or get_dht_time() - own.started_at < self.lease_s:
            return  # readers take a lease only from a peer a period old: wait until this one is
        await asyncio.sleep(self._rng.uniform(0.0, 0.5 * self.lease_s))  # no stampede
        if await self._judged() is not None:
            return
        epoch = self.judge.seen_epoch + 1
        if epoch > MAX_EPOCH:  # unreachable: accepted epochs grow by at most EPOCH_STEP a read
            logger.error("the swarm's lease epochs reached %d; no higher epoch can be claimed", epoch - 1)
            return
        claim = await self._write(epoch, get_dht_time())
        winner = await self._judged(claim)
        if winner is not None and winner.holder == self.peer_id and winner.epoch == epoch:
            self._set(claim)
        else:
            logger.info("lost the coordinator election for epoch %d", epoch)

    async def release(self) -> None:
        """Ends a held lease now (a peer leaving), so another peer takes over at once."""
        held, self._held = self._held, None
        if held is not None:
            await self._write(held.epoch, held.granted_at, lasts=0.0)
            logger.info("released the coordinator lease (epoch %d)", held.epoch)

    async def run(self) -> None:
        """Steps every third of a lease period until cancelled. A failing round is logged
        (with its traceback when it is not a DHT error) and the next one runs: this task
        never dies while the peer lives."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.step()
            except (TimeoutError, FusionP2PError, OSError) as e:
                logger.warning("coordinator lease round failed, will retry: %s", e)
            except Exception:
                logger.exception("coordinator lease round crashed; the next round runs as usual")
            took = loop.time() - began
            if self._held is not None and took > self.lease_s / 3:
                logger.warning("a lease round took %.1f s of a %.1f s lease", took, self.lease_s)
            await asyncio.sleep(max(0.05, self.lease_s / 3 - took))


async def find_coordinator(
    directory: SwarmDirectory, *, timeout: float, judge: LeaseJudge | None = None, poll_s: float = 0.5
) -> LeaseRecord:
    """The lease in force, waiting up to ``timeout`` s for one.

    Raises:
        CoordinatorError: no peer held the lease within ``timeout``.
    """
    judge = judge or LeaseJudge()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        lease = await read_lease(directory, judge)
        if lease is not None:
            return lease
        if loop.time() >= deadline:
            raise CoordinatorError(
                f"no coordinator within {timeout:.0f} s: no live peer holds the swarm's lease "
                "(are all peers started with --no-coordinator?)"
            )
        await asyncio.sleep(poll_s)
