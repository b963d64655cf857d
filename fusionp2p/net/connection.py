"""``SwarmConnection``: this process's place in a swarm when it is not a peer.

A client-mode DHT node with a fresh signing identity, the swarm's directory read through
it, this process's libp2p handle for streams, and the one event loop they are bound to
(hivemind ties its futures to the first loop used). A ``Swarm`` reads the swarm through
it; a data owner (``training.DataOwner``) also measures, submits and trains through it.
Sync callers get a background thread that runs the loop; async callers use their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import tempfile
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Self, TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P

from fusionp2p.config import DEFAULT_SWARM, DEFAULT_TIMEOUTS, check_peer_maddr, check_site
from fusionp2p.errors import SwarmError
from fusionp2p.net.dht_node import start_dht, stop_dht
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.net.dropped_streams import quiet_dropped_streams
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.net.transport import ByteMeter, P2PTransport

__all__ = ["SwarmConnection"]

T = TypeVar("T")


def _start_signed_dht(initial_peers: Sequence[str]) -> tuple[Any, Any]:
    """A client-mode DHT node with a fresh identity, and that identity's record signer; the
    key file lives only while the daemon starts (nothing of it stays on disk)."""
    with tempfile.TemporaryDirectory(prefix="fusionp2p-swarm-") as folder:
        path = os.path.join(folder, "identity.key")
        ensure_identity(path)
        key = load_signing_key(path)
        dht = start_dht(
            initial_peers=initial_peers,
            client_mode=True,
            identity_path=path,
            signing_key=key,
            fresh_identity=True,
        )
        return dht, key


async def _end_loop_tasks(p2p: P2P | None) -> None:
    """Closes the libp2p handle and cancels what still runs on the loop, before it closes."""
    if p2p is not None:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class SwarmConnection:
    """A client of a swarm: its directory, a transport and the loop they live on.

    Raises:
        ConfigError: a malformed initial peer or site.
        SwarmError: no initial peer given, or none answered.
    """

    def __init__(
        self,
        initial_peers: Sequence[str],
        *,
        swarm: str = DEFAULT_SWARM,
        timeout: float = DEFAULT_TIMEOUTS.dht,
        site: str = "",
    ) -> None:
        self.site = check_site(site, "Swarm site")  # this process's, as PeerRecord.site
        if not initial_peers:
            raise SwarmError(
                "Swarm needs at least one initial peer multiaddr (printed by `fusionp2p peer` at start)"
            )
        self.initial_peers = [check_peer_maddr(m, "--initial-peers") for m in initial_peers]
        self.name = swarm
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._p2p: P2P | None = None
        self.meter = ByteMeter()  # bytes this process sent on its streams
        try:
            asyncio.get_running_loop()
            self._dht, key = _start_signed_dht(self.initial_peers)
        except RuntimeError:
            # sync use: hivemind's futures bind to the thread's current loop (creating one if
            # there is none, never closed); give them this connection's own loop, closed on close()
            self._loop = asyncio.new_event_loop()
            previous = getattr(asyncio.get_event_loop_policy(), "_local", None)
            previous_loop = getattr(previous, "_loop", None)
            asyncio.set_event_loop(self._loop)
            try:
                self._dht, key = _start_signed_dht(self.initial_peers)
            except BaseException:
                self._loop.close()
                raise
            finally:
                asyncio.set_event_loop(previous_loop)
        marker = RSASignatureValidator(key).local_public_key  # signs this process's run reports
        self.directory = SwarmDirectory(self._dht, swarm, owner_marker=marker, timeout=timeout)

    async def transport(self) -> P2PTransport:
        """This process's libp2p handle for streams (one, on this connection's loop)."""
        if self._p2p is None:
            quiet_dropped_streams()
            self._p2p = await self._dht.replicate_p2p()
        return P2PTransport(self._p2p, self.meter)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on this connection's event loop (where its libp2p handle lives) and
        returns its result; for sync callers.

        Raises:
            SwarmError: the connection is closed.
        """
        return self.spawn(coro).result()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts ``coro`` on this connection's event loop and returns at once: its future.

        Raises:
            SwarmError: the connection is closed.
        """
        if self._closed:
            coro.close()
            raise SwarmError("this Swarm is closed")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._thread is None:
            # one long-lived loop: hivemind ties its futures to the first loop used
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="fusionp2p-swarm", daemon=True
            )
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Leaves the DHT and stops the background thread; idempotent."""
        if self._closed:
            return
        if self._thread is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_end_loop_tasks(self._p2p), self._loop).result(
                    DEFAULT_TIMEOUTS.shutdown
                )
        self._closed = True
        stop_dht(self._dht)
        if self._loop is not None:
            if self._thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(DEFAULT_TIMEOUTS.shutdown / 2)
            self._loop.close()
