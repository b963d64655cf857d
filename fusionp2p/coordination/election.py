"""Coordinator election: one expiring lease in the DHT, fenced by a growing epoch.

Every candidate writes only its own signed subkey of ``{swarm}.coordinator`` (the DHT
keeps, per subkey, the entry with the highest expiration, so a renewal always carries a
later one). A ``LeaseRecord`` says who holds which epoch until when; the lease in force is
the valid one with the highest epoch (ties: the lowest PeerID). Entries stay in the DHT
for ``KEEP_PERIODS`` lease periods after they stop being valid, so the epoch a new holder
claims is above every recent one. A holder renews every third of a period; when its lease
runs out (the holder died or left) each candidate waits a random part of a period, then
claims ``highest epoch + 1`` and reads back: one of two simultaneous claimants yields.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

from hivemind.utils import get_dht_time

from fusionp2p.errors import CoordinatorError, FusionP2PError
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.records import LeaseRecord

__all__ = ["KEEP_PERIODS", "LeaseKeeper", "find_coordinator", "highest_epoch", "lease_in_force"]

logger = logging.getLogger(__name__)

KEEP_PERIODS = 10  # lease periods an entry outlives its validity in the DHT


def lease_in_force(leases: Sequence[LeaseRecord], now: float) -> LeaseRecord | None:
    """The lease that holds at DHT time ``now``: valid, highest epoch, then lowest PeerID."""
    valid = [lease for lease in leases if lease.valid_until > now]
    if not valid:
        return None
    return min(valid, key=lambda lease: (-lease.epoch, lease.holder))


def highest_epoch(leases: Sequence[LeaseRecord]) -> int:
    """The highest epoch any lease entry names (0 when there is none)."""
    return max((lease.epoch for lease in leases), default=0)


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
    ) -> None:
        self.directory = directory
        self.peer_id = peer_id
        self.lease_s = lease_s
        self._maddrs = maddrs
        self._rng = rng or random.Random()
        self._held: LeaseRecord | None = None
        self._seen_epoch = 0
        self._expiration = 0.0

    @property
    def epoch(self) -> int:
        return self._held.epoch if self._held is not None else 0

    def holds(self) -> bool:
        """Whether this peer holds the lease, with a tenth of a period to spare."""
        held = self._held
        return held is not None and held.valid_until - 0.1 * self.lease_s > get_dht_time()

    async def leases(self) -> list[LeaseRecord]:
        leases = await self.directory.fetch_leases()
        self._seen_epoch = max(self._seen_epoch, highest_epoch(leases))
        return leases

    async def _write(self, epoch: int, granted_at: float, *, lasts: float | None = None) -> LeaseRecord:
        now = get_dht_time()
        record = LeaseRecord(
            holder=self.peer_id,
            epoch=epoch,
            granted_at=min(granted_at, now),
            valid_until=now + (self.lease_s if lasts is None else lasts),
            maddrs=tuple(self._maddrs())[:8],
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
            current = lease_in_force([*await self.leases(), renewed], get_dht_time())
            if current is not None and current.holder != self.peer_id:
                logger.info("coordinator lease lost to %s (epoch %d)", current.holder[-8:], current.epoch)
                self._set(None)
            else:
                self._set(renewed)
            return
        if lease_in_force(await self.leases(), get_dht_time()) is not None:
            return
        await asyncio.sleep(self._rng.uniform(0.0, 0.5 * self.lease_s))  # no stampede
        leases = await self.leases()
        if lease_in_force(leases, get_dht_time()) is not None:
            return
        epoch = self._seen_epoch + 1
        claim = await self._write(epoch, get_dht_time())
        leases = await self.leases()
        winner = lease_in_force([*leases, claim], get_dht_time())
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
        """Steps every third of a lease period until cancelled; DHT errors are retried."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.step()
            except (FusionP2PError, asyncio.TimeoutError, OSError) as e:
                logger.warning("coordinator lease round failed, will retry: %s", e)
            took = loop.time() - began
            if self._held is not None and took > self.lease_s / 3:
                logger.warning("a lease round took %.1f s of a %.1f s lease", took, self.lease_s)
            await asyncio.sleep(max(0.05, self.lease_s / 3 - took))


async def find_coordinator(directory: SwarmDirectory, *, timeout: float, poll_s: float = 0.5) -> LeaseRecord:
    """The lease in force, waiting up to ``timeout`` s for one.

    Raises:
        CoordinatorError: no peer held the lease within ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        lease = lease_in_force(await directory.fetch_leases(), get_dht_time())
        if lease is not None:
            return lease
        if loop.time() >= deadline:
            raise CoordinatorError(
                f"no coordinator within {timeout:.0f} s: no live peer holds the swarm's lease "
                "(are all peers started with --no-coordinator?)"
            )
        await asyncio.sleep(poll_s)
