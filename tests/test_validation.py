"""The DHT validators accept a peer's own signed records and reject forged, malformed and oversized ones."""

import logging
import os

import msgpack
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from fusionp2p.errors import RecordError
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.net.validation import make_validators, subkey_prefix
from fusionp2p.records import (
    LeaseRecord,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
    RunStatusRecord,
    TopKHeader,
    decode_record,
)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    out = []
    for name in ("alice", "mallory"):
        path = os.path.join(base, name)
        peer_id = ensure_identity(path).to_base58()
        out.append((peer_id, load_signing_key(path)))
    return out


def _peer_record(peer_id: str, **overrides) -> PeerRecord:
    fields = dict(
        peer_id=peer_id,
        maddrs=(),
        device="cpu",
        device_name="x",
        flops={"float32": 1e9},
        memory_bytes=1,
        total_memory_bytes=2,
        state="idle",
        started_at=0.0,
        updated_at=1.0,
    )
    fields.update(overrides)
    return PeerRecord(**fields)


def _signed(
    signer, subkey_owner_marker: bytes, value: bytes, *, lifetime: float = 10.0, prefix: bytes | None = None
) -> DHTRecord:
    """A record as a DHT node would send it, signed by ``signer`` for the subkey's marker,
    under its own subkey (``prefix`` before the marker: by default the record's own)."""
    if prefix is None:
        try:
            prefix = subkey_prefix(decode_record(value))  # type: ignore[arg-type]
        except Exception:  # not a DHT record: any subkey
            prefix = b"x"
    signing = RSASignatureValidator(signer)
    signing._local_public_key = subkey_owner_marker  # lets tests forge on purpose
    record = DHTRecord(
        key=b"key",
        subkey=msgpack.packb(prefix + subkey_owner_marker),
        value=msgpack.packb(value),
        expiration_time=get_dht_time() + lifetime,
    )
    return DHTRecord(record.key, record.subkey, signing.sign_value(record), record.expiration_time)


def _validator() -> CompositeValidator:
    return CompositeValidator(make_validators())


def _marker(key) -> bytes:
    return RSASignatureValidator(key).local_public_key


def test_accepts_a_peers_own_records(keys) -> None:
    (alice, alice_key), (mallory, _) = keys
    peer = _signed(alice_key, _marker(alice_key), _peer_record(alice).to_wire())
    link = LinkRecord(src=alice, dst=mallory, bandwidth_bytes_per_s=1e6, rtt_s=0.1, measured_at=1.0)
    assert _validator().validate(peer)
    assert _validator().validate(
        _signed(alice_key, _marker(alice_key), LinkSetRecord.pack([link])[0].to_wire())
    )
    assert not _validator().validate(
        _signed(alice_key, _marker(alice_key), link.to_wire())
    )  # links go in sets


@pytest.mark.parametrize(
    "case",
    [
        "forged_claim",
        "wrong_signature",
        "unsigned",
        "malformed",
        "oversized",
        "far_expiration",
        "not_a_dht_record",
    ],
)
def test_rejects_bad_records_and_logs_a_protocol_error(keys, case, caplog) -> None:
    (alice, alice_key), (_mallory, mallory_key) = keys
    if case == "forged_claim":  # mallory signs a record that claims to be alice
        record = _signed(mallory_key, _marker(mallory_key), _peer_record(alice).to_wire())
    elif case == "wrong_signature":  # alice's marker, mallory's signature
        record = _signed(mallory_key, _marker(alice_key), _peer_record(alice).to_wire())
    elif case == "unsigned":
        record = DHTRecord(
            b"key", msgpack.packb(b"alice"), msgpack.packb(_peer_record(alice).to_wire()), get_dht_time() + 10
        )
    elif case == "malformed":
        record = _signed(alice_key, _marker(alice_key), b"\x92\x01\x02")
    elif case == "oversized":
        body = msgpack.unpackb(_peer_record(alice).to_wire())
        body["padding"] = "x" * 3000
        record = _signed(alice_key, _marker(alice_key), msgpack.packb(body))
    elif case == "not_a_dht_record":
        header = TopKHeader(
            shape=(2,),
            dtype="float32",
            value_dtype="float32",
            index_format="dense",
            numel=2,
            k=2,
            index_bytes=0,
            ratio=1.0,
        )
        record = _signed(alice_key, _marker(alice_key), header.to_wire())
    else:
        record = _signed(alice_key, _marker(alice_key), _peer_record(alice).to_wire(), lifetime=1e7)
    with caplog.at_level(logging.WARNING, logger="fusionp2p"):
        assert not _validator().validate(record)
    reason = {
        "forged_claim": "forged",
        "wrong_signature": "bad signature",
        "unsigned": "unsigned",
        "malformed": "malformed",
        "oversized": "oversized",
        "far_expiration": "expiration too far",
        "not_a_dht_record": "not a DHT record",
    }
    assert f"protocol error: rejected DHT record: {reason[case]}" in caplog.text


