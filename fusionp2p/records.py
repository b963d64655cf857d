"""Everything that goes into the DHT: versioned, validated wire records.

Each record is a frozen dataclass with ``to_wire() -> bytes`` and ``from_wire(bytes)``.
The wire form is a msgpack map with string keys (never pickle). ``from_wire`` checks
size, types and ranges, ignores unknown fields (so newer peers can add some) and
rejects a newer *major* schema version. Every record stays far below hivemind's
~32 KiB DHT value limit: ``MAX_RECORD_BYTES`` is enforced on both ends, and it keeps a
whole store request (record + signed subkey + framing) under the 4 KiB that hivemind's
DHT process can read from its pipe in one piece (larger requests can be torn and hang).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NoReturn, TypeVar, get_type_hints

import msgpack

from fusionp2p.errors import RecordError

__all__ = [
    "CODEC_TERMS",
    "EXEC_COMMANDS",
    "FETCHABLE",
    "MAX_LINKS_PER_PEER",
    "MAX_RECORD_BYTES",
    "OPDATA_DIRECTIONS",
    "OPDATA_DTYPES",
    "PEER_STATES",
    "RUN_EVENTS",
    "RUN_EVENT_CHARS",
    "SITE_PATTERN",
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

MAX_RECORD_BYTES = 2048
# A peer's links key holds at most this many links, packed LINKS_PER_SET to a signed
# LinkSetRecord (<= 1.4 KiB, ~2.2 KiB with its 2048-bit owner marker and signature): 4 sets,
# < 10 KiB per key whatever the swarm's size (net/directory.py), one signature per 16 links.
MAX_LINKS_PER_PEER = 64
LINKS_PER_SET = 16
PEER_STATES = ("joining", "idle", "training", "leaving")
_MAX_LIST = 16
_MAX_STRS = 64  # a list of strings: multiaddrs, the consumer nodes of an OpData
_MAX_INTS = 128  # node ranges of a plan stage; a tensor shape
_MAX_STR = 256

R = TypeVar("R", bound="_WireRecord")


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


Checker = Callable[[Any], Any]


def _checker(name: str, annotation: Any) -> Checker:
    """A function that checks one decoded field against its annotation and returns the
    normalized value (built once per field: decoding runs for every message)."""
    origin = getattr(annotation, "__origin__", None)

    def fail(what: str, value: Any) -> NoReturn:
        raise RecordError(f"field {name!r} must be {what}, got {value!r:.80}")

    if annotation is str:

        def check_str(value: Any) -> Any:
            if value.__class__ is not str or len(value) > _MAX_STR:
                fail(f"a string of <= {_MAX_STR} chars", value)
            return value

        return check_str
    if annotation is bool:

        def check_bool(value: Any) -> Any:
            if value.__class__ is not bool:
                fail("a boolean", value)
            return value

        return check_bool
    if annotation is bytes:

        def check_bytes(value: Any) -> Any:
            if value.__class__ is not bytes or len(value) > MAX_RECORD_BYTES:
                fail(f"bytes of <= {MAX_RECORD_BYTES}", value)
            return value

        return check_bytes
    if annotation is int:

        def check_int(value: Any) -> Any:
            if value.__class__ is not int:
                fail("an integer", value)
            return value

        return check_int
    if annotation is float:

        def check_float(value: Any) -> Any:
            if value.__class__ not in (int, float) or not math.isfinite(value):
                fail("a finite number", value)
            return float(value)

        return check_float
    if origin is tuple:
        item_type = annotation.__args__[0]
        limit = _MAX_STRS if item_type is str else _MAX_INTS
        item = _checker(f"{name}[]", item_type)

        def check_tuple(value: Any) -> Any:
            if value.__class__ not in (list, tuple) or len(value) > limit:
                fail(f"a list of <= {limit} items", value)
            return tuple(item(v) for v in value)

        return check_tuple
    if origin is dict:
        key, item = _checker(f"{name} key", str), _checker(f"{name}[]", float)

        def check_dict(value: Any) -> Any:
            if value.__class__ is not dict or len(value) > _MAX_LIST:
                fail(f"a map of <= {_MAX_LIST} items", value)
            return {key(k): item(v) for k, v in value.items()}

        return check_dict
    raise TypeError(f"unsupported annotation {annotation!r} for {name}")  # a bug here, not input


@functools.cache
def _checkers(cls: type) -> tuple[tuple[str, Checker], ...]:
    """(field name, checker) of a record class, in declaration order (``get_type_hints`` is
    slow: resolved once per class)."""
    hints = get_type_hints(cls)
    return tuple((f.name, _checker(f.name, hints[f.name])) for f in fields(cls))


TRAIN_FLOPS = "train_float32"  # PeerRecord.flops key: a transformer block's forward + backward
# PeerRecord.topk_codec_s keys: seconds of Top-K coding per dense element and per kept entry, on
# the sending side (encode the activation, decode its gradient) and the receiving side (decode
# the activation, gather its gradient at the kept positions)
CODEC_TERMS = ("send_element_s", "send_entry_s", "recv_element_s", "recv_entry_s")
SITE_PATTERN = re.compile(r"[A-Za-z0-9._-]{0,64}")  # PeerRecord.site; "" for none


@dataclass(frozen=True)
class _WireRecord:
    """Shared encode/decode for records; subclasses set ``KIND`` and declare fields."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1  # major schema version; minor additions are new optional fields

    def to_wire(self) -> bytes:
        """Encodes the record; raises RecordError if it would exceed MAX_RECORD_BYTES."""
        body = {"kind": self.KIND, "v": self.VERSION}
        for name in _field_names(type(self)):  # type: ignore[arg-type]  # shallow: no deep copy
            body[name] = getattr(self, name)
        data = msgpack.packb(body, use_bin_type=True)
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"{self.KIND} record is {len(data)} bytes > {MAX_RECORD_BYTES}")
        return data

    @classmethod
    def from_wire(cls: type[R], data: bytes) -> R:
        """Decodes and validates a record of this class.

        Raises:
            RecordError: oversized, not msgpack, wrong kind, newer major version,
                a missing required field or a field of the wrong type or range.
        """
        body = _unpack(data)
        if not isinstance(body.get("kind"), str) or body["kind"] != cls.KIND:
            raise RecordError(f"expected a {cls.KIND!r} record, got kind {body.get('kind')!r:.40}")
        return cls._from_body(body)

    @classmethod
    def from_dict(cls: type[R], fields_: dict[str, Any]) -> R:
        """Validates a plain dict of fields (e.g. from ``fusionp2p status --json``)."""
        return cls._from_body({"v": cls.VERSION, **fields_})

    @classmethod
    def _from_body(cls: type[R], body: dict[str, Any]) -> R:
        version = body.get("v")
        if not isinstance(version, int) or version < 1:
            raise RecordError(f"{cls.KIND} record has no valid version, got {version!r:.40}")
        if version > cls.VERSION:
            raise RecordError(f"{cls.KIND} record version {version} is newer than {cls.VERSION}")
        kwargs = {}
        for name, check in _checkers(cls):  # type: ignore[arg-type]
            if name in body:
                kwargs[name] = check(body[name])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, OverflowError) as e:
            raise RecordError(f"{cls.KIND} record misses a field or has a bad one: {e}") from e


