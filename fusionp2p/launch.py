"""``LocalSwarm``: several ``fusionp2p peer`` OS processes on this machine.

Used by the demo and the integration tests. Every peer is a real process with its own
DHT node and p2pd on loopback. ``stop()`` (also on ``__exit__``) ends them with SIGTERM,
then SIGKILL after a grace period, and finally ends any descendant (DHT process, p2pd)
still alive, by PID, so no run leaves processes behind; the unix sockets of peers that
were killed, and the work directory it made, go too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fusionp2p.errors import SwarmError
from fusionp2p.net.sockets import daemon_sockets, listening_sockets, remove_stale

__all__ = ["LocalSwarm", "PeerProcess"]

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # where a peer listens unless its launcher says otherwise


@dataclass
class PeerProcess:
    """One launched peer: its process, log file and what it reported when ready."""

    index: int
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    peer_id: str = ""
    multiaddrs: list[str] = field(default_factory=list)
    descendants: dict[int, psutil.Process] = field(default_factory=dict)
    sockets: set[Path] = field(default_factory=set)  # its p2pd's unix sockets, removed if left dead

    def log(self) -> str:
        """Everything the peer wrote to stdout/stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def remember_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            me = psutil.Process(self.popen.pid)
            self.sockets |= listening_sockets(me)
            for child in me.children(recursive=True):
                self.descendants.setdefault(child.pid, child)
                with contextlib.suppress(psutil.Error):
                    self.sockets |= daemon_sockets(child.cmdline()) | listening_sockets(child)


