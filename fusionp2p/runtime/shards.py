"""Checkpoint shards on the exec protocol: a stage writes its own, copies it to a replica,
holders grant and serve reads, and a restoring stage reads what it needs peer to peer.

The messages are ``records.shards``; the files, ``ShardStore``. A stage's shard goes in
parts of at most ``ExecLimits.weights_chunk_bytes`` (a larger tensor alone), so no message
is larger than a weights chunk; a restoring stage asks for its tensors in requests of that
size too, and checks each against its digest before loading anything of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import safetensors.torch

from fusionp2p.config import ExecLimits
from fusionp2p.errors import FusionP2PError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import Transport
from fusionp2p.records import (
    CONTROL_REPLY_BYTES,
    ExecControl,
    JobSetup,
    ShardGrant,
    ShardOrder,
    ShardReport,
    ShardRequest,
    ShardSource,
    pack_message,
)
from fusionp2p.records.shards import shard_stage
from fusionp2p.runtime.codec import ExecClient, unpack_message
from fusionp2p.runtime.executor import Executor
from fusionp2p.runtime.jobs import Job
from fusionp2p.runtime.shard_store import ShardStore, tensor_digests
from fusionp2p.runtime.stage_state import OPTIMIZER_SEPARATOR

__all__ = ["ShardKeeper", "read_shards", "shard_name", "tensor_bytes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
InPool = Callable[[Callable[[], T]], Awaitable[T]]
_SLACK = 64 << 10  # a safetensors header, beyond its tensors' bytes
MAX_NAMES_PER_READ = 4096  # tensors asked for in one shard_get


def shard_name(plan_version: int, stage: int) -> str:
    """The name of stage ``stage``'s shard under plan version ``plan_version``."""
    return f"v{plan_version}-s{stage}"


def tensor_bytes(name: str, sizes: Mapping[str, int]) -> int:
    """Bytes of a checkpoint tensor of a stage whose own tensors are ``sizes``: a tensor's,
    or its optimizer state's (``name#key``: at most its parameter's size)."""
    base, separator, _ = name.rpartition(OPTIMIZER_SEPARATOR)
    return sizes[base] if separator else sizes[name]


class ShardKeeper:
    """This peer's side of checkpoint shards (none if it keeps no ``store``)."""

    def __init__(
        self, transport: Transport, store: ShardStore | None, limits: ExecLimits, timeout: float, in_pool: Any
    ) -> None:
        self.transport = transport
        self.store = store
        self.limits = limits
        self.timeout = timeout
        self._in_pool: InPool[Any] = in_pool

    def _need_store(self) -> ShardStore:
        if self.store is None:
            raise ProtocolError("this peer keeps no checkpoint shards (it has no --checkpoint-dir)")
        return self.store

    async def checkpoint(self, job: Job, body: bytes | bytearray) -> bytes:
        """Writes ``job``'s stage's shard as its owner ordered, copies it to the replica;
        the DATA reply (a ``ShardReport``)."""
        store = self._need_store()
        order = ShardOrder.from_wire(body)
        setup = job.setup
        if not setup.shard_ns or shard_stage(order.shard) != setup.stage:
            raise ProtocolError(f"job {job.name} keeps no shards, or {order.shard} is not this stage's")
        peers = {p for p, _ in setup.peers}
        if order.replica and (order.replica not in peers or order.replica == self.transport.peer_id):
            raise ProtocolError("a shard's replica goes to another peer of the job")
        write = functools.partial(store.write, setup.shard_ns, setup.run, order.step, order.shard)
        parts = job.executor.full_state_parts(self.limits.weights_chunk_bytes)
        digests, sizes = await self._in_pool(functools.partial(_write_parts, parts, write))
        holders = [self.transport.peer_id]
        files = store.parts(setup.shard_ns, setup.run, order.step, order.shard)
        if order.replica and await self._copy(job, order, files):
            holders.append(order.replica)
        report = ShardReport(order.shard, sum(sizes), tuple(sorted(digests)), tuple(holders))
        wire = report.to_wire()
        return pack_message(ExecControl(command="checkpoint", job=job.name, body_bytes=len(wire)), wire)

    async def _copy(self, job: Job, order: ShardOrder, files: Sequence[Path]) -> bool:
        """Sends the shard's part files to the replica, one at a time."""
        client = ExecClient(self.transport, order.replica, timeout=self.timeout)
        try:
            for i, path in enumerate(files):
                data = await asyncio.to_thread(path.read_bytes)
                header = ExecControl(
                    command="shard_put",
                    job=job.name,
                    iteration=order.step,
                    what=order.shard,
                    part=i,
                    parts=len(files),
                    body_bytes=len(data),
                )
                await client.request(header, data)
            return True
        except FusionP2PError as e:  # the shard still counts: this peer holds it
            logger.warning(
                "job %s: shard %s has no replica on %s: %s", job.name, order.shard, order.replica[-8:], e
            )
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def put(self, job: Job, remote: str, header: ExecControl, body: bytes | bytearray) -> None:
        """Keeps a part of a replica a stage of ``job`` sent (admission checked who)."""
        store = self._need_store()
        setup = job.setup
        if not setup.shard_ns or setup.peer_of(shard_stage(header.what)) != remote:
            raise ProtocolError(f"{remote[:12]} runs no stage whose shard is {header.what!r:.40}")
        await self._in_pool(
            functools.partial(
                store.write, setup.shard_ns, setup.run, header.iteration, header.what, header.part, body
            )
        )

    async def grant(self, body: bytes | bytearray) -> None:
        """Lets peers read a shard of the namespace the grant's secret names."""
        grant = ShardGrant.from_wire(body)
        store = self._need_store()
        await self._in_pool(
            functools.partial(store.grant, grant.secret, grant.run, grant.step, grant.shard, grant.readers)
        )

    async def restore(self, executor: Executor, setup: JobSetup) -> None:
        """Loads a new stage's tensors from the shards its setup names, peer to peer.

        Raises:
            ProtocolError: no holder of a shard gave it, or tensors are still missing.
        """
        pieces = read_shards(
            self.transport,
            setup.restore,
            executor.state_sizes(),
            limits=self.limits,
            timeout=self.timeout,
            store=self.store,
        )
        async for data in pieces:
            await self._in_pool(functools.partial(executor.load_state, data))
        if executor.missing_state():
            raise ProtocolError(
                f"stage {setup.stage}: the shards left {executor.missing_state()} tensors missing"
            )

    async def get(self, remote: str, body: bytes | bytearray) -> bytes:
        """The tensors a granted ``remote`` asked for; the DATA reply."""
        request = ShardRequest.from_wire(body)
        store = self._need_store()
        data = await self._in_pool(
            functools.partial(
                store.read, request.ns, request.run, request.step, request.shard, request.names, remote
            )
        )
        return pack_message(ExecControl(command="shard_get", job=request.run, body_bytes=len(data)), data)


def _write_parts(
    parts: Iterator[bytes], write: Callable[[int, bytes], Any]
) -> tuple[list[tuple[str, str]], list[int]]:
    """Writes a shard's parts one at a time (on the compute thread); their digests and sizes."""
    digests: list[tuple[str, str]] = []
    sizes = []
    for i, data in enumerate(parts):
        write(i, data)
        digests += tensor_digests(safetensors.torch.load(data))
        sizes.append(len(data))
    return digests, sizes


async def read_shards(
    transport: Transport,
    sources: Sequence[ShardSource],
    sizes: Mapping[str, int],
    *,
    limits: ExecLimits,
    timeout: float,
    store: ShardStore | None = None,
) -> AsyncIterator[bytes]:
    """A restoring stage's tensors (safetensors bytes, in bounded pieces), read from the
    holders of ``sources`` in order, each tensor checked against its digest. ``sizes`` are
    the stage's own tensors' bytes; a holder that is this peer is read from ``store``.

    Raises:
        ProtocolError: no holder of a shard gave its tensors with their digests, or a source
            names a tensor this stage does not hold.
    """
    me = transport.peer_id
    for source in sources:
        wanted = dict(source.tensors)
        try:
            pieces: list[list[str]] = []
            piece: list[str] = []
            size = 0
            for name in wanted:
                nbytes = tensor_bytes(name, sizes)
                if piece and (size + nbytes > limits.weights_chunk_bytes or len(piece) >= MAX_NAMES_PER_READ):
                    pieces.append(piece)
                    piece, size = [], 0
                piece.append(name)
                size += nbytes
        except KeyError as e:
            raise ProtocolError(f"shard {source.shard} names {e} that this stage does not hold") from None
        if piece:
            pieces.append(piece)
        for names in pieces:
            limit = sum(tensor_bytes(n, sizes) for n in names) + _SLACK
            yield await _read_piece(transport, source, names, wanted, limit, me, store, timeout)


async def _read_piece(
    transport: Transport,
    source: ShardSource,
    names: list[str],
    digests: Mapping[str, str],
    limit: int,
    me: str,
    store: ShardStore | None,
    timeout: float,
) -> bytes:
    request = ShardRequest(source.ns, source.run, source.step, source.shard, tuple(names))
    failures = []
    for holder in source.holders:
        try:
            if holder == me:
                if store is None:
                    raise ProtocolError("this peer keeps no shards")
                data = await asyncio.to_thread(
                    store.read, source.ns, source.run, source.step, source.shard, names
                )
            else:
                data = await _ask(transport, holder, request, limit, timeout)
            tensors = safetensors.torch.load(data)
            got = dict(tensor_digests(tensors))
            wrong = [n for n in names if got.get(n) != digests[n]]
            if wrong or set(got) != set(names):
                raise ProtocolError(f"tensors that do not match their digests: {wrong[:3]}")
            return data
        except (FusionP2PError, TimeoutError, OSError) as e:
            failures.append(f"{holder[-8:]}: {str(e)[:160]}")
        except Exception as e:  # not safetensors
            failures.append(f"{holder[-8:]}: not safetensors ({str(e)[:120]})")
    raise ProtocolError(f"no holder gave shard {source.shard} of step {source.step}: {'; '.join(failures)}")


async def _ask(transport: Transport, holder: str, request: ShardRequest, limit: int, timeout: float) -> bytes:
    client = ExecClient(transport, holder, timeout=timeout)
    try:
        wire = request.to_wire()
        header = ExecControl(command="shard_get", job=request.run, body_bytes=len(wire))
        kind, payload = await client.request(header, wire, max_reply=limit + CONTROL_REPLY_BYTES)
        if kind is not FrameKind.DATA:
            raise ProtocolError(f"expected DATA, got {kind.name}")
        _, body = unpack_message(payload)
        return bytes(body)
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
