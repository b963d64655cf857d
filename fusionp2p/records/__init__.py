"""Everything that goes into the DHT or onto a stream: versioned, validated wire records.

Each record is a frozen dataclass with ``to_wire() -> bytes`` and ``from_wire(bytes)``
(``wire.py``). The wire form is a msgpack map with string keys (never pickle). ``from_wire``
checks size, types and ranges, ignores unknown fields (so newer peers can add some) and
rejects a newer *major* schema version. Every record stays far below hivemind's ~32 KiB DHT
value limit: ``MAX_RECORD_BYTES`` is enforced on both ends, and it keeps a whole store
request (record + signed subkey + framing) under the 4 KiB that hivemind's DHT process can
read from its pipe in one piece (larger requests can be torn and hang). ``swarm.py`` holds
what peers publish to the DHT, ``tensors.py`` what travels with tensors.
"""

from __future__ import annotations

from fusionp2p.errors import RecordError
from fusionp2p.records.swarm import (
    CODEC_TERMS,
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    PEER_STATES,
    RUN_EVENT_CHARS,
    RUN_EVENTS,
    SITE_PATTERN,
    TRAIN_FLOPS,
    LeaseRecord,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
    PlanStageRecord,
    RunStatusRecord,
)
from fusionp2p.records.tensors import (
    EXEC_COMMANDS,
    FETCHABLE,
    OPDATA_DIRECTIONS,
    OPDATA_DTYPES,
    TOPK_INDEX_FORMATS,
    TOPK_VALUE_DTYPES,
    ExecControl,
    OpData,
    TopKHeader,
)
from fusionp2p.records.wire import MAX_RECORD_BYTES, WireRecord, unpack_body

__all__ = [
    "CODEC_TERMS",
    "EXEC_COMMANDS",
    "FETCHABLE",
    "LINKS_PER_SET",
    "MAX_LINKS_PER_PEER",
    "MAX_RECORD_BYTES",
    "OPDATA_DIRECTIONS",
    "OPDATA_DTYPES",
    "PEER_STATES",
    "RUN_EVENTS",
    "RUN_EVENT_CHARS",
    "SITE_PATTERN",
    "TOPK_INDEX_FORMATS",
    "TOPK_VALUE_DTYPES",
    "TRAIN_FLOPS",
    "ExecControl",
    "LeaseRecord",
    "LinkRecord",
    "LinkSetRecord",
    "OpData",
    "PeerRecord",
    "PlanStageRecord",
    "RunStatusRecord",
    "TopKHeader",
    "decode_record",
]

_KINDS: dict[str, type[WireRecord]] = {
    cls.KIND: cls
    for cls in (
        PeerRecord,
        LinkRecord,
        LinkSetRecord,
        LeaseRecord,
        RunStatusRecord,
        PlanStageRecord,
        TopKHeader,
        OpData,
        ExecControl,
    )
}


def decode_record(
    data: bytes | bytearray,
) -> (
    PeerRecord
    | LinkRecord
    | LinkSetRecord
    | LeaseRecord
    | RunStatusRecord
    | PlanStageRecord
    | TopKHeader
    | OpData
    | ExecControl
):
    """Decodes any known record by its ``kind`` field.

    Raises:
        RecordError: the bytes are not a valid record of a known kind.
    """
    body = unpack_body(data)
    kind = body.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError(f"unknown record kind {body.get('kind')!r:.40}")
    return cls.from_body(body)  # type: ignore[return-value]
