"""Builds a ``TestbedTopology`` out of Linux network namespaces, and always tears it down.

Per cluster k: a router namespace with a bridge (10.77.k.1/24) and one host namespace per
host (10.77.k.10+i), each joined to the bridge by a veth whose two ends are shaped with
``tc tbf`` at the cluster's host rate (so intra-cluster traffic cannot starve the WAN).
Every pair of routers is joined by its own veth (10.78.p.1/.2), each end shaped at the
rate of its direction: per-direction WAN rates without classifiers. Hosts' routes use cubic
(BBR, this kernel's default, is erratic on delay-free tbf links).

Nothing touches the root namespace: veths are created directly inside their namespaces,
and only the namespaces' own addresses are routed. ``teardown()`` (also on ``__exit__``,
at exit, and on SIGINT/SIGTERM inside the ``with`` block) ends the processes left in the
namespaces and deletes every namespace it made; ``remove_stale()`` deletes the namespaces
of a testbed whose process died without tearing down.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import psutil

from benchmarks.testbed.topology import TestbedTopology

__all__ = ["Host", "Testbed", "TestbedError", "remove_stale"]

logger = logging.getLogger(__name__)

PREFIX = "fp2p"
_OURS = re.compile(rf"^{PREFIX}(\d+)-")


class TestbedError(RuntimeError):
    """A testbed command failed (the message names it and what ``ip``/``tc`` said)."""


@dataclass(frozen=True)
class Host:
    """One emulated machine: a namespace with one address."""

    cluster: str
    index: int
    netns: str
    ip: str

    @property
    def name(self) -> str:
        return f"{self.cluster}{self.index}"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise TestbedError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    return proc.stdout


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _end_processes(netns: str) -> None:
    """Ends what still runs inside ``netns`` (only our own testbed's namespaces get here)."""
    with contextlib.suppress(TestbedError):
        pids = [int(p) for p in _run(["ip", "netns", "pids", netns]).split()]
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                proc.terminate()
                procs.append(proc)
        _, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)


def _delete(netns: str) -> None:
    _end_processes(netns)
    with contextlib.suppress(TestbedError):
        _run(["ip", "netns", "delete", netns])


def remove_stale() -> list[str]:
    """Deletes the namespaces of testbeds whose process is gone; returns their names."""
    stale = []
    for name in _namespaces():
        match = _OURS.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            _delete(name)
            stale.append(name)
    if stale:
        logger.warning("removed %d namespace(s) left by a dead testbed: %s", len(stale), ", ".join(stale))
    return stale


def _tbf(netns: str, dev: str, mbps: float) -> list[str]:
    rate = mbps * 1e6 / 8  # bytes/s
    burst = max(int(rate / 500), 15_140)  # 2 ms of traffic, at least ten full frames
    return [
        *("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{mbps * 1000:.0f}kbit", "burst", str(burst), "latency", "50ms"),
    ]


class Testbed:
    """The namespaces, veths and shapers of one topology; a context manager.

    ``hosts`` lists every host, cluster by cluster; ``hosts_of(cluster)`` one cluster's.
    """

    def __init__(self, topology: TestbedTopology) -> None:
        self.topology = topology
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        self._old_handlers: dict[int, Any] = {}
        for k, cluster in enumerate(topology.clusters, start=1):
            for i in range(cluster.hosts):
                self.hosts.append(
                    Host(cluster.name, i, f"{self.tag}-{cluster.name}{i}", f"10.77.{k}.{10 + i}")
                )

    def hosts_of(self, cluster: str) -> list[Host]:
        return [h for h in self.hosts if h.cluster == cluster]

    def _router(self, cluster: str) -> str:
        return f"{self.tag}-r-{cluster}"

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def build(self) -> Testbed:
        """Creates everything; on any failure tears down what was made and raises.

        Raises:
            TestbedError: not root, no ``ip``/``tc``, or a command failed.
        """
        if os.geteuid() != 0:
            raise TestbedError("the testbed needs root (network namespaces, tc)")
        remove_stale()
        start = time.perf_counter()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        atexit.register(self.teardown)
        logger.info(
            "testbed %s: %d cluster(s), %d host(s) built in %.1f s",
            self.topology.name,
            len(self.topology.clusters),
            len(self.hosts),
            time.perf_counter() - start,
        )
        return self

    def _build(self) -> None:
        topo = self.topology
        for k, cluster in enumerate(topo.clusters, start=1):
            router = self._router(cluster.name)
            self._add_netns(router)
            _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            _run(["ip", "-n", router, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", router, "addr", "add", f"10.77.{k}.1/24", "dev", "br0"])
            _run(["ip", "-n", router, "link", "set", "br0", "up"])
            for host in self.hosts_of(cluster.name):
                self._add_netns(host.netns)
                port, route = f"h{host.index}", ("ip", "-n", host.netns, "route")
                _run(
                    [
                        *("ip", "-n", router, "link", "add", port, "type", "veth"),
                        *("peer", "name", "eth0", "netns", host.netns),
                    ]
                )
                _run(["ip", "-n", router, "link", "set", port, "master", "br0", "up"])
                _run(["ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
                _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])
                # per route, since a namespace may only pick the root's allowed algorithms
                _run(
                    [*route, "replace", f"10.77.{k}.0/24", "dev", "eth0", "src", host.ip, "congctl", "cubic"]
                )
                _run([*route, "add", "default", "via", f"10.77.{k}.1", "congctl", "cubic"])
                _run(_tbf(host.netns, "eth0", cluster.host_mbps))
                _run(_tbf(router, port, cluster.host_mbps))
        index = {c.name: k for k, c in enumerate(topo.clusters, start=1)}
        for p, (a, b) in enumerate(itertools.combinations([c.name for c in topo.clusters], 2), start=1):
            ra, rb = self._router(a), self._router(b)
            _run(
                ["ip", "-n", ra, "link", "add", f"w{b}", "type", "veth", "peer", "name", f"w{a}", "netns", rb]
            )
            for router, dev, ip, other, peer_ip in (
                (ra, f"w{b}", f"10.78.{p}.1", b, f"10.78.{p}.2"),
                (rb, f"w{a}", f"10.78.{p}.2", a, f"10.78.{p}.1"),
            ):
                _run(["ip", "-n", router, "addr", "add", f"{ip}/24", "dev", dev])
                _run(["ip", "-n", router, "link", "set", dev, "up"])
                _run(["ip", "-n", router, "route", "add", f"10.77.{index[other]}.0/24", "via", peer_ip])
            _run(_tbf(ra, f"w{b}", topo.rate(a, b)))
            _run(_tbf(rb, f"w{a}", topo.rate(b, a)))

    def teardown(self) -> None:
        """Ends every process left in the namespaces and deletes them; idempotent."""
        made, self._made = self._made, []
        for name in reversed(made):
            _delete(name)
        if made:
            logger.info("testbed %s torn down (%d namespaces)", self.topology.name, len(made))
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def __enter__(self) -> Testbed:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: atexit still tears down
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self.build()

    def __exit__(self, *exc: object) -> None:
        try:
            self.teardown()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()
