"""A reader's cached view of the swarm directory that refreshes only what went stale.

Every refresh reads all peer shards (liveness: about ``2 N / MAX_PEERS_PER_SHARD`` gets)
and the links of the sources that are new or were read more than ``links_max_age``
seconds ago, at most ``max_link_reads`` of them, stalest first. A link measurement stays
in the view while its peer is alive and it is younger than ``links_max_age`` read-wise:
its DHT expiry only says when the peer must republish it, and a live peer does. So a
coordinator that refreshes every few seconds spreads the link reads over time, and a
refresh at planning time reads the few that fell due.

The view is honest: ``ViewState`` says how many live peers have no links read yet, how
many keys could not be read (``Unread``), and how old the oldest read is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fusionp2p.net.directory import SwarmDirectory, Unread
from fusionp2p.records import LinkRecord, PeerRecord

__all__ = ["DirectoryView", "ViewState"]


@dataclass(frozen=True)
class ViewState:
    """What a refresh did and how complete the view is now."""

    peers: int  # live peers in the view
    links: int  # link records held of live peers
    link_reads: int  # sources whose links this refresh read
    unread: int  # directory keys this refresh could not read
    without_links: int  # live peers whose links were never read
    oldest_read_s: float  # age of the oldest links read held (0 when none)
    seconds: float  # how long the refresh took

    @property
    def complete(self) -> bool:
        """Every live peer's links were read, and no key was missing this time."""
        return self.without_links == 0 and self.unread == 0


@dataclass
class _Source:
    links: list[LinkRecord]
    read_at: float


class DirectoryView:
    """The swarm's peers and their links as last read from ``directory`` (see the module)."""

    def __init__(
        self,
        directory: SwarmDirectory,
        *,
        links_max_age: float = 60.0,
        max_link_reads: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.clock = clock  # what ages the links read (seconds)
        self.links_max_age = links_max_age
        self.max_link_reads = max_link_reads
        self._peers: dict[str, PeerRecord] = {}
        self._sources: dict[str, _Source] = {}

    async def refresh(self, unread: Unread | None = None) -> ViewState:
        """Reads the peers and the links that fell due; a key that could not be read goes
        to ``unread`` (or, without one, the refresh raises ``IncompleteReadError``) and its
        cached contents, if any, stay in the view."""
        start = self.clock()
        missing = Unread()
        live = await self.directory.fetch_peers(unread=missing)
        if missing.keys:  # a shard could not be read: keep its peers as they were
            live = {**{p: r for p, r in self._peers.items() if p not in live}, **live}
        self._peers = live
        self._sources = {src: cached for src, cached in self._sources.items() if src in live}
        now = self.clock()
        due = sorted(
            (
                p
                for p in live
                if p not in self._sources or now - self._sources[p].read_at >= self.links_max_age
            ),
            key=lambda p: self._sources[p].read_at if p in self._sources else float("-inf"),
        )[: self.max_link_reads]
        read = await self.directory.fetch_links_by_source(due, unread=missing)
        now = self.clock()
        for src, links in read.items():
            self._sources[src] = _Source(links, now)
        missing.check(unread)
        return ViewState(
            peers=len(live),
            links=sum(len(s.links) for s in self._sources.values()),
            link_reads=len(read),
            unread=len(missing.keys),
            without_links=sum(1 for p in live if p not in self._sources),
            oldest_read_s=max((now - s.read_at for s in self._sources.values()), default=0.0),
            seconds=now - start,
        )

    def peers(self) -> dict[str, PeerRecord]:
        """Live peers by PeerID, as of the last refresh."""
        return dict(self._peers)

    def links(self, among: set[str] | None = None) -> list[LinkRecord]:
        """The links held whose two ends are live (and in ``among``, if given)."""
        ends = set(self._peers) if among is None else set(self._peers) & among
        return [
            lk for src in ends if src in self._sources for lk in self._sources[src].links if lk.dst in ends
        ]
