"""``Swarm``: the public, read-only Python view of a swarm, usable from any machine.

    with Swarm(initial_peers=["/ip4/.../p2p/Qm..."]) as swarm:
        for peer in swarm.peers(): ...
        for link in swarm.links(): ...
        result = swarm.train(job)  # this process as the job's data owner

In async code use ``async with Swarm(...) as swarm`` and ``await swarm.apeers()`` /
``await swarm.alinks()``. A Swarm runs a client-mode DHT node: it reads the swarm's
records without serving as a full peer. Training is a data owner's work: ``train``
delegates to ``swarm.data_owner()`` (``training.DataOwner``), which also plans, submits
and drives pipelines by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fusionp2p.coordination.election import LeaseJudge, read_lease
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.records import LeaseRecord, LinkRecord, PeerRecord, PlanStageRecord, RunStatusRecord
from fusionp2p.training.data_owner import DataOwner
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.trainer import TrainResult

__all__ = ["Swarm"]


class Swarm(SwarmConnection):
    """A read-only handle on a swarm's live peers, measured links, coordinator, plans and
    runs (a ``SwarmConnection``: ``Swarm(initial_peers, swarm=..., timeout=..., site=...)``);
    ``train`` runs a job on it with this process as the data owner.

    Raises:
        ConfigError: a malformed initial peer or site.
        SwarmError: no initial peer given, or none answered.
    """

    # -- async API ---------------------------------------------------------------------

    async def apeers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        peers = await self.directory.fetch_peers()
        return [peers[pid] for pid in sorted(peers)]

    async def alinks(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        peers = await self.directory.fetch_peers()
        links = await self.directory.fetch_links(sorted(peers))
        return sorted((lk for lk in links if lk.dst in peers), key=lambda lk: (lk.src, lk.dst))

    async def acoordinator(self) -> LeaseRecord | None:
        """The coordinator lease in force (its holder and epoch), or None: as every reader
        bounds a claim (``coordination.election.LeaseJudge``)."""
        return await read_lease(self.directory, LeaseJudge())

    async def ajobs(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        """Every complete plan in the DHT: (job, epoch, coordinator) -> its stages."""
        return await self.directory.fetch_all_plans()

    async def aruns(self) -> list[RunStatusRecord]:
        """Training runs as their data owners last reported them (progress, newest events)."""
        return await self.directory.fetch_runs()

    # -- sync API ----------------------------------------------------------------------

    def peers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        return self.call(self.apeers())

    def links(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        return self.call(self.alinks())

    def coordinator(self) -> LeaseRecord | None:
        """Sync ``acoordinator``."""
        return self.call(self.acoordinator())

    def runs(self) -> list[RunStatusRecord]:
        """Sync ``aruns``."""
        return self.call(self.aruns())

    def jobs(self) -> dict[tuple[str, int, str], list[PlanStageRecord]]:
        """Sync ``ajobs``."""
        return self.call(self.ajobs())

    @property
    def multiaddrs(self) -> list[str]:
        """Multiaddrs of live peers: what a new machine passes as ``--initial-peers``."""
        return sorted({m for peer in self.peers() for m in peer.maddrs})

    # -- training ----------------------------------------------------------------------

    def data_owner(self) -> DataOwner:
        """This process as a data owner on this swarm: it plans, submits, sets pipelines up
        and trains (``training.DataOwner``)."""
        return DataOwner(self)

    def train(self, job: JobSpec, **kwargs: Any) -> TrainResult:
        """Trains ``job`` on the swarm with this process as its data owner
        (``DataOwner.train``: the coordinator plans it, the data never leaves this process).

        Raises:
            ConfigError, SwarmError, CoordinatorError, ProtocolError: see ``DataOwner.train``.
        """
        return self.data_owner().train(job, **kwargs)

    def export(self, run_dir: str | Path, out_dir: str | Path, **kwargs: Any) -> Path:
        """Writes a finished or checkpointed run's weights, read peer to peer from the shards
        its stages keep, into ``out_dir`` (``DataOwner.export``).

        Raises:
            ConfigError, ProtocolError: see ``DataOwner.export``.
        """
        return self.data_owner().export(run_dir, out_dir, **kwargs)
