"""Records peers publish to the DHT: profiles, links, the coordinator's lease, run status
and the plan's stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from fusionp2p.config import SITE_PATTERN
from fusionp2p.errors import RecordError
from fusionp2p.records.limits import AVERAGING_CODECS, MAX_EPOCH, MAX_REPLICAS
from fusionp2p.records.node_ranges import check_ranges
from fusionp2p.records.wire import Range, WireRecord

__all__ = [
    "CODEC_TERMS",
    "LINKS_PER_SET",
    "MAX_LINKS_PER_PEER",
    "PEER_STATES",
    "RUN_EVENTS",
    "RUN_EVENT_CHARS",
    "TRAIN_FLOPS",
    "LeaseRecord",
    "LinkRecord",
    "LinkSetRecord",
    "PeerRecord",
    "PlanStageRecord",
    "RunStatusRecord",
]

# A peer's links key holds at most this many links, packed LINKS_PER_SET to a signed
# LinkSetRecord (<= 1.4 KiB, ~2.2 KiB with its 2048-bit owner marker and signature): 4 sets,
# < 10 KiB per key whatever the swarm's size (net/directory.py), one signature per 16 links.
MAX_LINKS_PER_PEER = 64
LINKS_PER_SET = 16
PEER_STATES = ("joining", "idle", "training", "leaving")


TRAIN_FLOPS = "train_float32"  # PeerRecord.flops key: a transformer block's forward + backward
# PeerRecord.topk_codec_s keys: seconds of Top-K coding per dense element and per kept entry, on
# the sending side (encode the activation, decode its gradient) and the receiving side (decode
# the activation, gather its gradient at the kept positions)
CODEC_TERMS = ("send_element_s", "send_entry_s", "recv_element_s", "recv_entry_s")


@dataclass(frozen=True)
class PeerRecord(WireRecord):
    """A peer's measured profile and addresses, refreshed by its heartbeat."""

    KIND: ClassVar[str] = "peer"
    # 2: units in the field names. Later fields (job, stage_s, topk_codec_s, site) are optional
    # additions; 3 and 4 were bumped for them before the rule that only breaking changes bump
    VERSION: ClassVar[int] = 4

    peer_id: str  # base58 libp2p PeerID; must match the key that signed the record
    maddrs: tuple[str, ...]  # multiaddrs others can dial
    device: str  # "cpu" or "cuda:N"
    device_name: str  # human-readable device model
    flops: dict[str, float]  # measured matmul FLOP/s per dtype ("float32", "bfloat16", ...)
    memory_bytes: int  # what one stage may use here at the last heartbeat: free memory, within --max-memory
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
class LinkRecord(WireRecord):
    """One measured direction of one link: ``src`` sending to ``dst``."""

    KIND: ClassVar[str] = "link"
    VERSION: ClassVar[int] = 2  # 2: units in the field names (bandwidth_bytes_per_s)

    src: str  # base58 PeerID of the measuring (sending) peer; must match the signer
    dst: str  # base58 PeerID of the receiving peer
    bandwidth_bytes_per_s: float  # goodput in bytes per second: the best of the recent probes
    rtt_s: float  # round-trip time in seconds: the lowest of the recent probes
    measured_at: float  # DHT time of the latest probe
    samples: int = 1  # probes of this link so far
    extra: dict[str, float] = field(default_factory=dict)  # room for later measurements
    probe_bytes: int = 0  # payload of the probe that measured the bandwidth (0: not reported)

    def __post_init__(self) -> None:
        if not self.src or not self.dst or self.src == self.dst:
            raise RecordError(f"LinkRecord needs two distinct peers, got {self.src!r} -> {self.dst!r}")
        if self.bandwidth_bytes_per_s <= 0 or self.rtt_s < 0:
            raise RecordError(
                f"LinkRecord needs bandwidth > 0 and rtt >= 0, got {self.bandwidth_bytes_per_s}, {self.rtt_s}"
            )
        if self.samples < 1:
            raise RecordError(f"LinkRecord.samples must be >= 1, got {self.samples}")
        if self.probe_bytes < 0:
            raise RecordError(f"LinkRecord.probe_bytes must be >= 0, got {self.probe_bytes}")


@dataclass(frozen=True)
class LinkSetRecord(WireRecord):
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
    probe_bytes: tuple[
        int, ...
    ] = ()  # per link, the payload its bandwidth was measured with (minor addition)

    def __post_init__(self) -> None:
        n = len(self.dst)
        if self.probe_bytes and len(self.probe_bytes) != n:
            raise RecordError(f"LinkSetRecord.probe_bytes needs one size per link ({n})")
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
        sizes = self.probe_bytes or (0,) * len(self.dst)
        return [
            LinkRecord(self.src, dst, bw, rtt, at, samples, probe_bytes=size)
            for dst, bw, rtt, at, samples, size in zip(
                self.dst,
                self.bandwidth_bytes_per_s,
                self.rtt_s,
                self.measured_at,
                self.samples,
                sizes,
                strict=True,
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
                probe_bytes=tuple(lk.probe_bytes for lk in chunk),
            )
            for i in range(0, len(links), LINKS_PER_SET)
            for chunk in [links[i : i + LINKS_PER_SET]]
        ]