def _unpack(data: bytes | bytearray) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray)):
        raise RecordError(f"a record must be bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes exceeds the limit of {MAX_RECORD_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        raise RecordError(f"record is not valid msgpack: {e}") from e
    if not isinstance(body, dict):
        raise RecordError(f"record must be a map, got {type(body).__name__}")
    return body


@dataclass(frozen=True)
class PeerRecord(_WireRecord):
    """A peer's measured profile and addresses, refreshed by its heartbeat."""

    KIND: ClassVar[str] = "peer"
    VERSION: ClassVar[int] = 4  # 2: units in the field names, job, stage_s; 3: topk_codec_s; 4: site

    peer_id: str  # base58 libp2p PeerID; must match the key that signed the record
    maddrs: tuple[str, ...]  # multiaddrs others can dial
    device: str  # "cpu" or "cuda:N"
    device_name: str  # human-readable device model
    flops: dict[str, float]  # measured matmul FLOP/s per dtype ("float32", "bfloat16", ...)
    memory_bytes: int  # free memory on the device at the last heartbeat
    total_memory_bytes: int  # total memory on the device
    state: str  # one of PEER_STATES
    started_at: float  # DHT time the peer started
    updated_at: float  # DHT time of this heartbeat
    torch_version: str = ""
    fusionp2p_version: str = ""
    executors: tuple[str, ...] = ("torch",)  # execution engines this peer offers
    upload_limit_bytes_per_s: float = 0.0  # declared cap on outgoing bytes/s, 0 for none
    job: str = ""  # the job whose stage it runs, while training
    stage_s: float = 0.0  # that stage's compute seconds in its last iteration
    topk_codec_s: dict[str, float] = field(default_factory=dict)  # CODEC_TERMS, measured; {}: unknown
    site: str = ""  # declared data centre: peers of one site share its links to other sites

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise RecordError("PeerRecord.peer_id is empty")
        if not SITE_PATTERN.fullmatch(self.site):
            raise RecordError(f"PeerRecord.site takes up to 64 of [A-Za-z0-9._-], got {self.site[:80]!r}")
        if set(self.topk_codec_s) - set(CODEC_TERMS) or not all(
            0 <= v < 1 for v in self.topk_codec_s.values()
        ):
            raise RecordError(
                f"PeerRecord.topk_codec_s takes {CODEC_TERMS} in [0, 1) s, got {self.topk_codec_s}"
            )
        if self.state not in PEER_STATES:
            raise RecordError(f"PeerRecord.state must be one of {PEER_STATES}, got {self.state!r}")
        if self.memory_bytes < 0 or self.total_memory_bytes < 0:
            raise RecordError(
                f"PeerRecord memory must be >= 0, got {self.memory_bytes}/{self.total_memory_bytes}"
            )
        if any(v <= 0 for v in self.flops.values()) or "float32" not in self.flops:
            raise RecordError(f"PeerRecord.flops needs a positive 'float32' entry, got {self.flops}")
        if self.upload_limit_bytes_per_s < 0:
            raise RecordError(
                f"PeerRecord.upload_limit_bytes_per_s must be >= 0, got {self.upload_limit_bytes_per_s}"
            )

    @property
    def fp32_flops(self) -> float:
        """Measured (or declared) float32 matmul speed in FLOP/s."""
        return self.flops["float32"]

    @property
    def train_flops(self) -> float:
        """The speed plans divide FLOPs by: a transformer block's forward + backward as the
        peer measured it (``TRAIN_FLOPS``), else the fp32 matmul speed (declared)."""
        return self.flops.get(TRAIN_FLOPS, self.flops["float32"])


@dataclass(frozen=True)
class LinkRecord(_WireRecord):
    """One measured direction of one link: ``src`` sending to ``dst``."""

    KIND: ClassVar[str] = "link"
    VERSION: ClassVar[int] = 2  # 2: units in the field names (bandwidth_bytes_per_s)

    src: str  # base58 PeerID of the measuring (sending) peer; must match the signer
    dst: str  # base58 PeerID of the receiving peer
    bandwidth_bytes_per_s: float  # smoothed goodput in bytes per second
    rtt_s: float  # smoothed round-trip time in seconds
    measured_at: float  # DHT time of the latest probe
    samples: int = 1  # probes folded into the smoothed values
    extra: dict[str, float] = field(default_factory=dict)  # room for later measurements

    def __post_init__(self) -> None:
        if not self.src or not self.dst or self.src == self.dst:
            raise RecordError(f"LinkRecord needs two distinct peers, got {self.src!r} -> {self.dst!r}")
        if self.bandwidth_bytes_per_s <= 0 or self.rtt_s < 0:
            raise RecordError(
                f"LinkRecord needs bandwidth > 0 and rtt >= 0, got {self.bandwidth_bytes_per_s}, {self.rtt_s}"
            )
        if self.samples < 1:
            raise RecordError(f"LinkRecord.samples must be >= 1, got {self.samples}")


@dataclass(frozen=True)
class LinkSetRecord(_WireRecord):
    """Up to ``LINKS_PER_SET`` links measured by one peer, as they live in the DHT: part
    ``part`` of its links key (one signature and one validation per set, not per link)."""

    KIND: ClassVar[str] = "linkset"
    VERSION: ClassVar[int] = 1

    src: str  # the measuring peer; must match the signer
    part: int  # 0 .. MAX_LINKS_PER_PEER // LINKS_PER_SET - 1
    dst: tuple[str, ...]
    bandwidth_bytes_per_s: tuple[float, ...]
    rtt_s: tuple[float, ...]
    measured_at: tuple[float, ...]
    samples: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.dst)
        if not 0 <= self.part < MAX_LINKS_PER_PEER // LINKS_PER_SET:
            raise RecordError(
                f"LinkSetRecord.part must be in [0, {MAX_LINKS_PER_PEER // LINKS_PER_SET}), got {self.part}"
            )
        if n > LINKS_PER_SET or any(
            len(v) != n for v in (self.bandwidth_bytes_per_s, self.rtt_s, self.measured_at, self.samples)
        ):
            raise RecordError(f"LinkSetRecord needs <= {LINKS_PER_SET} links with every field of each")
        if len(set(self.dst)) != n:
            raise RecordError("LinkSetRecord names a destination twice")
        self.links()  # each link must be a valid LinkRecord

    def links(self) -> list[LinkRecord]:
        """The links this set holds."""
        return [
            LinkRecord(self.src, dst, bw, rtt, at, samples)
            for dst, bw, rtt, at, samples in zip(
                self.dst, self.bandwidth_bytes_per_s, self.rtt_s, self.measured_at, self.samples, strict=True
            )
        ]

    @classmethod
    def pack(cls, links: Sequence[LinkRecord]) -> list[LinkSetRecord]:
        """``links`` of one source (at most ``MAX_LINKS_PER_PEER``) as sets, parts 0, 1, ...

        Raises:
            RecordError: too many links, or links of more than one source.
        """
        if len(links) > MAX_LINKS_PER_PEER or len({lk.src for lk in links}) > 1:
            raise RecordError(
                f"a peer publishes at most {MAX_LINKS_PER_PEER} links of its own, got {len(links)} "
                f"from {len({lk.src for lk in links})} source(s)"
            )
        return [
            cls(
                src=links[0].src,
                part=i // LINKS_PER_SET,
                dst=tuple(lk.dst for lk in chunk),
                bandwidth_bytes_per_s=tuple(lk.bandwidth_bytes_per_s for lk in chunk),
                rtt_s=tuple(lk.rtt_s for lk in chunk),
                measured_at=tuple(lk.measured_at for lk in chunk),
                samples=tuple(lk.samples for lk in chunk),
            )
            for i in range(0, len(links), LINKS_PER_SET)
            for chunk in [links[i : i + LINKS_PER_SET]]
        ]


