"""The coordinator protocol's messages: a data owner submits a job, the coordinator plans it.

On ``COORD_PROTOCOL``, one request per stream, data owner -> coordinator:

    DATA(JobRequest)  ->  DATA(JobReply)    the plan is in the DHT
                      ->  ERROR(one line)   not the coordinator, bad job, no fit

The request names the job, the model spec, the batch geometry, the compression and the
plan method, and carries the data owner's own PeerRecord and measured LinkRecords: a data
owner is not a published peer, and only it can measure its links. The coordinator takes
them only if they speak for the stream's authenticated peer (``check_sender``). The reply
names the epoch and the records the plan was made from, so anyone can re-plan them.

A re-plan of a running job (a stage owner was lost, or a straggler slows it) names the
job's current wire id in ``replaces``: its stage owners may be planned on again although
their records say they are busy in it (if the sender is that job's data owner), the peers
in ``exclude`` are left out, and ``speeds`` scales a peer's profiled speed by what the data
owner measured it compute (a factor in (0, 1]: it can only slow a peer down in its own job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from fusionp2p.config import NAME_RE, PEER_ID_RE
from fusionp2p.errors import RecordError
from fusionp2p.records.limits import (
    AVERAGING_CODECS,
    MAX_MICRO_BATCHES,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_TOPK_RATIO,
)
from fusionp2p.records.model import ModelSpec
from fusionp2p.records.swarm import LinkRecord, PeerRecord
from fusionp2p.records.wire import Limit, Range, WireRecord

__all__ = [
    "AVERAGING_CHOICES",
    "BASELINES",
    "COMPRESSIONS",
    "MAX_REPLY_RECORDS",
    "MAX_UNREAD",
    "PLAN_METHODS",
    "JobReply",
    "JobRequest",
]

COMPRESSIONS = ("none", "uniform", "adaptive", "planned")  # a job's Top-K policy, by name
AVERAGING_CHOICES = (*AVERAGING_CODECS, "auto")  # a job's averaging codec, by name
BASELINES = ("equal-number", "equal-computation")  # the FusionLLM evaluation's partitions (§7.2)
# a bare baseline plans with the job's compression, a suffixed one with its own
PLAN_METHODS = (
    "op-fence",
    *BASELINES,
    *(f"{b}/{c}" for b in BASELINES for c in ("none", "uniform", "adaptive")),
)
MAX_OWNER_LINKS = 64  # links a data owner measured and sends along
MAX_EXCLUDED = 256  # peers a re-plan leaves out or slows down
MAX_REPLY_RECORDS = 4096  # peer and link records a reply names
MAX_UNREAD = 64  # directory keys a reply names as unread (the first of them)


@dataclass(frozen=True)
class JobRequest(WireRecord):
    """What the coordinator plans a job from."""

    KIND: ClassVar[str] = "job_request"
    # 5: a msgpack record (it was JSON with hex records inside); 4: "uniform" compression,
    # bare baselines; 3: max_ratio; 2: replaces, exclude, speeds
    VERSION: ClassVar[int] = 5
    MAX_BYTES: ClassVar[int] = 256 << 10

    job: Annotated[str, Limit(64)]  # the job's wire id
    spec: ModelSpec
    n_micro_batches: Annotated[int, Range(1, MAX_MICRO_BATCHES)]
    compression: str  # one of COMPRESSIONS
    method: str  # one of PLAN_METHODS
    owner: PeerRecord  # the data owner, measured by itself
    owner_links: Annotated[tuple[LinkRecord, ...], Limit(MAX_OWNER_LINKS)]  # its links to candidates
    max_ratio: Annotated[float, Range(1.0, MAX_TOPK_RATIO)]  # "planned"/"uniform": the hardest Top-K ratio
    replaces: Annotated[str, Limit(64)] = ""  # the wire id of the running job this plan replaces
    exclude: Annotated[tuple[str, ...], Limit(MAX_EXCLUDED)] = ()  # peers not to plan on (lost or stopped)
    speeds: Annotated[tuple[tuple[str, float], ...], Limit(MAX_EXCLUDED)] = ()  # (peer, factor on its speed)
    only: Annotated[tuple[str, ...], Limit(MAX_EXCLUDED)] = ()  # the only peers to plan on; () = any
    # data-parallel replicas of the pipeline (planning.replicas): a number that divides
    # n_micro_batches, or 0 for "auto" (the coordinator picks the most samples per second)
    replicas: Annotated[int, Range(0, MAX_REPLICAS)] = 1
    # how the replicas send the gradients they average: one of AVERAGING_CODECS, or "auto"
    # (per stage, the smallest that keeps its all-reduce within the replica's busiest compute)
    averaging: str = "none"

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.job):
            raise RecordError(f"job request names job {self.job!r:.60}: 1-64 letters, digits, '-' or '_'")
        if self.replaces and not NAME_RE.match(self.replaces):
            raise RecordError(f"job request replaces {self.replaces!r:.60}: not a job name")
        if self.compression not in COMPRESSIONS:
            raise RecordError(
                f"job request compression must be one of {COMPRESSIONS}, got {self.compression!r:.40}"
            )
        if self.method not in PLAN_METHODS:
            raise RecordError(f"job request method must be one of {PLAN_METHODS}, got {self.method!r:.40}")
        if self.averaging not in AVERAGING_CHOICES:
            raise RecordError(
                f"job request averaging must be one of {AVERAGING_CHOICES}, got {self.averaging!r:.40}"
            )
        if self.replicas != 1 and self.method != "op-fence":
            raise RecordError(f"job request asks for replicas planned by {self.method!r:.40}: only op-fence")
        if self.replicas and self.n_micro_batches % self.replicas:
            raise RecordError(
                f"job request asks for {self.replicas} replicas of {self.n_micro_batches} micro-batches: "
                "the replicas must divide them"
            )
        if not all(PEER_ID_RE.match(p) for p in (*self.exclude, *self.only, *(p for p, _ in self.speeds))):
            raise RecordError("job request exclude, only or speeds holds a value that is not a PeerID")
        for item in self.speeds:
            if not 0 < item[1] <= 1:
                raise RecordError(
                    f"job request speeds holds {item!r:.80}, not a [PeerID, factor in (0, 1]] pair"
                )

    def check_sender(self, sender: str) -> None:
        """Raises RecordError unless the records it carries speak for ``sender`` (the
        stream's authenticated peer): a data owner measures only itself."""
        if self.owner.peer_id != sender or any(lk.src != sender for lk in self.owner_links):
            raise RecordError("job request records must speak for the peer that sends them")


@dataclass(frozen=True)
class JobReply(WireRecord):
    """The coordinator's answer: the plan's epoch and stages, and what it was planned on."""

    KIND: ClassVar[str] = "job_reply"
    MAX_BYTES: ClassVar[int] = 4 << 20

    job: Annotated[str, Limit(64)]
    epoch: Annotated[int, Range(1, 1 << 62)]
    n_stages: Annotated[int, Range(1, MAX_STAGES)]
    coordinator: Annotated[str, Limit(128)]
    # the records the plan was made from, the data owner's included
    peers: Annotated[tuple[PeerRecord, ...], Limit(MAX_REPLY_RECORDS)]
    links: Annotated[tuple[LinkRecord, ...], Limit(MAX_REPLY_RECORDS)]
    # directory keys the coordinator could not read: it planned without them
    unread: Annotated[tuple[Annotated[str, Limit(128)], ...], Limit(MAX_UNREAD)] = ()
    # the plan's replicas: each is published under ``replica_job(job, replica, replicas)``
    replicas: Annotated[int, Range(1, MAX_REPLICAS)] = 1
