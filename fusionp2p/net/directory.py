"""The swarm's directory in the DHT: where PeerRecords and LinkRecords live.

Layout (every value is one small signed record; DESIGN.md explains why values stay small):

    {swarm}.peers.{shard}   subkey  b"{peer_id}" + owner marker  ->  PeerRecord (level 0)
    {swarm}.peers.{L}.{shard}        the same, at level L >= 1 (16 << L shards)
    {swarm}.links.{src}     subkey  b"set{part}" + owner marker  ->  LinkSetRecord (<= 16 links of src)
    {swarm}.coordinator     subkey  b"{holder}" + owner marker   ->  LeaseRecord (a claim on the lease)
    {swarm}.plans           subkey  b"{job}.{epoch}.{stage}" + marker  ->  PlanStageRecord
    {swarm}.runs            subkey  b"{run}" + owner marker      ->  RunStatusRecord (its data owner's report)

Peers are spread over ``PEER_SHARDS`` keys at level 0; a shard holding
``MAX_PEERS_PER_SHARD`` peers is full, and a peer whose shard is full writes one level
down, where its shard splits in two (level L has ``PEER_SHARDS << L`` shards, a peer's
shard is its hash modulo that). Readers descend below every full shard. So a key holds
about ``MAX_PEERS_PER_SHARD`` records (plus peers that joined at the same moment) at any
swarm size, and a read of N peers costs about ``2 N / MAX_PEERS_PER_SHARD`` gets. A peer
re-walks from level 0 at every heartbeat, so it moves up when its shard empties; until
then (one heartbeat) readers may miss it. A links key holds at most
``records.MAX_LINKS_PER_PEER`` links in 4 signed sets of 16 (its peer publishes no more,
readers take no more); each set expires on its own. A record only counts while it is unexpired,
so a peer that dies without leaving disappears within its record TTL.

A read never returns less silently, and never floods the DHT: at most
``MAX_CONCURRENT_GETS`` gets are in flight per directory (the rest queue; the deadline
counts from the moment a get is sent). A get that passes its deadline is retried once, and
if it still fails ``fetch_peers``/``fetch_links`` raise ``IncompleteReadError`` naming the
keys, or, given an ``Unread``, add the keys to it and return the rest (the caller reports
what it worked without).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field

import hivemind
from hivemind.utils import get_dht_time

from fusionp2p.config import DEFAULT_TIMEOUTS
from fusionp2p.errors import IncompleteReadError, RecordError, SwarmError
from fusionp2p.net.validation import subkey_prefix
from fusionp2p.records import (
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    LeaseRecord,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
    PlanStageRecord,
    RunStatusRecord,
)

__all__ = [
    "MAX_CONCURRENT_GETS",
    "MAX_PEERS_PER_SHARD",
    "MAX_PEER_LEVEL",
    "MAX_STORE_BYTES",
    "PEER_SHARDS",
    "SwarmDirectory",
    "Unread",
]

logger = logging.getLogger(__name__)

PEER_SHARDS = 16  # shards at level 0
MAX_PEERS_PER_SHARD = 32  # a full shard (~1.5 KiB per record in the DHT: < 64 KiB per key)
MAX_PEER_LEVEL = 8  # 4096 shards at the deepest level: ~130,000 peers
MAX_CONCURRENT_GETS = 32  # a read of many keys queues here instead of flooding the DHT process
_MAX_SETS = MAX_LINKS_PER_PEER // LINKS_PER_SET
MAX_STORE_BYTES = 3000  # key + subkey + value; pickled with its MPFuture (~1.1 KiB more) < 4 KiB


@dataclass
class Unread:
    """The directory keys a read could not get in time, even after a retry."""

    keys: list[str] = field(default_factory=list)

    def check(self, wanted: Unread | None) -> None:
        """Hands the keys to the caller's ``wanted`` or, without one, raises.

        Raises:
            IncompleteReadError: keys are missing and the caller takes no partial read.
        """
        if not self.keys:
            return
        if wanted is None:
            raise IncompleteReadError(self.keys)
        logger.warning("read the directory without %d key(s): %s", len(self.keys), ", ".join(self.keys[:5]))
        wanted.keys.extend(self.keys)


def _shard(peer_id: str, level: int = 0) -> int:
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") % (PEER_SHARDS << level)


class SwarmDirectory:
    """Publishes and fetches a swarm's records through a running ``hivemind.DHT``.

    All methods are coroutines that await the DHT process without blocking the loop.
    ``owner_marker`` is the signer's ``[owner:...]`` bytes; it is only needed to publish.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        swarm: str,
        *,
        owner_marker: bytes = b"",
        timeout: float = DEFAULT_TIMEOUTS.dht,
    ) -> None:
        self.dht = dht
        self.swarm = swarm
        self.owner_marker = owner_marker
        self.timeout = timeout
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _gate(self) -> asyncio.Semaphore:
        """The running loop's bound on gets in flight (a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(MAX_CONCURRENT_GETS)
        return gate

    def peers_key(self, shard: int, level: int = 0) -> str:
        return f"{self.swarm}.peers.{shard}" if level == 0 else f"{self.swarm}.peers.{level}.{shard}"

    def peer_key(self, peer_id: str, level: int = 0) -> str:
        """The key (shard) at ``level`` that holds ``peer_id``'s record when it lives there."""
        return self.peers_key(_shard(peer_id, level), level)

    def links_key(self, src: str) -> str:
        return f"{self.swarm}.links.{src}"

    async def _store(self, key: str, subkey: bytes, value: bytes, expiration: float) -> bool:
        if len(key) + len(subkey) + len(value) > MAX_STORE_BYTES:
            raise RecordError(
                f"a DHT store of {len(key) + len(subkey) + len(value)} bytes exceeds "
                f"{MAX_STORE_BYTES}; hivemind's DHT pipe could tear it"
            )
        future = self.dht.store(key, value, expiration, subkey=subkey, return_future=True)
        return bool(await asyncio.wait_for(future, self.timeout))

    async def _path(self, peer_id: str) -> AsyncIterator[tuple[str, dict[bytes, bytes]]]:
        """The shards on ``peer_id``'s path from level 0 with what they hold: each full one
        and the first that is not (where its record is, or goes)."""
        for level in range(MAX_PEER_LEVEL + 1):
            key = self.peer_key(peer_id, level)
            held = await self._get_dict(key)
            yield key, held
            if len(held) < MAX_PEERS_PER_SHARD:
                return

    async def publish_peer(self, record: PeerRecord, expiration: float) -> bool:
        """Stores this peer's record until ``expiration`` (DHT time) in the first shard on
        its path from level 0 that holds it already or is not full; True if any replica
        took it.

        Raises:
            SwarmError: every shard on its path is full (more peers than the directory holds).
        """
        if not self.owner_marker:
            raise SwarmError("this directory has no signing key; it can only read")
        subkey = subkey_prefix(record) + self.owner_marker
        mine = record.peer_id.encode()
        async for key, held in self._path(record.peer_id):
            if len(held) < MAX_PEERS_PER_SHARD or any(s.startswith(mine) for s in held):
                return await self._store(key, subkey, record.to_wire(), expiration)
        raise SwarmError(
            f"every shard on {record.peer_id[-8:]}'s path holds {MAX_PEERS_PER_SHARD} peers, down to level "
            f"{MAX_PEER_LEVEL}: the directory is full"
        )

    async def publish_links(self, records: Iterable[LinkRecord], expiration: float) -> int:
        """Stores this peer's link measurements; returns how many were accepted.

        Raises:
            RecordError: more than ``MAX_LINKS_PER_PEER`` links, or links of two sources.
        """
        if not self.owner_marker:
            raise SwarmError("this directory has no signing key; it can only read")
        sets = LinkSetRecord.pack(list(records))
        results = await asyncio.gather(
            *(
                self._store(
                    self.links_key(ls.src),
                    subkey_prefix(ls) + self.owner_marker,
                    ls.to_wire(),
                    expiration,
                )
                for ls in sets
            ),
            return_exceptions=True,
        )
        return sum(len(ls.dst) for ls, ok in zip(sets, results, strict=True) if ok is True)

    async def _get_dict(self, key: str, unread: Unread | None = None) -> dict[bytes, bytes]:
        """The unexpired subkeys of ``key``; one retry after a timeout, then ``{}`` with the
        key added to ``unread`` (logged when there is none)."""
        for attempt in range(2):
            try:
                async with self._gate():
                    future = self.dht.get(key, latest=True, return_future=True)
                    found = await asyncio.wait_for(future, self.timeout)
                break
            except TimeoutError:
                logger.warning(
                    "DHT get of %s passed its %g s deadline (try %d)", key, self.timeout, attempt + 1
                )
        else:
            if unread is not None:
                unread.keys.append(key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        return {
            subkey: item.value
            for subkey, item in found.value.items()
            if item.expiration_time >= now and isinstance(item.value, bytes)
        }

    async def fetch_peers(
        self, *, include_leaving: bool = False, unread: Unread | None = None
    ) -> dict[str, PeerRecord]:
        """Live peers by PeerID (the freshest record of each).

        Raises:
            IncompleteReadError: a shard could not be read and no ``unread`` takes its key.
        """
        missing = Unread()
        shards: list[dict[bytes, bytes]] = []
        level, wanted = 0, list(range(PEER_SHARDS))
        while wanted:
            got = await asyncio.gather(*(self._get_dict(self.peers_key(s, level), missing) for s in wanted))
            shards += got
            if level == MAX_PEER_LEVEL:
                break
            width = PEER_SHARDS << level  # a full shard s splits into s and s + width one level down
            wanted = [
                c
                for s, v in zip(wanted, got, strict=True)
                if len(v) >= MAX_PEERS_PER_SHARD
                for c in (s, s + width)
            ]
            level += 1
        missing.check(unread)
        peers: dict[str, PeerRecord] = {}
        for values in shards:
            for data in values.values():
                try:
                    record = PeerRecord.from_wire(data)
                except RecordError as e:
                    logger.warning("protocol error: skipped a malformed PeerRecord: %s", e)
                    continue
                known = peers.get(record.peer_id)
                if known is None or record.updated_at > known.updated_at:
                    peers[record.peer_id] = record
        if not include_leaving:
            peers = {pid: r for pid, r in peers.items() if r.state != "leaving"}
        return peers

    async def fetch_peer(self, peer_id: str) -> PeerRecord | None:
        """``peer_id``'s freshest live record (read along its path of shards), or None."""
        found: PeerRecord | None = None
        async for _, held in self._path(peer_id):
            for data in held.values():
                with contextlib.suppress(RecordError):
                    record = PeerRecord.from_wire(data)
                    if record.peer_id == peer_id and (found is None or record.updated_at > found.updated_at):
                        found = record
        return found if found is not None and found.state != "leaving" else None

    async def holds_peer(self, record: PeerRecord) -> bool:
        """Whether readers see ``record`` (or a newer one of its peer) in the DHT.

        hivemind reports only the answer of the replica that answered a store last, so a
        replica that validates nothing, or holds a forged entry under the peer's subkey,
        makes a store look refused while honest replicas took it: read back to know.
        """
        async for _, held in self._path(record.peer_id):
            for data in held.values():
                with contextlib.suppress(RecordError):
                    found = PeerRecord.from_wire(data)
                    if found.peer_id == record.peer_id and found.updated_at >= record.updated_at:
                        return True
        return False

    async def fetch_links(self, sources: Sequence[str], *, unread: Unread | None = None) -> list[LinkRecord]:
        """Unexpired LinkRecords measured by each peer in ``sources`` (at most
        ``MAX_LINKS_PER_PEER`` of each).

        Raises:
            IncompleteReadError: a source's key could not be read and no ``unread`` takes it.
        """
        by_source = await self.fetch_links_by_source(sources, unread=unread)
        return [link for src in sources for link in by_source.get(src, [])]

    async def fetch_links_by_source(
        self, sources: Sequence[str], *, unread: Unread | None = None
    ) -> dict[str, list[LinkRecord]]:
        """``fetch_links`` per source: the sources read, each with its links (maybe none).
        A source whose key could not be read is absent (and named in ``unread``).

        Raises:
            IncompleteReadError: a source's key could not be read and no ``unread`` takes it.
        """
        missing = Unread()
        keys = [self.links_key(src) for src in sources]
        per_source = await asyncio.gather(*(self._get_dict(key, missing) for key in keys))
        missing.check(unread)
        lost = set(missing.keys)
        links: dict[str, list[LinkRecord]] = {}
        for src, key, values in zip(sources, keys, per_source, strict=True):
            if key in lost:
                continue
            if len(values) > _MAX_SETS:
                logger.warning(
                    "protocol error: %s's links key holds %d sets > %d; reading the first",
                    src,
                    len(values),
                    _MAX_SETS,
                )
            freshest: dict[str, LinkRecord] = {}
            for data in list(values.values())[:_MAX_SETS]:
                try:
                    found = LinkSetRecord.from_wire(data)
                except RecordError as e:
                    logger.warning("protocol error: skipped a malformed LinkSetRecord: %s", e)
                    continue
                if found.src != src:
                    continue
                for link in found.links():  # an old set may repeat a destination: keep the newest
                    known = freshest.get(link.dst)
                    if known is None or link.measured_at > known.measured_at:
                        freshest[link.dst] = link
            links[src] = list(freshest.values())[:MAX_LINKS_PER_PEER]
        return links

    def _signed(self) -> bytes:
        if not self.owner_marker:
            raise SwarmError("this directory has no signing key; it can only read")
        return self.owner_marker

    async def publish_lease(self, record: LeaseRecord, expiration: float) -> bool:
        """Stores this peer's claim on the coordinator lease (its own subkey)."""
        subkey = subkey_prefix(record) + self._signed()
        return await self._store(f"{self.swarm}.coordinator", subkey, record.to_wire(), expiration)

    async def fetch_leases(self) -> list[LeaseRecord]:
        """Every claim on the coordinator lease still in the DHT, valid or not."""
        leases = []
        for data in (await self._get_dict(f"{self.swarm}.coordinator")).values():
            try:
                leases.append(LeaseRecord.from_wire(data))
            except RecordError as e:
                logger.warning("protocol error: skipped a malformed LeaseRecord: %s", e)
        return leases

    async def publish_run(self, record: RunStatusRecord, expiration: float) -> bool:
        """Stores a data owner's report on its run (its own subkey)."""
        subkey = subkey_prefix(record) + self._signed()
        return await self._store(f"{self.swarm}.runs", subkey, record.to_wire(), expiration)

    async def fetch_runs(self) -> list[RunStatusRecord]:
        """Every unexpired run report, newest first."""
        runs = []
        for data in (await self._get_dict(f"{self.swarm}.runs")).values():
            try:
                runs.append(RunStatusRecord.from_wire(data))
            except RecordError as e:
                logger.warning("protocol error: skipped a malformed RunStatusRecord: %s", e)
        return sorted(runs, key=lambda r: -r.updated_at)

    async def publish_plan(self, records: Sequence[PlanStageRecord], expiration: float) -> int:
        """Stores a job's plan, one record per stage; returns how many stages were accepted."""
        marker = self._signed()
        results = await asyncio.gather(
            *(
                self._store(
                    f"{self.swarm}.plans",
                    subkey_prefix(r) + marker,
                    r.to_wire(),
                    expiration,
                )
                for r in records
            ),
            return_exceptions=True,
        )
        return sum(1 for ok in results if ok is True)

    async def fetch_all_plans(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        """Every complete plan in the DHT: (job, epoch, coordinator) -> its stages in order."""
        plans: dict[tuple[str, int, str], dict[int, PlanStageRecord]] = {}
        for data in (await self._get_dict(f"{self.swarm}.plans")).values():
            try:
                record = PlanStageRecord.from_wire(data)
            except RecordError as e:
                logger.warning("protocol error: skipped a malformed plan record: %s", e)
                continue
            plans.setdefault((record.plan_id, record.epoch, record.made_by), {})[record.stage] = record
        return {
            key: [stages[i] for i in range(len(stages))]
            for key, stages in plans.items()
            if sorted(stages) == list(range(next(iter(stages.values())).n_stages))
        }

    async def fetch_plans(self, job: str) -> dict[tuple[int, str], list[PlanStageRecord]]:
        """The complete plans of ``job``: (epoch, coordinator) -> its stages in order."""
        return {(e, by): stages for (j, e, by), stages in (await self.fetch_all_plans()).items() if j == job}