@dataclass(frozen=True)
class LeaseRecord(_WireRecord):
    """A claim on the swarm's coordinator lease (``coordination/election.py``)."""

    KIND: ClassVar[str] = "lease"

    holder: str  # base58 PeerID of the claimant; must match the signer
    epoch: int  # the fencing token: every plan names the epoch it was made in
    granted_at: float  # DHT time the holder took this epoch
    valid_until: float  # DHT time the lease runs out unless renewed
    maddrs: tuple[str, ...] = ()  # where a data owner reaches the coordinator

    def __post_init__(self) -> None:
        if not self.holder or self.epoch < 1:
            raise RecordError(f"LeaseRecord needs a holder and an epoch >= 1, got {self.epoch}")
        if self.valid_until < self.granted_at:
            raise RecordError("LeaseRecord.valid_until is before granted_at")


RUN_EVENTS = 3  # events a RunStatusRecord carries (the newest)
RUN_EVENT_CHARS = 160


@dataclass(frozen=True)
class RunStatusRecord(_WireRecord):
    """A training run as its data owner reports it: progress and its last fault events."""

    KIND: ClassVar[str] = "run_status"

    run_id: str  # the run (its plans' wire ids are this, then "<run>-p<version>")
    data_owner: str  # base58 PeerID; must match the signer
    job: str  # the wire id of the plan in force
    step: int
    steps: int
    loss: float
    plan_version: int
    epoch: int
    replans: int
    events: tuple[str, ...]  # the newest RUN_EVENTS events, "<kind>: <message>", oldest first
    updated_at: float  # DHT time

    def __post_init__(self) -> None:
        if not 0 <= self.step <= self.steps or min(self.plan_version, self.epoch, self.replans) < 0:
            raise RecordError(f"RunStatusRecord counters out of range (step {self.step} of {self.steps})")
        if len(self.events) > RUN_EVENTS or any(len(e) > RUN_EVENT_CHARS for e in self.events):
            raise RecordError(f"RunStatusRecord holds at most {RUN_EVENTS} events of {RUN_EVENT_CHARS} chars")


