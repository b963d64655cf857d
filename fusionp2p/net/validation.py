"""DHT record validators that every fusionp2p DHT node runs.

hivemind calls ``validate`` on every record a peer asks us to store and on every record
another peer returns to us. Two validators, applied in this order:

1. ``LoggingSignatureValidator``: hivemind's RSA check (a subkey holding
   ``[owner:<key>]`` must carry that key's signature), but a failure is logged.
2. ``SwarmRecordValidator``: the stripped value must be a well-formed fusionp2p record,
   no larger than ``MAX_RECORD_BYTES``, signed (owner marker present), and the peer it
   speaks for must be the PeerID of the signing key. One exception: hivemind's averager
   (``runtime.averaging``) declares itself in a group as an unsigned ``True``/``False``
   under its PeerID, living minutes; a value of one byte, accepted as such and nothing else.

A rejected record is dropped and logged as a protocol error; the node keeps serving.
"""

from __future__ import annotations

import logging

import msgpack
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from fusionp2p.errors import RecordError
from fusionp2p.net.identity import peer_id_from_public_key
from fusionp2p.net.limits import RejectionLog
from fusionp2p.records import (
    MAX_RECORD_BYTES,
    LeaseRecord,
    LinkSetRecord,
    PeerRecord,
    PlanStageRecord,
    RunStatusRecord,
    decode_record,
)

__all__ = [
    "MAX_RECORD_LIFETIME",
    "LoggingSignatureValidator",
    "SwarmRecordValidator",
    "make_validators",
    "subkey_prefix",
]

logger = logging.getLogger(__name__)

MAX_RECORD_LIFETIME = 3600.0  # a record may not claim to live longer than this from now
MAX_DECLARATION_LIFETIME = 600.0  # ... nor an averager's declaration in a group
_MSGPACK_BOOLS = (b"\xc2", b"\xc3")
_WIRE_OVERHEAD = 16  # msgpack framing around the record bytes
_LOG_INTERVAL = 5.0


def _rejection_log() -> RejectionLog:
    return RejectionLog(logger, "protocol error: rejected DHT record", interval=_LOG_INTERVAL)


class LoggingSignatureValidator(RSASignatureValidator):
    """hivemind's RSA owner/signature check, logging each rejection as a protocol error."""

    def __init__(self, private_key=None) -> None:
        super().__init__(private_key)
        self._log = _rejection_log()

    def validate(self, record: DHTRecord) -> bool:
        if super().validate(record):
            return True
        return self._log.reject("bad signature", "the value is not signed by the key in its subkey")


DhtRecord = PeerRecord | LeaseRecord | LinkSetRecord | RunStatusRecord | PlanStageRecord


def subkey_prefix(record: DhtRecord) -> bytes:
    """What a DHT record's subkey holds before its owner marker: one subkey per peer and record
    (its profile, its lease claim, each part of its links, each run, each plan stage), so one
    identity cannot store a record many times over."""
    if isinstance(record, PeerRecord):
        return record.peer_id.encode()
    if isinstance(record, LeaseRecord):
        return record.holder.encode()
    if isinstance(record, LinkSetRecord):
        return f"set{record.part}".encode()
    if isinstance(record, RunStatusRecord):
        return record.run_id.encode()
    return f"{record.plan_id}.{record.epoch}.{record.stage}".encode()


def _speaker(record: DhtRecord) -> str:
    """The peer a DHT record speaks for, who alone may sign it."""
    if isinstance(record, PeerRecord):
        return record.peer_id
    if isinstance(record, LinkSetRecord):
        return record.src
    if isinstance(record, PlanStageRecord):
        return record.made_by
    if isinstance(record, LeaseRecord):
        return record.holder
    return record.data_owner


def _averager_declaration(record: DHTRecord) -> bool:
    """Whether ``record`` is hivemind's matchmaking entry: a bool under a bare PeerID (a
    sha256 or identity multihash), expiring within ``MAX_DECLARATION_LIFETIME``."""
    if record.value not in _MSGPACK_BOOLS:
        return False
    if record.expiration_time > get_dht_time() + MAX_DECLARATION_LIFETIME:
        return False
    try:
        subkey = msgpack.unpackb(record.subkey or b"", raw=True)
    except (ValueError, msgpack.UnpackException):
        return False
    return (
        isinstance(subkey, bytes)
        and 2 < len(subkey) <= 66
        and subkey[0] in (0x00, 0x12)
        and (subkey[1] == len(subkey) - 2)
    )


class SwarmRecordValidator(RecordValidatorBase):
    """Accepts only signed, well-formed, small fusionp2p records whose signer is their peer."""

    def __init__(self) -> None:
        self._log = _rejection_log()

    @property
    def priority(self) -> int:
        return 0  # after the signature validator, on the value stripped of its signature

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES + _WIRE_OVERHEAD:
            return self._log.reject("oversized", f"{len(record.value)} bytes > {MAX_RECORD_BYTES}")
        if record.expiration_time > get_dht_time() + MAX_RECORD_LIFETIME:
            return self._log.reject("expiration too far", f"{record.expiration_time:.0f}")
        owners = RSASignatureValidator._PUBLIC_KEY_RE.findall(record.subkey or b"")
        if not owners and _averager_declaration(record):
            return True
        if len(owners) != 1:
            return self._log.reject("unsigned", "the subkey names no single owner key")
        try:
            data = msgpack.unpackb(record.value, raw=False)
            parsed = decode_record(data)
        except (RecordError, ValueError, TypeError, msgpack.UnpackException) as e:
            return self._log.reject("malformed", str(e)[:200])
        if not isinstance(parsed, DhtRecord):
            return self._log.reject("not a DHT record", f"a {type(parsed).__name__} has no place in the DHT")
        claimed = _speaker(parsed)
        try:
            signer = peer_id_from_public_key(owners[0])
        except (ValueError, TypeError) as e:
            return self._log.reject("bad owner key", str(e)[:200])
        if claimed != signer:
            return self._log.reject("forged", f"record for {claimed[:16]} signed by {signer[:16]}")
        try:
            subkey = msgpack.unpackb(record.subkey, raw=True)
        except (ValueError, msgpack.UnpackException) as e:
            return self._log.reject("malformed subkey", str(e)[:200])
        if not isinstance(subkey, bytes) or subkey[: subkey.find(b"[owner:")] != subkey_prefix(parsed):
            return self._log.reject("wrong subkey", f"a {type(parsed).__name__} under {str(subkey)[:60]}")
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)


def make_validators(private_key=None) -> list[RecordValidatorBase]:
    """The validators a fusionp2p DHT node runs; ``private_key`` signs this node's records."""
    return [LoggingSignatureValidator(private_key), SwarmRecordValidator()]
