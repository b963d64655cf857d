"""Every byte that crosses a process boundary: versioned, validated wire records.

- ``wire.py``: the shared form (a msgpack map, never pickle), its one validator, the
  version rule (the major version changes only for a breaking change) and size limits.
- ``limits.py``: limits every reader enforces (micro-batches, stages, positions, Top-K ratio).
- ``job_ids.py``: the job ids a replicated job's replicas are planned and set up under.
- ``protocols.py``: the stream protocols' ids, ``/fusionp2p/<name>/<major>``.
- ``swarm.py``: what peers publish to the DHT: PeerRecord, LinkRecord, LinkSetRecord,
  LeaseRecord, RunStatusRecord, PlanStageRecord.
- ``node_ranges.py``: the one encoding of a stage's OP-DAG positions (plan and setup).
- ``model.py``: ModelSpec, what peers build a model from.
- ``tensors.py``: OpData (FusionLLM §3.4) and TopKHeader; the wire dtypes.
- ``exec.py``: the exec protocol: ExecControl, JobSetup, a message's layout, ACK payloads.
- ``coordinator.py``: the coordinator protocol: JobRequest, JobReply, plan methods, compressions.
- ``probe.py``: the probe protocol's payloads.

The layers and how they fit: ``docs/architecture.md``.
"""

from __future__ import annotations

from fusionp2p.errors import RecordError
from fusionp2p.records.coordinator import (
    AVERAGING_CHOICES,
    BASELINES,
    COMPRESSIONS,
    PLAN_METHODS,
    JobReply,
    JobRequest,
)
from fusionp2p.records.exec import (
    CONTROL_REPLY_BYTES,
    CREDIT,
    EXEC_COMMANDS,
    FETCHABLE,
    FINGERPRINT,
    STEP_REPLY,
    WEIGHT_SOURCES,
    ExecControl,
    ExecHeader,
    JobSetup,
    LocalWeights,
    ReplicaGroup,
    decode_exec_header,
    message_prefix,
    pack_message,
    split_message,
)
from fusionp2p.records.job_ids import in_job, replica_job
from fusionp2p.records.limits import (
    AVERAGING_CODECS,
    MAX_EPOCH,
    MAX_MICRO_BATCHES,
    MAX_NODES,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_TOPK_RATIO,
)
from fusionp2p.records.model import ModelSpec
from fusionp2p.records.node_ranges import expand_ranges, node_ranges
from fusionp2p.records.protocols import COORD_PROTOCOL, EXEC_PROTOCOL, PROBE_PROTOCOL
from fusionp2p.records.shards import (
    MAX_SHARD_TENSORS,
    ShardGrant,
    ShardOrder,
    ShardReport,
    ShardRequest,
    ShardSource,
)
from fusionp2p.records.swarm import (
    CODEC_TERMS,
    LINKS_PER_SET,
    MAX_LINKS_PER_PEER,
    PEER_STATES,
    RUN_EVENT_CHARS,
    RUN_EVENTS,
    TRAIN_FLOPS,
    LeaseRecord,
    LinkRecord,
    LinkSetRecord,
    PeerRecord,
    PlanStageRecord,
    RunStatusRecord,
)
from fusionp2p.records.tensors import (
    FLOAT_DTYPES,
    OPDATA_DIRECTIONS,
    OPDATA_DTYPES,
    TOPK_INDEX_FORMATS,
    TOPK_VALUE_DTYPES,
    WIRE_DTYPES,
    OpData,
    TopKHeader,
)
from fusionp2p.records.wire import MAX_RECORD_BYTES, WireRecord, unpack_body

__all__ = [
    "AVERAGING_CHOICES",
    "AVERAGING_CODECS",
    "BASELINES",
    "CODEC_TERMS",
    "COMPRESSIONS",
    "CONTROL_REPLY_BYTES",
    "COORD_PROTOCOL",
    "CREDIT",
    "EXEC_COMMANDS",
    "EXEC_PROTOCOL",
    "FETCHABLE",
    "FINGERPRINT",
    "FLOAT_DTYPES",
    "LINKS_PER_SET",
    "MAX_EPOCH",
    "MAX_LINKS_PER_PEER",
    "MAX_MICRO_BATCHES",
    "MAX_NODES",
    "MAX_RECORD_BYTES",
    "MAX_REPLICAS",
    "MAX_SHARD_TENSORS",
    "MAX_STAGES",
    "MAX_TOPK_RATIO",
    "OPDATA_DIRECTIONS",
    "OPDATA_DTYPES",
    "PEER_STATES",
    "PLAN_METHODS",
    "PROBE_PROTOCOL",
    "RECORD_KINDS",
    "RUN_EVENTS",
    "RUN_EVENT_CHARS",
    "STEP_REPLY",
    "TOPK_INDEX_FORMATS",
    "TOPK_VALUE_DTYPES",
    "TRAIN_FLOPS",
    "WEIGHT_SOURCES",
    "WIRE_DTYPES",
    "ExecControl",
    "ExecHeader",
    "JobReply",
    "JobRequest",
    "JobSetup",
    "LeaseRecord",
    "LinkRecord",
    "LinkSetRecord",
    "LocalWeights",
    "ModelSpec",
    "OpData",
    "PeerRecord",
    "PlanStageRecord",
    "ReplicaGroup",
    "RunStatusRecord",
    "ShardGrant",
    "ShardOrder",
    "ShardReport",
    "ShardRequest",
    "ShardSource",
    "TopKHeader",
    "WireRecord",
    "decode_exec_header",
    "decode_record",
    "expand_ranges",
    "in_job",
    "message_prefix",
    "node_ranges",
    "pack_message",
    "replica_job",
    "split_message",
    "unpack_body",
]

RECORD_KINDS: dict[str, type[WireRecord]] = {
    cls.KIND: cls
    for cls in (
        PeerRecord,
        LinkRecord,
        LinkSetRecord,
        LeaseRecord,
        RunStatusRecord,
        PlanStageRecord,
        ModelSpec,
        TopKHeader,
        OpData,
        ExecControl,
        JobSetup,
        JobRequest,
        JobReply,
        LocalWeights,
        ReplicaGroup,
        ShardOrder,
        ShardReport,
        ShardGrant,
        ShardRequest,
        ShardSource,
    )
}  # every record, by the ``kind`` it carries on the wire


def decode_record(data: bytes | bytearray | memoryview, *, limit: int = MAX_RECORD_BYTES) -> WireRecord:
    """Decodes any known record by its ``kind`` field; at most ``limit`` bytes (and its
    kind's own limit).

    Raises:
        RecordError: the bytes are not a valid record of a known kind.
    """
    body = unpack_body(data, limit=limit)
    kind = body.get("kind")
    cls = RECORD_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError(f"unknown record kind {body.get('kind')!r:.40}")
    if len(data) > cls.MAX_BYTES:
        raise RecordError(f"{kind} record of {len(data)} bytes exceeds the limit of {cls.MAX_BYTES}")
    return cls.from_body(body)
