"""The emulated WAN's shape: clusters of hosts and the per-direction rates between them.

A topology is a small TOML file, checked completely before anything is created::

    name = "paper3"
    host_mbps = 1000                  # every host's link to its cluster, each direction

    [[cluster]]
    name = "a"
    hosts = 4
    slowdown = 0.25                   # emulated device speed of its peers, in (0, 1]

    [[cluster]]
    name = "b"
    hosts = 3
    host_mbps = 500                   # optional: this cluster's host links

    [[wan]]
    between = ["a", "b"]
    mbps = 1000                       # a -> b
    reverse_mbps = 200                # b -> a (default: mbps)

Every pair of clusters needs one ``[[wan]]`` entry. ``delay_ms`` is accepted as 0 only:
this kernel has no ``netem`` and the testbed has no delaying relay, so a topology that
asks for delay is refused rather than silently run without it.
"""

from __future__ import annotations

import itertools
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Cluster", "TestbedTopology", "TopologyError", "WanLink", "load_topology"]

MAX_CLUSTERS = 8
MAX_HOSTS = 32  # per cluster
MIN_MBPS, MAX_MBPS = 0.1, 10_000.0
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class TopologyError(ValueError):
    """A topology file that cannot be built: one line naming the field."""


@dataclass(frozen=True)
class Cluster:
    """Hosts bridged on one switch, each with a capped link to it."""

    name: str
    hosts: int
    host_mbps: float
    slowdown: float = 1.0  # emulated device speed of the peers run here (1: this machine's)


@dataclass(frozen=True)
class WanLink:
    """One direction of the link between two clusters' routers."""

    src: str
    dst: str
    mbps: float


@dataclass(frozen=True)
class TestbedTopology:
    """Clusters and one rate per ordered pair of them."""

    name: str
    clusters: tuple[Cluster, ...]
    wan: tuple[WanLink, ...]

    def rate(self, src: str, dst: str) -> float:
        """Mbit/s from cluster ``src`` to cluster ``dst``."""
        return next(w.mbps for w in self.wan if w.src == src and w.dst == dst)

    def cluster(self, name: str) -> Cluster:
        return next(c for c in self.clusters if c.name == name)

    @property
    def n_hosts(self) -> int:
        return sum(c.hosts for c in self.clusters)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "topology") -> TestbedTopology:
        """Checks ``raw`` (a parsed TOML file) field by field.

        Raises:
            TopologyError: the first field that is missing, unknown or out of range.
        """

        def fail(field: str, why: str) -> TopologyError:
            return TopologyError(f"{where}: {field}: {why}")

        def number(field: str, value: Any, low: float, high: float) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise fail(field, f"must be a number, got {value!r:.40}")
            if not low <= value <= high:
                raise fail(field, f"must be in [{low}, {high}], got {value}")
            return float(value)

        def table(at: str, entry: Any, keys: set[str]) -> None:
            if not isinstance(entry, dict):
                raise fail(at, "must be a table")
            unknown = set(entry) - keys
            if unknown:
                raise fail(f"{at} {sorted(unknown)[0]}".strip(), "unknown key")

        table("", raw, {"name", "host_mbps", "cluster", "wan"})
        name = raw.get("name", "testbed")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", name):
            raise fail("name", f"1-32 letters, digits, '-' or '_', got {name!r:.40}")
        host_mbps = number("host_mbps", raw.get("host_mbps", 1000), MIN_MBPS, MAX_MBPS)
        entries = raw.get("cluster", [])
        if not isinstance(entries, list) or not 2 <= len(entries) <= MAX_CLUSTERS:
            raise fail("[[cluster]]", f"needs 2 to {MAX_CLUSTERS} clusters, got {len(entries)}")
        clusters: list[Cluster] = []
        for i, entry in enumerate(entries):
            at = f"[[cluster]] {i + 1}"
            table(at, entry, {"name", "hosts", "host_mbps", "slowdown"})
            cname = entry.get("name")
            if not isinstance(cname, str) or not _NAME.match(cname):
                raise fail(f"{at} name", f"1-8 lowercase letters or digits, got {cname!r:.40}")
            if any(c.name == cname for c in clusters):
                raise fail(f"{at} name", f"{cname!r} names two clusters")
            hosts = entry.get("hosts")
            if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
                raise fail(f"{at} hosts", f"must be an integer in [1, {MAX_HOSTS}], got {hosts!r:.40}")
            clusters.append(
                Cluster(
                    cname,
                    hosts,
                    number(f"{at} host_mbps", entry.get("host_mbps", host_mbps), MIN_MBPS, MAX_MBPS),
                    number(f"{at} slowdown", entry.get("slowdown", 1.0), 0.01, 1.0),
                )
            )
        names = {c.name for c in clusters}
        wan: dict[tuple[str, str], float] = {}
        links = raw.get("wan", [])
        if not isinstance(links, list):
            raise fail("[[wan]]", "must be an array of tables")
        for i, entry in enumerate(links):
            at = f"[[wan]] {i + 1}"
            table(at, entry, {"between", "mbps", "reverse_mbps", "delay_ms"})
            pair = entry.get("between")
            if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
                raise fail(f"{at} between", f"must name two different clusters, got {pair!r:.60}")
            for c in pair:
                if c not in names:
                    raise fail(f"{at} between", f"no cluster named {c!r:.20} (clusters: {sorted(names)})")
            a, b = pair
            if (a, b) in wan or (b, a) in wan:
                raise fail(f"{at} between", f"{a} and {b} are linked twice")
            if number(f"{at} delay_ms", entry.get("delay_ms", 0), 0, 10_000) > 0:
                raise fail(
                    f"{at} delay_ms",
                    "delay is not emulated (no netem in this kernel, no delaying relay here): set it to 0",
                )
            wan[a, b] = number(f"{at} mbps", entry.get("mbps"), MIN_MBPS, MAX_MBPS)
            wan[b, a] = number(f"{at} reverse_mbps", entry.get("reverse_mbps", wan[a, b]), MIN_MBPS, MAX_MBPS)
        for a, b in itertools.combinations([c.name for c in clusters], 2):
            if (a, b) not in wan:
                raise fail("[[wan]]", f"clusters {a} and {b} have no link: every pair needs one")
        return cls(name, tuple(clusters), tuple(WanLink(s, d, r) for (s, d), r in wan.items()))


def load_topology(path: str | Path) -> TestbedTopology:
    """Reads and checks a topology file.

    Raises:
        TopologyError: unreadable, not TOML, or a bad field (named in the message).
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise TopologyError(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{path}: not TOML: {e}") from None
    return TestbedTopology.from_dict(raw, str(path))
