"""The coordinator protocol: a data owner submits a job, the coordinator plans it.

Protocol ``/fusionp2p/coord/1``, one request per stream, data owner -> coordinator:

    DATA(JobRequest JSON)  ->  DATA(JobReply JSON)    the plan is in the DHT
                           ->  ERROR(one line)        not the coordinator, bad job, no fit

The request names the job, the model spec, the batch geometry, the compression and the
plan method, and carries the data owner's own PeerRecord and measured LinkRecords (wire
bytes, hex): a data owner is not a published peer, and only it can measure its links.
The coordinator takes them only if they speak for the stream's authenticated peer. The
reply names the epoch and the records the plan was made from, so anyone can re-plan them.

A re-plan of a running job (a stage owner was lost, or a straggler slows it) names the
job's current wire id in ``replaces``: its stage owners may be planned on again although
their records say they are busy in it (if the sender is that job's data owner), the peers
in ``exclude`` are left out, and ``speeds`` scales a peer's profiled speed by what the data
owner measured it compute (a factor in (0, 1]: it can only slow a peer down in its own job).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fusionp2p.config import NAME_RE, PEER_ID_RE, load_json_object
from fusionp2p.errors import ConfigError, RecordError
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.planning.cost import MAX_RATIO_LIMIT, PLANNED_MAX_RATIO
from fusionp2p.records import LinkRecord, PeerRecord

__all__ = ["COORD_PROTOCOL", "MAX_REPLY_BYTES", "MAX_REQUEST_BYTES", "MAX_UNREAD", "JobReply", "JobRequest"]

COORD_PROTOCOL = "/fusionp2p/coord/1"
MAX_REQUEST_BYTES = 256 << 10
MAX_REPLY_BYTES = 4 << 20
_MAX_OWNER_LINKS = 64
_MAX_EXCLUDE = 256
_MAX_RECORDS = 4096
MAX_UNREAD = 64  # directory keys a reply names as unread (the first of them)
_HEX_RE = re.compile(r"^[0-9a-f]{2,8192}$")


def _records(value: Any, kind: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise ConfigError(f"{what} must be a list of at most {limit} records")
    out = []
    for item in value:
        if not isinstance(item, str) or not _HEX_RE.match(item):
            raise ConfigError(f"{what} holds a value that is not a hex record")
        try:
            out.append(kind.from_wire(bytes.fromhex(item)))
        except (RecordError, ValueError) as e:
            raise ConfigError(f"{what} holds a malformed record: {e}") from e
    return out


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"job request {key} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _float(body: dict[str, Any], key: str, low: float, high: float) -> float:
    value = body.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"job request {key} must be a number in [{low:g}, {high:g}], got {value!r:.40}")
    return float(value)


def _str(body: dict[str, Any], key: str, choices: Sequence[str] | None = None) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > 128 or (choices is not None and value not in choices):
        raise ConfigError(f"job request {key} is malformed: {value!r:.60}")
    return value


@dataclass(frozen=True)
class JobRequest:
    """What the coordinator plans a job from."""

    # 2: replaces, exclude, speeds (re-plans of a running job); 3: max_ratio; 4: "uniform"
    # compression and bare baseline methods (with the job's compression)
    VERSION = 4

    job: str
    spec: ModelSpec
    n_micro_batches: int
    compression: str  # one of training.job_spec.COMPRESSIONS
    method: str  # a data_owner.PLAN_METHODS name
    owner: PeerRecord  # the data owner, measured by itself
    owner_links: tuple[LinkRecord, ...]  # its links to candidate peers
    replaces: str = ""  # the wire id of the running job this plan replaces ("" for a new job)
    exclude: tuple[str, ...] = ()  # peers not to plan on (lost or stopped)
    speeds: tuple[tuple[str, float], ...] = ()  # (peer, factor in (0, 1]) on its profiled speed
    max_ratio: float = PLANNED_MAX_RATIO  # "planned" compression: the hardest Top-K ratio on a link

    def to_json(self) -> bytes:
        import json

        return json.dumps(
            {
                "v": self.VERSION,
                "job": self.job,
                "spec": self.spec.to_dict(),
                "n_micro_batches": self.n_micro_batches,
                "compression": self.compression,
                "method": self.method,
                "owner": self.owner.to_wire().hex(),
                "owner_links": [lk.to_wire().hex() for lk in self.owner_links],
                "replaces": self.replaces,
                "exclude": list(self.exclude),
                "speeds": [[p, f] for p, f in self.speeds],
                "max_ratio": self.max_ratio,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray, *, sender: str) -> JobRequest:
        """Parses a request from ``sender`` (the stream's authenticated peer).

        Raises:
            ConfigError: malformed, oversized, or records that speak for someone else.
        """
        from fusionp2p.data_owner import PLAN_METHODS
        from fusionp2p.training.job_spec import COMPRESSIONS

        body = load_json_object(data, "job request", MAX_REQUEST_BYTES)
        if body.get("v") != cls.VERSION:
            raise ConfigError(
                f"job request version {body.get('v')!r:.20}; this coordinator reads {cls.VERSION}"
            )
        job = _str(body, "job")
        if not NAME_RE.match(job):
            raise ConfigError(f"job request names job {job!r:.60}: 1-64 letters, digits, '-' or '_'")
        (owner,) = _records([body.get("owner")], PeerRecord, "job request owner", 1)
        links = _records(body.get("owner_links"), LinkRecord, "job request owner_links", _MAX_OWNER_LINKS)
        if owner.peer_id != sender or any(lk.src != sender for lk in links):
            raise ConfigError("job request records must speak for the peer that sends them")
        replaces = body.get("replaces", "")
        if not isinstance(replaces, str) or (replaces and not NAME_RE.match(replaces)):
            raise ConfigError(f"job request replaces {replaces!r:.60}: not a job name")
        return cls(
            job=job,
            spec=ModelSpec.from_dict(body.get("spec")),
            n_micro_batches=_int(body, "n_micro_batches", 1, 4096),
            compression=_str(body, "compression", COMPRESSIONS),
            method=_str(body, "method", PLAN_METHODS),
            owner=owner,
            owner_links=tuple(links),
            replaces=replaces,
            exclude=_peer_ids(body.get("exclude", [])),
            speeds=_speeds(body.get("speeds", [])),
            max_ratio=_float(body, "max_ratio", 1.0, MAX_RATIO_LIMIT),
        )


def _keys(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_UNREAD:
        raise ConfigError(f"job reply unread must be a list of at most {MAX_UNREAD} directory keys")
    if not all(isinstance(k, str) and 0 < len(k) <= 128 for k in value):
        raise ConfigError("job reply unread holds a malformed directory key")
    return tuple(value)


def _peer_ids(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > _MAX_EXCLUDE:
        raise ConfigError(f"job request exclude must be a list of at most {_MAX_EXCLUDE} PeerIDs")
    if not all(isinstance(p, str) and PEER_ID_RE.match(p) for p in value):
        raise ConfigError("job request exclude holds a value that is not a PeerID")
    return tuple(value)


def _speeds(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, list) or len(value) > _MAX_EXCLUDE:
        raise ConfigError(f"job request speeds must be a list of at most {_MAX_EXCLUDE} pairs")
    out = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not PEER_ID_RE.match(item[0])
            or not isinstance(item[1], (int, float))
            or isinstance(item[1], bool)
            or not 0 < item[1] <= 1
        ):
            raise ConfigError(f"job request speeds holds {item!r:.80}, not a [PeerID, factor in (0, 1]] pair")
        out.append((item[0], float(item[1])))
    return tuple(out)


@dataclass(frozen=True)
class JobReply:
    """The coordinator's answer: the plan's epoch and stages, and what it was planned on."""

    job: str
    epoch: int
    n_stages: int
    coordinator: str
    peers: tuple[PeerRecord, ...]  # the records the plan was made from, the data owner's included
    links: tuple[LinkRecord, ...]
    unread: tuple[str, ...] = ()  # directory keys the coordinator could not read: it planned without them

    def to_json(self) -> bytes:
        import json

        return json.dumps(
            {
                "job": self.job,
                "epoch": self.epoch,
                "n_stages": self.n_stages,
                "coordinator": self.coordinator,
                "peers": [p.to_wire().hex() for p in self.peers],
                "links": [lk.to_wire().hex() for lk in self.links],
                "unread": list(self.unread),
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray) -> JobReply:
        """Raises ConfigError on a malformed reply."""
        body = load_json_object(data, "job reply", MAX_REPLY_BYTES)
        return cls(
            job=_str(body, "job"),
            epoch=_int(body, "epoch", 1, 1 << 62),
            n_stages=_int(body, "n_stages", 1, 4096),
            coordinator=_str(body, "coordinator"),
            peers=tuple(_records(body.get("peers"), PeerRecord, "job reply peers", _MAX_RECORDS)),
            links=tuple(_records(body.get("links"), LinkRecord, "job reply links", _MAX_RECORDS)),
            unread=_keys(body.get("unread", [])),
        )