@dataclass(frozen=True)
class LeaseRecord(WireRecord):
    """A claim on the swarm's coordinator lease (``coordination/election.py``: what readers
    accept of one)."""

    KIND: ClassVar[str] = "lease"

    holder: str  # base58 PeerID of the claimant; must match the signer
    epoch: Annotated[int, Range(1, MAX_EPOCH)]  # the fencing token: every plan names its epoch
    granted_at: float  # DHT time the holder took this epoch
    valid_until: float  # DHT time the lease runs out unless renewed
    maddrs: tuple[str, ...] = ()  # where a data owner reaches the coordinator
    period_s: float = 0.0  # the holder's lease period (0: an older peer's, the default period)

    def __post_init__(self) -> None:
        if not self.holder or self.epoch < 1:
            raise RecordError(f"LeaseRecord needs a holder and an epoch >= 1, got {self.epoch}")
        if self.valid_until < self.granted_at:
            raise RecordError("LeaseRecord.valid_until is before granted_at")


RUN_EVENTS = 3  # events a RunStatusRecord carries (the newest)
RUN_EVENT_CHARS = 160


@dataclass(frozen=True)
class RunStatusRecord(WireRecord):
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
    replicas: int = 1  # data-parallel replicas running the plan in force
    samples_per_s: float = 0.0  # in the last step
    averaging_s: float = 0.0  # in the last step: the longest a stage spent averaging with its replicas

    def __post_init__(self) -> None:
        if not 0 <= self.step <= self.steps or min(self.plan_version, self.epoch, self.replans) < 0:
            raise RecordError(f"RunStatusRecord counters out of range (step {self.step} of {self.steps})")
        if not 1 <= self.replicas <= MAX_REPLICAS or min(self.samples_per_s, self.averaging_s) < 0:
            raise RecordError(
                f"RunStatusRecord replicas {self.replicas} (1-{MAX_REPLICAS}), samples/s and averaging "
                "seconds (>= 0) out of range"
            )
        if len(self.events) > RUN_EVENTS or any(len(e) > RUN_EVENT_CHARS for e in self.events):
            raise RecordError(f"RunStatusRecord holds at most {RUN_EVENTS} events of {RUN_EVENT_CHARS} chars")


@dataclass(frozen=True)
class PlanStageRecord(WireRecord):
    """One stage of a job's Plan: who runs which OP-DAG nodes, and each outgoing link's ratio."""

    KIND: ClassVar[str] = "plan_stage"
    VERSION: ClassVar[int] = 2  # 2: names its job's data owner; epochs are the coordinator's lease epochs

    plan_id: str  # the job this plan is for
    epoch: int  # the coordinator's lease epoch when it made the plan
    stage: int  # 0..n_stages-1, in topological order
    n_stages: int
    peer_id: str  # owner of the stage
    dag: str  # fingerprint of the OP-DAG being split
    node_ranges: tuple[int, ...]  # the stage's positions in the OP-DAG's topological order (node_ranges)
    links_to: dict[str, float]  # destination stage (as text) -> Top-K ratio
    n_micro_batches: int
    est_iteration_s: float  # the estimate the plan was chosen for
    made_by: str  # PeerID of the coordinator
    made_at: float  # DHT time
    data_owner: str = ""  # PeerID of the job's data owner: the only peer that may set the plan up
    # data parallelism: this plan is replica ``replica`` of ``replicas`` of one job (each
    # replica's plan is published under ``replica_job(job, replica, replicas)``), and this
    # stage's gradients take ``averaging_s`` to average with the other replicas' (estimate)
    replicas: int = 1
    replica: int = 0
    averaging_s: float = 0.0
    averaging_codec: str = "none"  # how the stage's replicas send the gradients they average

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.n_stages:
            raise RecordError(f"PlanStageRecord.stage {self.stage} not in [0, {self.n_stages})")
        if self.averaging_codec not in AVERAGING_CODECS:
            raise RecordError(
                f"PlanStageRecord averaging codec {self.averaging_codec!r:.40} is not one of "
                f"{sorted(AVERAGING_CODECS)}"
            )
        if not 0 <= self.replica < self.replicas <= MAX_REPLICAS or not 0 <= self.averaging_s < 1e9:
            raise RecordError(
                f"PlanStageRecord replica {self.replica} of {self.replicas} (at most {MAX_REPLICAS}), "
                f"averaging {self.averaging_s!r:.20} s"
            )
        check_ranges(self.node_ranges, "PlanStageRecord.node_ranges")
        if any(r < 1 for r in self.links_to.values()) or self.n_micro_batches < 1:
            raise RecordError("PlanStageRecord ratios and n_micro_batches must be >= 1")
