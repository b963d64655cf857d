import math
from dataclasses import replace

import msgpack
import pytest

from fusionp2p.config import OptimizerConfig, RatioWarmup
from fusionp2p.errors import RecordError
from fusionp2p.records import (
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    MAX_RECORD_BYTES,
    RECORD_KINDS,
    ExecControl,
    JobReply,
    JobRequest,
    JobSetup,
    LeaseRecord,
    LinkRecord,
    LinkSetRecord,
    LocalWeights,
    ModelSpec,
    OpData,
    PeerRecord,
    PlanStageRecord,
    ReplicaGroup,
    RunStatusRecord,
    ShardGrant,
    ShardOrder,
    ShardReport,
    ShardRequest,
    ShardSource,
    TopKHeader,
    WireRecord,
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


# -- every wire message ----------------------------------------------------------------------

A, B = "Qm" + "a" * 44, "Qm" + "b" * 44
_LINK = LinkRecord(src=A, dst=B, bandwidth_bytes_per_s=1.25e7, rtt_s=0.02, measured_at=5.0, samples=3)
_SPEC = ModelSpec("gpt2", {"n_layer": 2, "n_embd": 8, "n_head": 2, "activation_function": "gelu"}, (2, 8))


_DIGEST, _NS = "d" * 64, "e" * 64
_SOURCE = ShardSource(_NS, "job-1", 10, "v3-s1", (A, B), (("w", "d" * 64),))


def _examples() -> list[WireRecord]:
    """One valid record of every kind a peer sends or stores."""
    peer = make_peer(peer_id=A, site="eu-1", topk_codec_s={"send_element_s": 1e-9})
    topk = TopKHeader((4, 8), "float32", "float16", "delta16", 32, 4, 8, 8.0, base=3)
    return [
        peer,
        _LINK,
        LinkSetRecord.pack([_LINK])[0],
        LeaseRecord(holder=A, epoch=3, granted_at=1.0, valid_until=16.0, maddrs=("/ip4/127.0.0.1/tcp/1",)),
        RunStatusRecord("run-1", A, "run-1-p2", 5, 10, 2.5, 2, 3, 1, ("planned: v2",), 7.0),
        PlanStageRecord("job-1", 3, 0, 2, B, "gpt2@abc", (0, 5, 9, 12), {"1": 4.0}, 4, 0.5, A, 9.0, A),
        _SPEC,
        topk,
        OpData("job-1", "forward", "add_3", ("mul_4",), True, 2, 1, (4, 8), "float32", 30, topk.to_wire()),
        ExecControl("fetch", "job-1", iteration=2, what="state"),
        JobSetup(
            job="job-1",
            spec=_SPEC,
            peers=((A, ()), (B, ("/ip4/127.0.0.1/tcp/2/p2p/" + B,))),
            node_ranges=((0, 3, 7, 9), (3, 7)),
            stage=1,
            data_stage=0,
            n_micro_batches=4,
            optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9),
            fingerprint="gpt2@0123456789abcdef:0123456789abcdef",
            ratios=((0, 8.0),),
            in_flight=2,
            plan_version=3,
            epoch=3,
            ratio_warmup=RatioWarmup(100, 7),
            weights="shards",
            run="job-1",
            shard_ns=_NS,
            restore=(_SOURCE,),
        ),
        ShardOrder(10, "v3-s1", replica=B),
        ShardReport("v3-s1", 4096, (("w", _DIGEST), ("w#exp_avg", _DIGEST)), (A, B)),
        ShardGrant(b"s" * 32, "job-1", 10, "v3-s1", (A,)),
        ShardRequest(_NS, "job-1", 10, "v3-s1", ("w", "w#exp_avg")),
        _SOURCE,
        LocalWeights((("model.w", "w", _DIGEST, "float32"),)),
        ReplicaGroup(2, 1, (A, B)),
        JobRequest(
            "job-1-p2",
            _SPEC,
            4,
            "planned",
            "op-fence",
            peer,
            (_LINK,),
            20.0,
            "job-1",
            (B,),
            ((B, 0.5),),
            (B,),
        ),
        JobReply("job-1", 3, 2, B, (peer,), (_LINK,), unread=("fusionp2p.peers.3",)),
    ]


def test_every_record_kind_has_an_example_and_a_kind_of_its_own() -> None:
    def subclasses(cls: type) -> set[type]:
        return {c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))}

    assert {type(r) for r in _examples()} == subclasses(WireRecord) == set(RECORD_KINDS.values())


@pytest.mark.parametrize("record", _examples(), ids=lambda r: r.KIND)
def test_every_wire_message_round_trips(record: WireRecord) -> None:
    wire = record.to_wire()
    assert type(record).from_wire(wire) == record
    assert decode_record(wire, limit=type(record).MAX_BYTES) == record
    assert len(wire) <= type(record).MAX_BYTES


@pytest.mark.parametrize("record", _examples(), ids=lambda r: r.KIND)
def test_a_newer_major_version_is_refused_with_one_line(record: WireRecord) -> None:
    body = msgpack.unpackb(record.to_wire())
    body["v"] = type(record).VERSION + 1
    with pytest.raises(RecordError) as refused:
        type(record).from_wire(msgpack.packb(body))
    assert "newer" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("record", _examples(), ids=lambda r: r.KIND)
def test_the_next_minor_version_an_extra_optional_field_is_read_by_this_one(record: WireRecord) -> None:
    body = msgpack.unpackb(record.to_wire())
    body["added_in_the_next_minor_version"] = {"a": [1, "two", 3.0], "b": None}
    for value in body.values():  # the same in every record nested inside it
        nested = value if isinstance(value, list) else [value]
        for item in nested:
            if isinstance(item, dict) and "kind" in item:
                item["added_in_the_next_minor_version"] = 1
    assert type(record).from_wire(msgpack.packb(body)) == record
