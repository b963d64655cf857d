"""``Swarm``: the public Python view of a swarm, usable from any machine.

    with Swarm(initial_peers=["/ip4/.../p2p/Qm..."]) as swarm:
        for peer in swarm.peers(): ...
        for link in swarm.links(): ...

In async code use ``async with Swarm(...) as swarm`` and ``await swarm.apeers()`` /
``await swarm.alinks()``. A Swarm runs a client-mode DHT node: it reads the swarm's
records without serving as a full peer. Training will hang on this object later.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from fusionp2p.config import DEFAULT_SWARM
from fusionp2p.errors import SwarmError
from fusionp2p.net.dht_node import start_dht
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.records import LinkRecord, PeerRecord

__all__ = ["Swarm"]

T = TypeVar("T")


class Swarm:
    """A read-only handle on a swarm's live peers and measured links.

    Raises:
        SwarmError: no initial peer given, or none answered.
    """

    def __init__(
        self, initial_peers: Sequence[str], *, swarm: str = DEFAULT_SWARM, timeout: float = 15.0
    ) -> None:
        if not initial_peers:
            raise SwarmError(
                "Swarm needs at least one initial peer multiaddr (printed by `fusionp2p peer` at start)"
            )
        self.initial_peers = list(initial_peers)
        self.name = swarm
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        try:
            asyncio.get_running_loop()
            self._dht = start_dht(initial_peers=self.initial_peers, client_mode=True)
        except RuntimeError:
            # sync use: hivemind's futures bind to the thread's current loop (creating one if
            # there is none, never closed); give them this Swarm's own loop, closed on close()
            self._loop = asyncio.new_event_loop()
            previous = getattr(asyncio.get_event_loop_policy(), "_local", None)
            previous_loop = getattr(previous, "_loop", None)
            asyncio.set_event_loop(self._loop)
            try:
                self._dht = start_dht(initial_peers=self.initial_peers, client_mode=True)
            except BaseException:
                self._loop.close()
                raise
            finally:
                asyncio.set_event_loop(previous_loop)
        self._directory = SwarmDirectory(self._dht, swarm, timeout=timeout)

    # -- async API ---------------------------------------------------------------------

    async def apeers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        peers = await self._directory.fetch_peers()
        return [peers[pid] for pid in sorted(peers)]

    async def alinks(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        peers = await self._directory.fetch_peers()
        links = await self._directory.fetch_links(sorted(peers))
        return sorted((lk for lk in links if lk.dst in peers), key=lambda lk: (lk.src, lk.dst))

    async def __aenter__(self) -> Swarm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    # -- sync API ----------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise SwarmError("this Swarm is closed")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._thread is None:
            # one long-lived loop per Swarm: hivemind ties its futures to the first loop used
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="fusionp2p-swarm", daemon=True
            )
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def peers(self) -> list[PeerRecord]:
        """Live peers (unexpired records, not leaving), sorted by PeerID."""
        return self._run(self.apeers())

    def links(self) -> list[LinkRecord]:
        """Measured links whose two ends are live peers, sorted by (src, dst)."""
        return self._run(self.alinks())

    @property
    def multiaddrs(self) -> list[str]:
        """Multiaddrs of live peers: what a new machine passes as ``--initial-peers``."""
        return sorted({m for peer in self.peers() for m in peer.maddrs})

    def close(self) -> None:
        """Leaves the DHT and stops this handle's background thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._dht.shutdown()
        if self._loop is not None:
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
            self._loop.close()

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