def test_one_identity_stores_a_record_under_its_own_subkey_only(keys, caplog) -> None:
    """Many copies of one peer's record, or many lease claims, under made-up subkeys are refused."""
    (alice, alice_key), _ = keys
    lease = LeaseRecord(alice, 1, 0.0, 10.0).to_wire()
    assert _validator().validate(_signed(alice_key, _marker(alice_key), lease))
    with caplog.at_level(logging.WARNING, logger="fusionp2p"):
        for value, prefix in (
            (lease, b"copy-7" + alice.encode()),
            (_peer_record(alice).to_wire(), alice.encode() + b"-2"),
            (_peer_record(alice).to_wire(), b""),
        ):
            assert not _validator().validate(_signed(alice_key, _marker(alice_key), value, prefix=prefix))
    assert "rejected DHT record: wrong subkey" in caplog.text


def _run_report(data_owner: str, **overrides) -> RunStatusRecord:
    fields = dict(
        run_id="job-abc123",
        data_owner=data_owner,
        job="job-abc123-p2",
        step=12,
        steps=60,
        loss=3.2,
        plan_version=2,
        epoch=1,
        replans=1,
        events=("peer_lost: step 13 failed", "restored: the checkpoint of step 10"),
        updated_at=1.0,
    )
    fields.update(overrides)
    return RunStatusRecord(**fields)


def test_a_run_report_is_taken_only_from_its_data_owner(keys) -> None:
    (alice, alice_key), (_mallory, mallory_key) = keys
    assert _validator().validate(_signed(alice_key, _marker(alice_key), _run_report(alice).to_wire()))
    forged = _signed(mallory_key, _marker(mallory_key), _run_report(alice).to_wire())
    assert not _validator().validate(forged)
    with pytest.raises(RecordError, match="at most 3 events"):
        _run_report(alice, events=("x",) * 4)
    with pytest.raises(RecordError, match="counters"):
        _run_report(alice, step=61)


def test_an_averagers_declaration_is_the_one_unsigned_record_taken(keys) -> None:
    """hivemind's matchmaking stores ``True``/``False`` under the averager's PeerID, unsigned
    (runtime.averaging): taken while it lives minutes, nothing else unsigned is."""
    (alice, _), _ = keys
    peer_bytes = PeerID.from_base58(alice).to_bytes()
    now = get_dht_time()

    def record(value: object, subkey: object = peer_bytes, lifetime: float = 30.0) -> DHTRecord:
        packed = msgpack.packb(value, use_bin_type=True)
        return DHTRecord(b"k" * 20, msgpack.packb(subkey, use_bin_type=True), packed, now + lifetime)

    assert _validator().validate(record(True)) and _validator().validate(record(False))
    assert not _validator().validate(record(1.5))  # a state-sharing priority: not declared by ours
    assert not _validator().validate(record(True, lifetime=3600.0))
    assert not _validator().validate(record(True, subkey=b"x" * 40))  # not a PeerID
    assert not _validator().validate(record(True, subkey="text"))
    assert not _validator().validate(record(b"\xc3" * 100))