@dataclass(frozen=True)
class PlanStageRecord(_WireRecord):
    """One stage of a job's Plan: who runs which OP-DAG nodes, and each outgoing link's ratio."""

    KIND: ClassVar[str] = "plan_stage"
    VERSION: ClassVar[int] = 2  # 2: names its job's data owner; epochs are the coordinator's lease epochs

    plan_id: str  # the job this plan is for
    epoch: int  # the coordinator's lease epoch when it made the plan
    stage: int  # 0..n_stages-1, in topological order
    n_stages: int
    peer_id: str  # owner of the stage
    dag: str  # fingerprint of the OP-DAG being split
    node_ranges: tuple[int, ...]  # flat [start, end) pairs over the OP-DAG's topological order
    links_to: dict[str, float]  # destination stage (as text) -> Top-K ratio
    n_micro_batches: int
    est_iteration_s: float  # the estimate the plan was chosen for
    made_by: str  # PeerID of the coordinator
    made_at: float  # DHT time
    data_owner: str = ""  # PeerID of the job's data owner: the only peer that may set the plan up

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.n_stages:
            raise RecordError(f"PlanStageRecord.stage {self.stage} not in [0, {self.n_stages})")
        if len(self.node_ranges) % 2 or any(
            b <= a for a, b in zip(self.node_ranges[::2], self.node_ranges[1::2], strict=True)
        ):
            raise RecordError(
                f"PlanStageRecord.node_ranges must be [start, end) pairs, got {self.node_ranges}"
            )
        if any(r < 1 for r in self.links_to.values()) or self.n_micro_batches < 1:
            raise RecordError("PlanStageRecord ratios and n_micro_batches must be >= 1")


