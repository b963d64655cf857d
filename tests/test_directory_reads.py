"""Directory reads are complete or say what is missing, and no key grows past its bound.

The DHT here is a stand-in (a unit test of the directory's own logic); the real DHT's
round trips are in tests/test_directory.py and the swarm integration tests."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time
from job_helpers import peer_record

from fusionp2p.coordination.protocol import JobReply
from fusionp2p.errors import ConfigError, IncompleteReadError, RecordError
from fusionp2p.net.directory import (
    MAX_CONCURRENT_GETS,
    MAX_PEERS_PER_SHARD,
    PEER_SHARDS,
    SwarmDirectory,
    Unread,
)
from fusionp2p.records import MAX_LINKS_PER_PEER, LinkRecord, PeerRecord

SRC = "Qm" + "s" * 44


def _peer(i: int) -> PeerRecord:
    return peer_record(f"Qm{i:044d}", state="idle")


def _link(i: int) -> LinkRecord:
    return LinkRecord(src=SRC, dst=f"Qm{i:044d}", bandwidth_bytes_per_s=1e6, rtt_s=0.01, measured_at=0.0)


class _FakeDHT:
    """Answers gets from ``values`` (key -> {subkey: bytes}); keys in ``stuck`` never answer."""

    def __init__(self, values: dict[str, dict[bytes, bytes]], stuck: set[str] = frozenset()) -> None:
        self.values, self.stuck, self.gets, self.stores = values, stuck, [], 0
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
    # a key that grew anyway (a forged or old writer): readers take no more than the bound
    crowded = {"t.links." + SRC: {f"d{i}".encode(): _link(i).to_wire() for i in range(100)}}
    links = asyncio.run(_directory(_FakeDHT(crowded)).fetch_links([SRC]))
    assert len(links) == MAX_LINKS_PER_PEER


def test_a_reply_says_which_keys_its_plan_was_made_without() -> None:
    reply = JobReply("job-1", 3, 2, SRC, (_peer(1),), (_link(1),), unread=("t.peers.3",))
    assert JobReply.from_json(reply.to_json()).unread == ("t.peers.3",)
    bad = reply.to_json().replace(b'"unread": ["t.peers.3"]', b'"unread": ["' + b"x" * 200 + b'"]')
    with pytest.raises(ConfigError, match="unread"):
        JobReply.from_json(bad)


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
    dht = _FakeDHT({f"t.links.{s}": {b"d": _link(1).to_wire()} for s in sources})
    asyncio.run(_directory(dht).fetch_links(sources))
    assert len(dht.gets) == 300 and dht.most_in_flight == MAX_CONCURRENT_GETS
