"""Starting this process's hivemind DHT node, and keeping it from outliving us.

hivemind runs the DHT in a child process that owns a ``p2pd`` child. If our process dies
(SIGKILL), both would keep running; ``_exit_with_parent`` runs inside the DHT process,
notices the re-parenting within a second and shuts the node (and so ``p2pd``) down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from fusionp2p.errors import SwarmError
from fusionp2p.net.dropped_streams import quiet_dropped_streams
from fusionp2p.net.sockets import hivemind_sockets, remove_stale
from fusionp2p.net.validation import make_validators

__all__ = ["start_dht", "stop_dht"]

logger = logging.getLogger(__name__)

_WATCH_PERIOD = 0.5


def _remove_left_sockets(before: set[Path], patience_s: float = 3.0) -> None:
    """Removes the sockets a failed daemon left (it may take a moment to stop listening)."""
    deadline = time.monotonic() + patience_s
    while True:
        left = hivemind_sockets() - before
        remove_stale(left)
        if not (hivemind_sockets() - before) or time.monotonic() > deadline:
            return
        time.sleep(0.2)


async def _quiet(_dht: hivemind.DHT, _node: hivemind.DHTNode) -> None:
    """Runs in the DHT process: its streams that p2pd drops early are not errors either."""
    quiet_dropped_streams()


async def _exit_with_parent(_dht: hivemind.DHT, node: hivemind.DHTNode) -> None:
    """Runs in the DHT process: exits (and stops p2pd) once the process that started it is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(_WATCH_PERIOD)
    try:
        await asyncio.wait_for(node.shutdown(), 5)
    finally:
        os._exit(0)


def stop_dht(dht: hivemind.DHT, grace_s: float = 5.0) -> None:
    """Stops ``dht``'s process: hivemind's shutdown (a request, then SIGTERM), then SIGKILL
    when it still runs ``grace_s`` later. A DHT process that outlives its shutdown keeps
    this one from exiting, since ``multiprocessing`` joins its children at exit (seen: a
    peer that had left its swarm still running minutes later)."""
    dht.shutdown()
    dht.join(grace_s)
    if dht.is_alive():
        logger.warning("the DHT process did not stop on SIGTERM; killing it")
        dht.kill()
        dht.join(grace_s)


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    signing_key: object | None = None,
    client_mode: bool = False,
    fresh_identity: bool = False,
    validators: Sequence[RecordValidatorBase] | None = None,
) -> hivemind.DHT:
    """Starts a DHT node with fusionp2p's record validators and a parent watchdog.
    ``fresh_identity``: ``identity_path`` was just generated, so hivemind need not check
    (with a second daemon) that no other peer uses it. ``validators`` replace fusionp2p's
    (a simulator's publisher signs for many identities).

    Raises:
        SwarmError: p2pd could not start or no initial peer answered.
    """
    kwargs: dict[str, object] = {}
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity_path is not None:
        kwargs["identity_path"] = identity_path
        kwargs["check_if_identity_free"] = not fresh_identity
    sockets_before = hivemind_sockets()
    try:
        dht = hivemind.DHT(
            initial_peers=list(initial_peers) or None,
            start=True,
            client_mode=client_mode,
            host_maddrs=list(host_maddrs),
            record_validators=list(validators) if validators is not None else make_validators(signing_key),
            nat_port_map=False,  # no UPnP/NAT-PMP chatter with the LAN router
            **kwargs,
        )
    except Exception as e:
        _remove_left_sockets(sockets_before)
        hint = " (is any initial peer alive and reachable?)" if initial_peers else ""
        raise SwarmError(f"could not start the DHT node: {e}{hint}") from e
    dht.run_coroutine(_quiet, return_future=True)
    dht.run_coroutine(_exit_with_parent, return_future=True)
    return dht