TOPK_VALUE_DTYPES = ("float32", "float16", "bfloat16")
TOPK_INDEX_FORMATS = ("dense", "int32", "delta16", "bitmap", "shared")


@dataclass(frozen=True)
class TopKHeader(_WireRecord):
    """How a Top-K-compressed tensor's body is laid out (carried in OpData's compression metadata).

    body = index section (``index_bytes``) followed by the values (``k`` x value dtype).
    ``shared``: no index section; the values sit at the indices of the forward message
    this is the gradient of, which both ends already hold.
    """

    KIND: ClassVar[str] = "topk"

    shape: tuple[int, ...]  # the dense tensor's shape
    dtype: str  # the dense tensor's dtype name
    value_dtype: str  # dtype of the kept values on the wire, one of TOPK_VALUE_DTYPES
    index_format: str  # one of TOPK_INDEX_FORMATS ("dense": no indices, every value sent)
    numel: int
    k: int  # entries kept
    index_bytes: int
    ratio: float  # the ratio asked for (numel / k when it was applied)
    base: int = 0  # delta16: the first index

    def __post_init__(self) -> None:
        if self.value_dtype not in TOPK_VALUE_DTYPES or self.dtype not in TOPK_VALUE_DTYPES:
            raise RecordError(
                f"TopKHeader dtypes must be in {TOPK_VALUE_DTYPES}, got {self.dtype}/{self.value_dtype}"
            )
        if self.index_format not in TOPK_INDEX_FORMATS:
            raise RecordError(
                f"TopKHeader.index_format must be in {TOPK_INDEX_FORMATS}, got {self.index_format!r}"
            )
        if any(d < 0 for d in self.shape) or math.prod(self.shape) != self.numel:
            raise RecordError(f"TopKHeader shape {self.shape} does not hold numel {self.numel}")
        if not 0 <= self.k <= self.numel or self.index_bytes < 0 or self.base < 0:
            raise RecordError(
                f"TopKHeader needs 0 <= k <= numel and sizes >= 0, got k={self.k}, numel={self.numel}"
            )


