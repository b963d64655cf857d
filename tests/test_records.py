import math
from dataclasses import replace

import msgpack
import pytest

from fusionp2p.errors import RecordError
from fusionp2p.records import (
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    MAX_RECORD_BYTES,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
    decode_record,
)


def make_peer(**overrides) -> PeerRecord:
    fields = dict(
        peer_id="QmPeer",
        maddrs=("/ip4/127.0.0.1/tcp/1/p2p/QmPeer",),
        device="cpu",
        device_name="x86_64",
        flops={"float32": 1e11, "bfloat16": 2e9},
        memory_bytes=1 << 30,
        total_memory_bytes=1 << 32,
        state="idle",
        started_at=100.0,
        updated_at=105.0,
    )
    fields.update(overrides)
    return PeerRecord(**fields)


def test_peer_and_link_records_round_trip() -> None:
    peer = make_peer(topk_codec_s={"send_element_s": 7e-9, "send_entry_s": 4e-8, "recv_entry_s": 1e-8})
    link = LinkRecord(
        src="QmA", dst="QmB", bandwidth_bytes_per_s=1.25e7, rtt_s=0.02, measured_at=5.0, samples=3
    )
    assert PeerRecord.from_wire(peer.to_wire()) == peer
    assert LinkRecord.from_wire(link.to_wire()) == link
    assert decode_record(peer.to_wire()) == peer
    assert decode_record(link.to_wire()) == link
    assert len(peer.to_wire()) < 600  # far below the DHT's value limit


def test_unknown_fields_are_ignored_and_newer_major_version_rejected() -> None:
    body = msgpack.unpackb(make_peer().to_wire())
    body["added_in_a_later_minor_release"] = [1, 2, 3]
    assert PeerRecord.from_wire(msgpack.packb(body)) == make_peer()
    body["v"] = PeerRecord.VERSION + 1
    with pytest.raises(RecordError, match="newer"):
        PeerRecord.from_wire(msgpack.packb(body))


def test_a_version_1_link_record_without_units_in_its_names_is_refused_not_misread() -> None:
    link = LinkRecord(src="QmA", dst="QmB", bandwidth_bytes_per_s=5e6, rtt_s=0.01, measured_at=1.0)
    body = msgpack.unpackb(link.to_wire())
    body["v"] = 1
    body["bandwidth_bps"] = body.pop("bandwidth_bytes_per_s")
    with pytest.raises(RecordError, match="misses a field"):
        LinkRecord.from_wire(msgpack.packb(body))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b.pop("peer_id"), "misses a field"),
        (lambda b: b.update(memory_bytes="lots"), "integer"),
        (lambda b: b.update(flops={"float32": math.nan}), "finite"),
        (lambda b: b.update(flops={"float32": -1.0}), "positive"),
        (lambda b: b.update(state="dancing"), "state"),
        (lambda b: b.update(topk_codec_s={"send_element_s": -1e-9}), "topk_codec_s"),
        (lambda b: b.update(topk_codec_s={"made_up_s": 1e-9}), "topk_codec_s"),
        (lambda b: b.update(topk_codec_s={"send_entry_s": math.inf}), "finite"),
        (lambda b: b.update(maddrs=["/ip4"] * 100), "list"),
        (lambda b: b.update(kind="link"), "expected a 'peer'"),
        (lambda b: b.update(v="one"), "version"),
    ],
)
def test_malformed_peer_records_are_rejected(mutate, match) -> None:
    body = msgpack.unpackb(make_peer().to_wire())
    mutate(body)
    with pytest.raises(RecordError, match=match):
        PeerRecord.from_wire(msgpack.packb(body))


def test_garbage_and_oversized_bytes_are_rejected() -> None:
    with pytest.raises(RecordError, match="msgpack"):
        decode_record(b"\xc1\xc1\xc1")
    with pytest.raises(RecordError, match="map"):
        decode_record(msgpack.packb([1, 2]))
    with pytest.raises(RecordError, match="unknown record kind"):
        decode_record(msgpack.packb({"kind": "plan", "v": 1}))
    with pytest.raises(RecordError, match="exceeds"):
        decode_record(b"\x00" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RecordError, match="bytes >"):
        make_peer(device_name="x" * 200, maddrs=tuple("/" + "a" * 250 for _ in range(10))).to_wire()


def test_link_record_ranges() -> None:
    with pytest.raises(RecordError, match="distinct"):
        LinkRecord(src="QmA", dst="QmA", bandwidth_bytes_per_s=1.0, rtt_s=0.0, measured_at=0.0)
    with pytest.raises(RecordError, match="bandwidth"):
        LinkRecord(src="QmA", dst="QmB", bandwidth_bytes_per_s=0.0, rtt_s=0.0, measured_at=0.0)


def test_links_travel_the_dht_in_signed_sets_of_sixteen() -> None:
    links = [
        LinkRecord(
            src="Qm" + "a" * 44,
            dst=f"Qm{i:044d}",
            bandwidth_bytes_per_s=1e6 + i / 3,
            rtt_s=0.01 / 3,
            measured_at=1e9 / 7,
            samples=10**6,
        )
        for i in range(MAX_LINKS_PER_PEER)
    ]
    sets = LinkSetRecord.pack(links)
    assert [s.part for s in sets] == [0, 1, 2, 3] and all(len(s.dst) == LINKS_PER_SET for s in sets)
    assert [lk for s in sets for lk in LinkSetRecord.from_wire(s.to_wire()).links()] == links
    assert max(len(s.to_wire()) for s in sets) <= MAX_RECORD_BYTES
    with pytest.raises(RecordError, match="at most 64 links"):
        LinkSetRecord.pack([*links, replace(links[0], dst="QmZ")])
    with pytest.raises(RecordError, match="source"):
        LinkSetRecord.pack([links[0], replace(links[1], src="QmC")])
    with pytest.raises(RecordError, match="twice"):
        replace(sets[0], dst=(links[0].dst,) * 16)
    with pytest.raises(RecordError, match="every field"):
        replace(sets[0], rtt_s=sets[0].rtt_s[:3])
    with pytest.raises(RecordError, match="part"):
        replace(sets[0], part=4)
