"""A data owner's side of shard checkpoints: ordering them, and restoring a new plan from one.

``order_checkpoint`` asks every stage to write its shard (and one replica) and checks what
each reports; the reports are the whole checkpoint the data owner keeps (a ``Restore``).
``stage_sources`` finds, for each stage of a new split, the shards that hold its tensors
and who holds them, and ``grant_sources`` lets the new stage owners read them from each
live holder; the tensors then go peer to peer, never through the data owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fusionp2p.errors import ConfigError, FusionP2PError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import Transport
from fusionp2p.records import (
    CONTROL_REPLY_BYTES,
    ExecControl,
    ShardGrant,
    ShardOrder,
    ShardReport,
    ShardSource,
)
from fusionp2p.runtime.codec import ExecClient, unpack_message
from fusionp2p.runtime.stage_state import OPTIMIZER_KEYS, OPTIMIZER_SEPARATOR

__all__ = ["Restore", "check_report", "grant_sources", "request_shard", "stage_sources"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restore:
    """A checkpoint kept by the stages: its step, and each shard's report (tensor digests
    and holders)."""

    step: int
    shards: tuple[ShardReport, ...]


def _base(name: str) -> str:
    return name.partition(OPTIMIZER_SEPARATOR)[0]


def check_report(report: ShardReport, shard: str, names: Collection[str], holders: Collection[str]) -> None:
    """Raises ProtocolError unless a stage's report is of its own ``shard``, names only its
    own tensors (``names``) and their optimizer state, and only ``holders``."""
    if report.shard != shard:
        raise ProtocolError(f"reported shard {report.shard}, ordered {shard}")
    wrong = [
        n
        for n, _ in report.tensors
        if _base(n) not in names
        or (OPTIMIZER_SEPARATOR in n and n.rpartition(OPTIMIZER_SEPARATOR)[2] not in OPTIMIZER_KEYS)
    ]
    if wrong:
        raise ProtocolError(f"shard {shard} reports tensors that are not its stage's: {wrong[:3]}")
    if set(report.holders) - set(holders) or not report.holders:
        raise ProtocolError(f"shard {shard} reports holders {[h[-8:] for h in report.holders]}")


async def request_shard(client: ExecClient, job: str, order: ShardOrder) -> ShardReport:
    """Orders one stage's shard; its report.

    Raises:
        ProtocolError / PeerUnreachableError: the stage refused, failed or is gone.
    """
    wire = order.to_wire()
    kind, payload = await client.request(
        ExecControl(command="checkpoint", job=job, iteration=order.step, body_bytes=len(wire)),
        wire,
        max_reply=ShardReport.MAX_BYTES + CONTROL_REPLY_BYTES,
    )
    if kind is not FrameKind.DATA:
        raise ProtocolError(f"checkpoint of {order.shard}: expected DATA, got {kind.name}")
    _, body = unpack_message(payload)
    return ShardReport.from_wire(body)


def stage_sources(
    restore: Restore, names: Iterable[str], *, ns: str, run: str, exclude: Collection[str] = ()
) -> tuple[ShardSource, ...]:
    """Where a stage holding ``names`` reads them (and their optimizer state) from:
    for each tensor the first shard that has it, its holders but ``exclude``.

    Raises:
        ConfigError: the checkpoint lacks one of ``names``, or a shard it needs has no
            holder left.
    """
    wanted = set(names)
    chosen: dict[str, str] = {}  # tensor -> the shard it is read from
    by_shard = {r.shard: r for r in restore.shards}
    for report in restore.shards:
        for name, _ in report.tensors:
            if _base(name) in wanted and name not in chosen:
                chosen[name] = report.shard
    missing = sorted(wanted - {_base(n) for n in chosen})
    if missing:
        raise ConfigError(f"the checkpoint of step {restore.step} has no {missing[:3]}")
    sources = []
    for shard in sorted(set(chosen.values())):
        report = by_shard[shard]
        holders = tuple(h for h in report.holders if h not in exclude)
        if not holders:
            raise ConfigError(
                f"shard {shard} of step {restore.step} has no live holder (it was on "
                f"{[h[-8:] for h in report.holders]})"
            )
        digests = tuple((n, d) for n, d in report.tensors if chosen.get(n) == shard)
        sources.append(ShardSource(ns, run, restore.step, shard, holders, digests))
    return tuple(sources)


async def grant_sources(
    transport: Transport,
    secret: bytes,
    sources: Mapping[int, Sequence[ShardSource]],
    readers: Mapping[int, str],
    *,
    timeout: float,
) -> dict[int, tuple[ShardSource, ...]]:
    """Grants every stage's reader (``readers[stage]``) its shards on each of their holders;
    a holder that refuses or does not answer is left out of the sources.

    Raises:
        ProtocolError: a shard is left with no holder that granted it.
    """
    me = transport.peer_id
    wanted: dict[tuple[str, str, int, str], set[str]] = {}  # (holder, run, step, shard) -> readers
    for stage, stage_sources_ in sources.items():
        for source in stage_sources_:
            for holder in source.holders:
                if holder != me:  # this process reads its own store directly
                    wanted.setdefault((holder, source.run, source.step, source.shard), set()).add(
                        readers[stage]
                    )

    async def grant(key: tuple[str, str, int, str], who: set[str]) -> bool:
        holder, run, step, shard = key
        client = ExecClient(transport, holder, timeout=timeout)
        try:
            wire = ShardGrant(secret, run, step, shard, tuple(sorted(who))).to_wire()
            await client.request(ExecControl(command="grant", job=run, body_bytes=len(wire)), wire)
            return True
        except (FusionP2PError, TimeoutError) as e:
            logger.warning("holder %s of shard %s cannot serve it: %s", holder[-8:], shard, e)
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    keys = list(wanted)
    granted = dict(zip(keys, await asyncio.gather(*(grant(k, wanted[k]) for k in keys)), strict=True))
    out: dict[int, tuple[ShardSource, ...]] = {}
    for stage, stage_sources_ in sources.items():
        kept = []
        for source in stage_sources_:
            holders = tuple(
                h
                for h in source.holders
                if h == me or granted.get((h, source.run, source.step, source.shard))
            )
            if not holders:
                raise ProtocolError(f"no holder of shard {source.shard} of step {source.step} answers")
            kept.append(
                ShardSource(source.ns, source.run, source.step, source.shard, holders, source.tensors)
            )
        out[stage] = tuple(kept)
    return out