OPDATA_DIRECTIONS = ("forward", "backward")
OPDATA_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "bool", "uint8", "int8")


@dataclass(frozen=True)
class OpData(_WireRecord):
    """The header of one tensor crossing from one sub-DAG to another (FusionLLM §3.4).

    Forward: the output of ``producer`` for ``consumers`` (nodes of the receiving stage).
    Backward: the gradient of ``producer``'s output from ``consumers``' side. The tensor's
    bytes follow the header in the same message; ``compression`` holds a ``TopKHeader``
    when they are Top-K-compressed, and is empty for dense little-endian bytes.
    """

    KIND: ClassVar[str] = "opdata"

    job: str  # the job (plan) this belongs to; other jobs' OpData is rejected
    direction: str  # "forward" or "backward"
    producer: str  # OP-DAG node whose output (or its gradient) this is
    consumers: tuple[str, ...]  # OP-DAG nodes on the consuming side
    requires_grad: bool  # forward: the receiver must send a gradient back
    iteration: int
    micro_batch: int
    shape: tuple[int, ...]
    dtype: str  # one of OPDATA_DTYPES
    body_bytes: int  # length of the bytes that follow the header
    compression: bytes = b""  # a TopKHeader on the wire, or empty
    zero: bool = False  # backward: the gradient is all zeros and no body follows
    src_stage: int = 0
    dst_stage: int = 0
    plan_version: int = 1  # the version of the job's plan it was sent under; others are dropped

    def __post_init__(self) -> None:
        if self.direction not in OPDATA_DIRECTIONS:
            raise RecordError(f"OpData.direction must be one of {OPDATA_DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in OPDATA_DTYPES:
            raise RecordError(f"OpData.dtype must be one of {OPDATA_DTYPES}, got {self.dtype!r}")
        if not self.producer or not self.consumers:
            raise RecordError("OpData needs a producer and at least one consumer")
        if min(self.iteration, self.micro_batch, self.body_bytes, self.src_stage, self.dst_stage) < 0:
            raise RecordError("OpData iteration, micro_batch, body_bytes and stages must be >= 0")
        if any(d < 0 for d in self.shape):
            raise RecordError(f"OpData.shape has a negative dimension: {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


EXEC_COMMANDS = ("setup", "weights", "step", "fetch", "teardown", "ping")
FETCHABLE = ("params", "grads", "state")  # state: every tensor and the optimizer's, for a checkpoint


@dataclass(frozen=True)
class ExecControl(_WireRecord):
    """A control message to an executor; its body (JSON or safetensors) follows it."""

    KIND: ClassVar[str] = "exec_control"

    command: str  # one of EXEC_COMMANDS
    job: str
    iteration: int = 0
    n_micro_batches: int = 0
    what: str = ""  # fetch: one of FETCHABLE
    body_bytes: int = 0  # length of the JSON or safetensors bytes that follow the header

    def __post_init__(self) -> None:
        if self.command not in EXEC_COMMANDS:
            raise RecordError(f"ExecControl.command must be one of {EXEC_COMMANDS}, got {self.command!r}")
        if min(self.iteration, self.n_micro_batches, self.body_bytes) < 0:
            raise RecordError("ExecControl counters must be >= 0")


_KINDS: dict[str, type[_WireRecord]] = {
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
    body = _unpack(data)
    kind = body.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError(f"unknown record kind {body.get('kind')!r:.40}")
    return cls._from_body(body)  # type: ignore[return-value]