class LocalSwarm:
    """Starts ``n_peers`` peers on loopback; peer 0 starts the swarm, the others join it.

    ``allow_models`` (``"module:factory"`` import paths, importable by the peers, e.g.
    through ``env={"PYTHONPATH": ...}``) lets the peers serve models besides the built-in
    families; ``peer_args`` adds any other ``fusionp2p peer`` flags per peer. A testbed
    gives each peer a ``launchers`` prefix (``ip netns exec NS``, which execs, so the PID
    stays the peer's) and its own ``host_maddrs`` entry.
    """

    def __init__(
        self,
        n_peers: int,
        *,
        swarm: str = "local",
        workdir: str | None = None,
        peer_args: Sequence[Sequence[str]] | None = None,
        log_level: str = "info",
        env: dict[str, str] | None = None,
        allow_models: Sequence[str] = (),
        launchers: Sequence[Sequence[str]] | None = None,
        host_maddrs: Sequence[str] | None = None,
    ) -> None:
        if n_peers < 1:
            raise SwarmError(f"a local swarm needs at least one peer, got {n_peers}")
        self.n_peers = n_peers
        self.swarm = swarm
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fusionp2p-local-"))
        self.peer_args = [list(a) for a in (peer_args or [[]] * n_peers)]
        self.allow_models = list(allow_models)  # passed to every peer as --allow-model
        self.log_level = log_level
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("FUSIONP2P_CACHE", str(self.workdir / "cache"))
        self.peers: list[PeerProcess] = []
        self.launchers = [list(a) for a in (launchers or [[]] * n_peers)]
        self.host_maddrs = list(host_maddrs or [LOOPBACK] * n_peers)
        if len(self.launchers) != n_peers or len(self.host_maddrs) != n_peers:
            raise SwarmError(f"launchers and host_maddrs need one entry per peer ({n_peers})")

    @property
    def initial_peers(self) -> list[str]:
        """Multiaddrs of peer 0."""
        return list(self.peers[0].multiaddrs) if self.peers else []

    def _spawn(self, index: int, initial_peers: Sequence[str]) -> PeerProcess:
        log_path = self.workdir / f"peer{index}.log"
        ready_path = self.workdir / f"peer{index}.ready.json"
        cmd = [
            *self.launchers[index],
            sys.executable,
            "-m",
            "fusionp2p",
            "--log-level",
            self.log_level,
            "peer",
            "--swarm",
            self.swarm,
            "--host-maddrs",
            self.host_maddrs[index],
            "--identity",
            str(self.workdir / f"peer{index}.key"),
            "--checkpoint-dir",
            str(self.workdir / f"peer{index}-shards"),
            "--ready-file",
            str(ready_path),
            "--exit-with-parent",
            *(arg for model in self.allow_models for arg in ("--allow-model", model)),
            *self.peer_args[index],
        ]
        if initial_peers:
            cmd += ["--initial-peers", *initial_peers]
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, stdin=subprocess.DEVNULL
            )
        return PeerProcess(index, popen, log_path, ready_path)

    def _wait_ready(self, peer: PeerProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if peer.popen.poll() is not None:
                raise SwarmError(
                    f"peer {peer.index} exited with {peer.popen.returncode}:\n{peer.log()[-3000:]}"
                )
            if peer.ready_path.exists():
                info = json.loads(peer.ready_path.read_text())
                peer.peer_id, peer.multiaddrs = info["peer_id"], info["multiaddrs"]
                peer.remember_descendants()
                return
            time.sleep(0.1)
        raise SwarmError(f"peer {peer.index} not ready in time:\n{peer.log()[-3000:]}")

    def start(self, timeout: float = 120.0) -> LocalSwarm:
        """Starts every peer and waits until each has joined."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        try:
            self.peers.append(self._spawn(0, []))
            self._wait_ready(self.peers[0], deadline)
            self.peers += [self._spawn(i, self.initial_peers) for i in range(1, self.n_peers)]
            for peer in self.peers[1:]:
                self._wait_ready(peer, deadline)
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def add_peer(self, args: Sequence[str] = (), timeout: float = 60.0) -> PeerProcess:
        """Starts one more peer that joins through peer 0."""
        self.peer_args.append(list(args))
        self.launchers.append([])
        self.host_maddrs.append(LOOPBACK)
        peer = self._spawn(len(self.peers), self.initial_peers)
        self.peers.append(peer)
        self._wait_ready(peer, time.monotonic() + timeout)
        return peer

    def signal(self, index: int, sig: int) -> None:
        """Sends ``sig`` to peer ``index`` (after noting its children for cleanup)."""
        peer = self.peers[index]
        peer.remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.kill(peer.popen.pid, sig)

    def stop(self, grace: float = 15.0, *, keep_logs: bool = False) -> None:
        """Ends every peer and every descendant still running, then removes the work
        directory this swarm made itself (with ``keep_logs``, only the identity keys go:
        the logs stay for a failure to be read); idempotent."""
        for peer in self.peers:
            peer.remember_descendants()
            if peer.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    peer.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for peer in self.peers:
            try:
                peer.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("peer %d ignored SIGTERM; killing it", peer.index)
                peer.popen.kill()
                peer.popen.wait(5)
        descendants = [proc for peer in self.peers for proc in peer.descendants.values()]
        if _alive(descendants):
            time.sleep(2.0)  # the DHT watchdog usually ends them itself
            for proc in _alive(descendants):
                logger.warning("ending leftover process %d (%s)", proc.pid, proc.name())
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        remove_stale(path for peer in self.peers for path in peer.sockets)  # a SIGKILLed peer's
        self._clean_workdir(keep_logs)

    def _clean_workdir(self, keep_logs: bool) -> None:
        if not self._own_workdir or not self.workdir.exists():
            return
        if not keep_logs:
            shutil.rmtree(self.workdir, ignore_errors=True)
            return
        for key in self.workdir.glob("*.key"):
            key.unlink(missing_ok=True)
        for shards in self.workdir.glob("*-shards"):  # checkpoint shards are no log, and large
            shutil.rmtree(shards, ignore_errors=True)
        logger.warning("the peers' logs are kept in %s", self.workdir)

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # a failure keeps the peers' logs to be read; Ctrl-C is no failure of theirs
        failed = exc_type is not None and exc_type is not KeyboardInterrupt
        self.stop(keep_logs=failed)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    # is_running() also checks the creation time, so a reused PID is never mistaken for ours
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive
