"""Directory reads are complete or say what is missing, and no key grows past its bound.

The DHT here is a stand-in (a unit test of the directory's own logic); the real DHT's
round trips are in tests/test_directory.py and the swarm integration tests."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time
from job_helpers import peer_record

from fusionp2p.errors import IncompleteReadError, RecordError
from fusionp2p.net.directory import (
    MAX_CONCURRENT_GETS,
    MAX_PEERS_PER_SHARD,
    PEER_SHARDS,
    SwarmDirectory,
    Unread,
)
from fusionp2p.net.directory_view import DirectoryView
from fusionp2p.records import (
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    JobReply,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
)

SRC = "Qm" + "s" * 44


def _peer(i: int) -> PeerRecord:
    return peer_record(f"Qm{i:044d}", state="idle")


def _link(i: int) -> LinkRecord:
    return LinkRecord(src=SRC, dst=f"Qm{i:044d}", bandwidth_bytes_per_s=1e6, rtt_s=0.01, measured_at=0.0)


class _FakeDHT:
    """Answers gets from ``values`` (key -> {subkey: bytes}); keys in ``stuck`` never answer."""

    def __init__(self, values: dict[str, dict[bytes, bytes]], stuck: set[str] | None = None) -> None:
        self.values, self.stuck, self.gets, self.stores = values, set(stuck or ()), [], 0
        self.in_flight = self.most_in_flight = 0

    def get(self, key: str, latest: bool, return_future: bool) -> Any:
        self.gets.append(key)
        if key in self.stuck:
            return asyncio.sleep(3600)
        found = {
            sub: ValueWithExpiration(v, get_dht_time() + 60) for sub, v in self.values.get(key, {}).items()
        }
        return self._answer(ValueWithExpiration(found, get_dht_time() + 60) if found else None)

    async def _answer(self, value: Any) -> Any:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        return value

    def store(self, key: str, value: bytes, expiration: float, subkey: bytes, return_future: bool) -> Any:
        self.stores += 1
        self.values.setdefault(key, {})[subkey] = value
        return asyncio.sleep(0, result=True)


def _directory(dht: _FakeDHT) -> SwarmDirectory:
    return SwarmDirectory(dht, "t", owner_marker=b"[owner:x]", timeout=0.05)  # type: ignore[arg-type]


def test_a_read_with_a_missing_shard_raises_or_reports_it_never_returns_less_silently() -> None:
    peers = [_peer(i) for i in range(40)]
    probe = _directory(_FakeDHT({}))
    values: dict[str, dict[bytes, bytes]] = {}
    for p in peers:
        values.setdefault(probe.peer_key(p.peer_id), {})[p.peer_id.encode()] = p.to_wire()
    stuck_key = probe.peer_key(peers[0].peer_id)
    dht = _FakeDHT(values, stuck={stuck_key})
    directory = _directory(dht)
    with pytest.raises(IncompleteReadError, match="1 directory key") as caught:
        asyncio.run(directory.fetch_peers())
    assert caught.value.keys == [stuck_key]
    assert dht.gets.count(stuck_key) == 2  # retried once before giving up
    unread = Unread()
    got = asyncio.run(directory.fetch_peers(unread=unread))
    assert unread.keys == [stuck_key]
    assert set(got) == {p.peer_id for p in peers if probe.peer_key(p.peer_id) != stuck_key}
    assert len(got) < len(peers) and len(dht.gets) == 2 * (PEER_SHARDS + 1)  # two reads, one retry each


def test_link_reads_report_a_missing_source_too() -> None:
    directory = _directory(_FakeDHT({}, stuck={"t.links." + SRC}))
    unread = Unread()
    assert asyncio.run(directory.fetch_links([SRC], unread=unread)) == []
    assert unread.keys == ["t.links." + SRC]
    with pytest.raises(IncompleteReadError):
        asyncio.run(directory.fetch_links([SRC]))


def test_the_directory_refuses_to_grow_a_links_key_past_its_bound() -> None:
    dht = _FakeDHT({})
    directory = _directory(dht)
    with pytest.raises(RecordError, match=f"at most {MAX_LINKS_PER_PEER} links"):
        asyncio.run(directory.publish_links([_link(i) for i in range(MAX_LINKS_PER_PEER + 1)], 1e12))
    assert dht.stores == 0
    assert asyncio.run(directory.publish_links([_link(i) for i in range(MAX_LINKS_PER_PEER)], 1e12)) == 64
    assert dht.stores == MAX_LINKS_PER_PEER // LINKS_PER_SET  # one signed store per 16 links
    assert len(asyncio.run(directory.fetch_links([SRC]))) == MAX_LINKS_PER_PEER
    # a key that grew anyway (a forged or old writer): readers take no more than the bound
    sets = [LinkSetRecord.pack([_link(16 * k + i) for i in range(16)])[0] for k in range(6)]
    crowded = {"t.links." + SRC: {f"set{k}x".encode(): ls.to_wire() for k, ls in enumerate(sets)}}
    links = asyncio.run(_directory(_FakeDHT(crowded)).fetch_links([SRC]))
    assert len(links) == MAX_LINKS_PER_PEER


def test_a_reply_says_which_keys_its_plan_was_made_without() -> None:
    reply = JobReply("job-1", 3, 2, SRC, (_peer(1),), (_link(1),), unread=("t.peers.3",))
    assert JobReply.from_wire(reply.to_wire()).unread == ("t.peers.3",)
    with pytest.raises(RecordError, match="unread"):
        JobReply.from_wire(msgpack.packb({**reply.to_body(), "unread": ["x" * 200]}))


def test_peer_shards_split_as_the_swarm_grows_and_no_key_passes_its_bound() -> None:
    dht = _FakeDHT({})
    directory = _directory(dht)

    async def join(n: int) -> None:
        for i in range(n):
            assert await directory.publish_peer(_peer(i), 1e12)

    asyncio.run(join(1000))
    sizes = {key: len(v) for key, v in dht.values.items()}
    assert max(sizes.values()) <= MAX_PEERS_PER_SHARD  # one writer at a time: never over
    assert any(key.count(".") == 3 for key in sizes)  # shards split below level 0
    dht.gets.clear()
    assert len(asyncio.run(directory.fetch_peers())) == 1000
    assert len(dht.gets) < 4 * 1000 / MAX_PEERS_PER_SHARD  # about 2 N / bound gets, not N
    asyncio.run(join(1000))  # republishing: every peer finds its own entry, nothing moves
    assert {key: len(v) for key, v in dht.values.items()} == sizes


def test_a_wide_read_keeps_a_bounded_number_of_gets_in_flight() -> None:
    sources = [f"Qm{i:044d}" for i in range(300)]
    one = LinkSetRecord.pack([_link(10**6)])[0]
    dht = _FakeDHT({f"t.links.{s}": {b"set0": replace(one, src=s).to_wire()} for s in sources})
    asyncio.run(_directory(dht).fetch_links(sources))
    assert len(dht.gets) == 300 and dht.most_in_flight == MAX_CONCURRENT_GETS


def _swarm_values(n: int) -> tuple[SwarmDirectory, dict[str, dict[bytes, bytes]], list[PeerRecord]]:
    peers = [_peer(i) for i in range(n)]
    probe = _directory(_FakeDHT({}))
    values: dict[str, dict[bytes, bytes]] = {}
    for i, p in enumerate(peers):
        values.setdefault(probe.peer_key(p.peer_id), {})[p.peer_id.encode()] = p.to_wire()
        dst = peers[(i + 1) % n].peer_id
        link = LinkRecord(src=p.peer_id, dst=dst, bandwidth_bytes_per_s=1e6, rtt_s=0.01, measured_at=0.0)
        values[probe.links_key(p.peer_id)] = {b"set0": LinkSetRecord.pack([link])[0].to_wire()}
    return probe, values, peers


def test_a_view_reads_only_what_fell_due_and_says_what_it_lacks() -> None:
    _, values, peers = _swarm_values(100)
    dht = _FakeDHT(values)
    now = [0.0]  # the view's clock: a busy machine must not age the links between refreshes
    view = DirectoryView(_directory(dht), links_max_age=0.3, max_link_reads=60, clock=lambda: now[0])

    async def scenario() -> None:
        first = await view.refresh()
        assert (first.peers, first.link_reads, first.without_links, first.complete) == (100, 60, 40, False)
        now[0] += 0.1
        second = await view.refresh()
        assert (second.link_reads, second.without_links, second.complete) == (40, 0, True)
        assert len(view.links()) == 100
        dht.gets.clear()
        third = await view.refresh()  # nothing fell due: the shards only
        assert third.link_reads == 0 and all(".links." not in key for key in dht.gets)
        now[0] += 0.35
        assert (await view.refresh()).link_reads == 60  # stalest first, bounded per refresh
        gone = peers[0].peer_id
        del values[_directory(dht).peer_key(gone)][gone.encode()]
        dht.stuck.add(_directory(dht).links_key(peers[1].peer_id))
        view.max_link_reads = 200
        now[0] += 0.35  # every source due
        unread = Unread()
        fifth = await view.refresh(unread)
        assert fifth.peers == 99 and gone not in view.peers()
        assert all(gone not in (lk.src, lk.dst) for lk in view.links())
        assert unread.keys == [_directory(dht).links_key(peers[1].peer_id)] and not fifth.complete
        assert any(lk.src == peers[1].peer_id for lk in view.links())  # what it read before stays

    asyncio.run(scenario())
