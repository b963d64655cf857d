"""Checkpoint shards kept by the stages: the exec messages' bodies that write, copy and read them.

A run's shards live under its *namespace*: the sha256 of a secret the data owner keeps in
its run directory (``JobSetup.shard_ns`` tells the stages the hash, never the secret), so
a data owner that restarts with a new PeerID still owns its run's shards. At a checkpoint
the data owner orders each stage (``ShardOrder``, the body of a ``checkpoint`` command)
to write its own shard (its tensors and optimizer state) on its own disk and copy it to
one replica peer (``shard_put``, in parts); the stage answers with a ``ShardReport``: each
tensor's sha256 and who holds the shard. The data owner keeps only those reports (its
manifest). To restore, it grants new stage owners the right to read a shard
(``ShardGrant``, a ``grant`` to a holder, carrying the secret: a holder grants only what
the secret's hash names), and each new stage reads the tensors it needs (``ShardRequest``,
a ``shard_get``) from a holder named in its ``JobSetup.restore`` (``ShardSource``),
checking every tensor against its digest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, ClassVar

from fusionp2p.config import NAME_RE, PEER_ID_RE
from fusionp2p.errors import RecordError
from fusionp2p.records.limits import MAX_STAGES
from fusionp2p.records.wire import Limit, Range, WireRecord

__all__ = [
    "MAX_SHARD_TENSORS",
    "NAMESPACE_RE",
    "ShardGrant",
    "ShardOrder",
    "ShardReport",
    "ShardRequest",
    "ShardSource",
    "shard_stage",
]

MAX_SHARD_TENSORS = 1 << 16  # tensors (optimizer state included) of one shard
MAX_HOLDERS = 8
_SHARD_RE = re.compile(r"^v\d{1,12}-s(\d{1,4})$")  # "v<plan version>-s<stage>"
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
NAMESPACE_RE = _DIGEST_RE  # a run's shard namespace: sha256 of its secret, hex
_TENSOR_NAME_CHARS = 512
_MAX_STEP = 1 << 62

TensorDigests = Annotated[
    tuple[tuple[Annotated[str, Limit(_TENSOR_NAME_CHARS)], str], ...], Limit(MAX_SHARD_TENSORS)
]


def shard_stage(shard: str) -> int:
    """The stage a shard name ``v<plan version>-s<stage>`` is of.

    Raises:
        RecordError: not such a name.
    """
    found = _SHARD_RE.match(shard)
    if not found:
        raise RecordError(f"shard name {shard!r:.40} is not 'v<plan version>-s<stage>'")
    return int(found.group(1))


def _check_shard(shard: str, run: str | None = None, ns: str | None = None) -> None:
    shard_stage(shard)
    if run is not None and not NAME_RE.match(run):
        raise RecordError(f"shard run {run!r:.80} is not 1-64 letters, digits, '-' or '_'")
    if ns is not None and not NAMESPACE_RE.match(ns):
        raise RecordError("shard namespace is not 64 hex digits")


def _check_peers(peers: tuple[str, ...], what: str) -> None:
    if any(not PEER_ID_RE.match(p) for p in peers):
        raise RecordError(f"{what}: not base58 PeerIDs")


def _check_digests(tensors: tuple[tuple[str, str], ...], what: str) -> None:
    if any(not _DIGEST_RE.match(d) for _, d in tensors):
        raise RecordError(f"{what}: a digest is not 64 hex digits")


@dataclass(frozen=True)
class ShardOrder(WireRecord):
    """Write this stage's shard of ``step`` as ``shard``; copy it to ``replica`` ("": none)."""

    KIND: ClassVar[str] = "shard_order"
    MAX_BYTES: ClassVar[int] = 1 << 10

    step: Annotated[int, Range(0, _MAX_STEP)]
    shard: Annotated[str, Limit(32)]
    replica: Annotated[str, Limit(64)] = ""

    def __post_init__(self) -> None:
        _check_shard(self.shard)
        _check_peers((self.replica,) if self.replica else (), "shard replica")


@dataclass(frozen=True)
class ShardReport(WireRecord):
    """What a stage wrote: every tensor's sha256, the shard's bytes, and who holds it."""

    KIND: ClassVar[str] = "shard_report"
    MAX_BYTES: ClassVar[int] = 16 << 20

    shard: Annotated[str, Limit(32)]
    nbytes: Annotated[int, Range(0, _MAX_STEP)]
    tensors: TensorDigests
    holders: Annotated[tuple[str, ...], Limit(MAX_HOLDERS)]

    def __post_init__(self) -> None:
        _check_shard(self.shard)
        _check_peers(self.holders, "shard holders")
        _check_digests(self.tensors, "shard report")


@dataclass(frozen=True)
class ShardGrant(WireRecord):
    """``readers`` may read shard ``shard`` of step ``step`` of run ``run`` in the
    namespace that ``secret`` hashes to."""

    KIND: ClassVar[str] = "shard_grant"
    MAX_BYTES: ClassVar[int] = 4 << 10

    secret: Annotated[bytes, Limit(64)]
    run: Annotated[str, Limit(64)]
    step: Annotated[int, Range(0, _MAX_STEP)]
    shard: Annotated[str, Limit(32)]
    readers: Annotated[tuple[str, ...], Limit(MAX_STAGES)]

    def __post_init__(self) -> None:
        _check_shard(self.shard, self.run)
        _check_peers(self.readers, "shard readers")
        if len(self.secret) < 16:
            raise RecordError("a shard grant's secret has at least 16 bytes")


@dataclass(frozen=True)
class ShardRequest(WireRecord):
    """The tensors ``names`` of a shard of run ``run`` (in namespace ``ns``) at ``step``."""

    KIND: ClassVar[str] = "shard_request"
    MAX_BYTES: ClassVar[int] = 4 << 20  # a reader asks for at most 4096 tensors at once

    ns: Annotated[str, Limit(64)]
    run: Annotated[str, Limit(64)]
    step: Annotated[int, Range(0, _MAX_STEP)]
    shard: Annotated[str, Limit(32)]
    names: Annotated[tuple[Annotated[str, Limit(_TENSOR_NAME_CHARS)], ...], Limit(MAX_SHARD_TENSORS)]

    def __post_init__(self) -> None:
        _check_shard(self.shard, self.run, self.ns)


@dataclass(frozen=True)
class ShardSource(WireRecord):
    """Where a restoring stage reads some of its tensors: a shard of run ``run`` (namespace
    ``ns``), its holders (in the order to try them) and the digests of the tensors to read."""

    KIND: ClassVar[str] = "shard_source"
    MAX_BYTES: ClassVar[int] = 16 << 20

    ns: Annotated[str, Limit(64)]
    run: Annotated[str, Limit(64)]
    step: Annotated[int, Range(0, _MAX_STEP)]
    shard: Annotated[str, Limit(32)]
    holders: Annotated[tuple[str, ...], Limit(MAX_HOLDERS)]
    tensors: TensorDigests

    def __post_init__(self) -> None:
        _check_shard(self.shard, self.run, self.ns)
        _check_peers(self.holders, "shard source holders")
        _check_digests(self.tensors, "shard source")
