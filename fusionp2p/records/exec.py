"""The exec protocol's messages: control headers, a job's setup, and how a message is laid out.

    frame payload = header_len:u16 | header (an OpData or ExecControl record) | body

Every message gets one reply frame: ACK (an OpData's ACK carries ``CREDIT``, a step's
``STEP_REPLY``), ERROR (a UTF-8 reason) or DATA (a fetch, itself a message). The body of a
``setup`` is a ``JobSetup``; of ``weights``, safetensors bytes.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass
from typing import Annotated, ClassVar

from fusionp2p.config import NAME_RE, NO_WARMUP, PEER_ID_RE, OptimizerConfig, RatioWarmup
from fusionp2p.errors import RecordError
from fusionp2p.records.limits import (
    AVERAGING_CODECS,
    MAX_MICRO_BATCHES,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_TOPK_RATIO,
)
from fusionp2p.records.model import ModelSpec
from fusionp2p.records.node_ranges import check_ranges, expand_ranges
from fusionp2p.records.shards import NAMESPACE_RE, ShardSource
from fusionp2p.records.tensors import OpData
from fusionp2p.records.wire import MAX_RECORD_BYTES, Limit, Range, WireRecord, unpack_body

__all__ = [
    "CONTROL_REPLY_BYTES",
    "CREDIT",
    "EXEC_COMMANDS",
    "FETCHABLE",
    "FINGERPRINT",
    "MESSAGE_HEADER_LEN",
    "STEP_REPLY",
    "WEIGHT_SOURCES",
    "ExecControl",
    "ExecHeader",
    "JobSetup",
    "LocalWeights",
    "ReplicaGroup",
    "decode_exec_header",
    "message_prefix",
    "pack_message",
    "split_message",
]

# checkpoint: write this stage's shard (a ShardOrder); shard_put: a shard's replica, from a
# stage of the job; grant / shard_get: who may read a shard, and reading it (records.shards);
# load_local: load pretrained tensors from this peer's own copy (a LocalWeights); leaving:
# a stage owner tells its job's data owner that it is leaving the swarm (no body); regroup:
# a replicated stage's averaging group shrank (a ReplicaGroup)
EXEC_COMMANDS = (
    "setup",
    "weights",
    "step",
    "fetch",
    "teardown",
    "ping",
    "checkpoint",
    "shard_put",
    "grant",
    "shard_get",
    "load_local",
    "leaving",
    "regroup",
)
# state: every tensor and the optimizer's, for a checkpoint; fingerprint: statistics of the
# parameters (FINGERPRINT), which the replicas of a stage compare
FETCHABLE = ("params", "grads", "state", "fingerprint")
FINGERPRINT = struct.Struct("<4d")  # runtime.averaging.parameter_fingerprint
CONTROL_REPLY_BYTES = 4 << 10  # an ACK or an ERROR reason
CREDIT = struct.Struct("!Q")  # an OpData ACK's payload: bytes the receiver takes in flight from this sender
# a step ACK's payload: seconds computed, most micro-batches held at once, seconds spent
# averaging with the other replicas, and how many replicas averaged together (0: not replicated)
STEP_REPLY = struct.Struct("!dIdI")
MESSAGE_HEADER_LEN = struct.Struct("!H")  # the length of the header record that starts a message
_MAX_MADDRS = 8
_MAX_PARTS = 1 << 16  # parts of one shard
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_MAX_COUNTER = 1 << 62
_FINGERPRINT_RE = re.compile(r"^[\w.@:\-]{1,80}$")
_ENGINE_RE = re.compile(r"^[a-z0-9_\-]{1,32}$")


@dataclass(frozen=True)
class ExecControl(WireRecord):
    """A control message to an executor; its body (a JobSetup or safetensors) follows it."""

    KIND: ClassVar[str] = "exec_control"

    command: str  # one of EXEC_COMMANDS
    job: str
    iteration: int = 0
    n_micro_batches: int = 0
    what: str = ""  # fetch: one of FETCHABLE; shard_put: the shard's name
    body_bytes: int = 0  # length of the bytes that follow the header
    part: int = 0  # shard_put: which part of the shard this is, of ``parts``
    parts: int = 0

    def __post_init__(self) -> None:
        if self.command not in EXEC_COMMANDS:
            raise RecordError(f"ExecControl.command must be one of {EXEC_COMMANDS}, got {self.command!r}")
        if min(self.iteration, self.n_micro_batches, self.body_bytes, self.part, self.parts) < 0:
            raise RecordError("ExecControl counters must be >= 0")
        if self.parts > _MAX_PARTS or (self.parts and self.part >= self.parts):
            raise RecordError(f"ExecControl part {self.part} of {self.parts} (at most {_MAX_PARTS})")


ExecHeader = OpData | ExecControl


def message_prefix(header: ExecHeader) -> bytes:
    """The bytes a message starts with: the header's length and the header itself (the
    body follows, written without a copy)."""
    wire = header.to_wire()
    return MESSAGE_HEADER_LEN.pack(len(wire)) + wire


def pack_message(header: ExecHeader, body: bytes | bytearray = b"") -> bytes:
    """A whole message (a copy: ``message_prefix`` and the body written one after the
    other avoid it)."""
    return message_prefix(header) + body


def decode_exec_header(data: bytes | bytearray | memoryview) -> ExecHeader:
    """An OpData or ExecControl header.

    Raises:
        RecordError: any other record, or not a valid one.
    """
    kind = unpack_body(data).get("kind")
    for cls in (OpData, ExecControl):
        if kind == cls.KIND:
            return cls.from_wire(data)
    raise RecordError(f"a {kind!r:.40} record is not an exec message header")


def split_message(payload: bytes | bytearray) -> tuple[ExecHeader, bytes | bytearray]:
    """A whole message's header and body.

    Raises:
        RecordError: too short, a header that is not an exec header, or a body whose length
            disagrees with it.
    """
    if len(payload) < MESSAGE_HEADER_LEN.size:
        raise RecordError(f"message of {len(payload)} bytes has no header")
    (size,) = MESSAGE_HEADER_LEN.unpack_from(payload)
    start = MESSAGE_HEADER_LEN.size
    if size > MAX_RECORD_BYTES or start + size > len(payload):
        raise RecordError(f"header of {size} bytes in a message of {len(payload)}")
    header = decode_exec_header(payload[start : start + size])
    body = payload[start + size :]
    if len(body) != header.body_bytes:
        raise RecordError(f"body of {len(body)} bytes, header says {header.body_bytes}")
    return header, body


WEIGHT_SOURCES = ("seed", "owner", "shards")  # JobSetup.weights


@dataclass(frozen=True)
class JobSetup(WireRecord):
    """Everything a stage needs to build its executor: the body of a ``setup`` message."""

    KIND: ClassVar[str] = "job_setup"
    # 5: a msgpack record (it was JSON), stages' positions as node ranges (were runs)
    # 6: ``weights``: a stage makes its own initial tensors (a v5 stage would wait for them)
    # 7: ``replicas``: a stage of a replicated job averages its gradients with the same stage
    #    of the other replicas (a v6 stage would train its replica alone, and they would drift)
    VERSION: ClassVar[int] = 7
    MAX_BYTES: ClassVar[int] = 16 << 20  # a peer reads at most its ExecLimits.setup_bytes

    job: Annotated[str, Limit(64)]  # 1-64 letters, digits, '-' or '_'
    spec: ModelSpec
    peers: Annotated[tuple[tuple[str, tuple[str, ...]], ...], Limit(MAX_STAGES)]  # per stage: (id, maddrs)
    # per stage: the OP-DAG positions it runs (``node_ranges``), together every position once
    node_ranges: Annotated[tuple[Annotated[tuple[int, ...], Limit(1 << 16)], ...], Limit(MAX_STAGES)]
    stage: int  # the stage the receiving peer runs
    data_stage: int  # the data owner's stage: raw inputs and the loss
    n_micro_batches: Annotated[int, Range(1, MAX_MICRO_BATCHES)]
    optimizer: OptimizerConfig
    fingerprint: str  # OpDag.fingerprint of the data owner's traced model
    # Top-K ratio of what this stage sends each other stage: (destination, ratio), ratio > 1
    ratios: Annotated[
        tuple[tuple[int, Annotated[float, Range(1.0, MAX_TOPK_RATIO)]], ...], Limit(MAX_STAGES)
    ] = ()
    in_flight: int = 1  # micro-batches unfinished at once (1F1B window); memory is checked for this many
    engine: str = "torch"  # the execution engine that runs the stage (a PeerRecord lists its engines)
    plan_version: Annotated[int, Range(0, _MAX_COUNTER)] = 1  # every OpData of the job names it
    epoch: Annotated[int, Range(0, _MAX_COUNTER)] = 0  # the coordinator epoch of the plan; 0: none
    ratio_warmup: RatioWarmup = NO_WARMUP  # Top-K ratios grow from 1 (dense) to the plan's
    # where the stage's initial tensors come from: "seed" (made where it runs, from the spec's
    # seed: opdag.init), "owner" (the job's owner sends them as "weights") or "shards" (read
    # from the checkpoint shards ``restore`` names, peer to peer)
    weights: str = "seed"
    run: Annotated[str, Limit(64)] = ""  # the run this job is a plan of: where its shards are kept
    shard_ns: Annotated[str, Limit(64)] = ""  # the run's shard namespace (records.shards); "": none
    restore: Annotated[tuple[ShardSource, ...], Limit(1 << 12)] = ()
    # data parallelism (runtime.averaging): this stage is one of ``replicas`` that hold the
    # same parameters, in replica ``replica`` of the job ``group`` (the replicas' common name);
    # after each backward they average their gradients, waiting at most ``averaging_s``
    replicas: Annotated[int, Range(1, MAX_REPLICAS)] = 1
    replica: Annotated[int, Range(0, MAX_REPLICAS - 1)] = 0
    group: Annotated[str, Limit(64)] = ""
    averaging_s: Annotated[float, Range(0.1, 3600.0)] = 30.0
    # per replica, the peer that runs this stage: the only ones it averages with
    averaging_peers: Annotated[tuple[str, ...], Limit(MAX_REPLICAS)] = ()
    generation: Annotated[int, Range(0, _MAX_COUNTER)] = 0  # of the averaging group (ReplicaGroup)
    averaging_codec: str = "none"  # how this stage sends the gradients it averages (AVERAGING_CODECS)

    def __post_init__(self) -> None:
        n = len(self.peers)
        if self.averaging_codec not in AVERAGING_CODECS:
            raise RecordError(
                f"setup averaging codec {self.averaging_codec!r:.40} is not one of {sorted(AVERAGING_CODECS)}"
            )
        if self.weights not in WEIGHT_SOURCES:
            raise RecordError(f"setup weights {self.weights!r:.40} is not one of {WEIGHT_SOURCES}")
        if self.run and not NAME_RE.match(self.run):
            raise RecordError(f"setup run {self.run!r:.80} is not 1-64 letters, digits, '-' or '_'")
        if self.shard_ns and (not self.run or not NAMESPACE_RE.match(self.shard_ns)):
            raise RecordError("setup shard namespace is not 64 hex digits of a named run")
        if self.restore and self.weights != "shards":
            raise RecordError("setup names shards to restore from, but its weights are not 'shards'")
        if not NAME_RE.match(self.job):
            raise RecordError(f"setup job {self.job!r:.80} is not 1-64 letters, digits, '-' or '_'")
        if not 1 <= n <= MAX_STAGES or len(self.node_ranges) != n:
            raise RecordError(f"setup needs 1-{MAX_STAGES} stages, each with its peer and node ranges")
        if not 0 <= self.stage < n or not 0 <= self.data_stage < n:
            raise RecordError(f"setup stage {self.stage} / data stage {self.data_stage} not in [0, {n})")
        for peer_id, maddrs in self.peers:
            if not PEER_ID_RE.match(peer_id):
                raise RecordError(f"setup peer id {peer_id!r:.80} is not a base58 PeerID")
            if len(maddrs) > _MAX_MADDRS or any(not m.startswith("/") for m in maddrs):
                raise RecordError(f"setup multiaddrs of {peer_id[:12]}: <= {_MAX_MADDRS} '/...' strings")
        for s, ranges in enumerate(self.node_ranges):
            check_ranges(ranges, f"setup node ranges of stage {s}")
        if not self.assignment:  # checks that every position has exactly one stage
            raise RecordError("setup node ranges name no OP-DAG position")
        if not _FINGERPRINT_RE.match(self.fingerprint) or not _ENGINE_RE.match(self.engine):
            raise RecordError(f"setup fingerprint {self.fingerprint!r:.80} or engine {self.engine!r:.40}")
        if any(not 0 <= dst < n or dst == self.stage for dst, _ in self.ratios):
            raise RecordError(f"setup ratios name stages outside [0, {n}) or this stage")
        if not 1 <= self.in_flight <= self.n_micro_batches:
            raise RecordError(f"setup in_flight {self.in_flight} not in [1, {self.n_micro_batches}]")
        self._check_replicas()

    def _check_replicas(self) -> None:
        if self.group and not NAME_RE.match(self.group):
            raise RecordError(f"setup group {self.group!r:.80} is not 1-64 letters, digits, '-' or '_'")
        if self.replica >= self.replicas or (self.replicas > 1 and not self.group):
            raise RecordError(
                f"setup replica {self.replica} of {self.replicas} needs 0 <= replica < replicas, and a "
                "group name (1-64 letters, digits, '-' or '_') when replicas > 1"
            )
        if self.replicas > 1 and (
            len(self.averaging_peers) != self.replicas
            or not all(PEER_ID_RE.match(p) for p in self.averaging_peers)
            or self.averaging_peers[self.replica] != self.peers[self.stage][0]
        ):
            raise RecordError("setup averaging peers: one PeerID per replica, this stage's at its replica")

    @property
    def n_stages(self) -> int:
        return len(self.peers)

    @functools.cached_property
    def assignment(self) -> tuple[int, ...]:
        """The stage of each OP-DAG position."""
        owner: dict[int, int] = {}
        for stage, ranges in enumerate(self.node_ranges):
            for pos in expand_ranges(ranges):
                if pos in owner:
                    raise RecordError(f"setup gives OP-DAG position {pos} to two stages")
                owner[pos] = stage
        if sorted(owner) != list(range(len(owner))):
            raise RecordError("setup node ranges leave OP-DAG positions to no stage")
        return tuple(owner[i] for i in range(len(owner)))

    def peer_of(self, stage: int) -> str:
        return self.peers[stage][0]


@dataclass(frozen=True)
class LocalWeights(WireRecord):
    """The body of a ``load_local``: the pretrained tensors a stage may load from its own
    copy (``fusionp2p peer --weights-dir``), each as (its name in the model, its key in the
    files, the sha256 of its bytes as saved, the model's dtype)."""

    KIND: ClassVar[str] = "local_weights"
    MAX_BYTES: ClassVar[int] = 4 << 20

    tensors: Annotated[
        tuple[tuple[Annotated[str, Limit(512)], Annotated[str, Limit(512)], str, str], ...], Limit(1 << 16)
    ]

    def __post_init__(self) -> None:
        for name, key, digest, dtype in self.tensors:
            if not _DIGEST_RE.match(digest) or dtype not in _FLOAT_DTYPES:
                raise RecordError(
                    f"local weights of {name[:80]!r} ({key[:80]!r}): a bad digest or dtype {dtype!r:.20}"
                )


@dataclass(frozen=True)
class ReplicaGroup(WireRecord):
    """The body of a ``regroup``: a replicated stage's averaging group from now on (a replica
    was lost): the peers of this stage in the replicas left, this stage's place among them,
    and the group's generation (each regroup starts a new averaging group)."""

    KIND: ClassVar[str] = "replica_group"
    MAX_BYTES: ClassVar[int] = 64 << 10

    generation: Annotated[int, Range(1, _MAX_COUNTER)]
    replica: Annotated[int, Range(0, MAX_REPLICAS - 1)]
    averaging_peers: Annotated[tuple[str, ...], Limit(MAX_REPLICAS)]

    def __post_init__(self) -> None:
        peers = self.averaging_peers
        if not 0 <= self.replica < len(peers) or not all(PEER_ID_RE.match(p) for p in peers):
            raise RecordError("replica group: one PeerID per replica left, this stage's at its place")
