"""The swarm as the planner sees it: arrays of peer speed, memory, link bandwidth and latency.

Built from PeerRecords and LinkRecords. A direction measured only the other way is taken
from its reverse; a pair never measured (on a large swarm, most pairs: each peer probes a
bounded set) is inferred from the measured ones by ``planning.infer``: the two clusters'
typical bandwidth, capped by the fastest link either peer was measured on. A swarm whose
measured links do not connect every peer is refused: nothing tells how those parts talk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fusionp2p.errors import FusionP2PError
from fusionp2p.planning.cost import codec_seconds
from fusionp2p.planning.infer import infer_unmeasured
from fusionp2p.records import CODEC_TERMS, LinkRecord, PeerRecord

__all__ = ["PlanningError", "Topology", "connected_to"]


class PlanningError(FusionP2PError, ValueError):
    """The planner cannot make a plan; the message says what is missing or wrong."""


@dataclass(frozen=True, eq=False)
class Topology:
    """Peers ``0..n-1`` and their links; ``bandwidth[i, j]`` is bytes/s from i to j."""

    peer_ids: tuple[str, ...]
    speed: np.ndarray  # FLOP/s per peer (fp32 matmul)
    memory: np.ndarray  # bytes each peer may fill
    bandwidth: np.ndarray  # (n, n) bytes/s, inf on the diagonal
    latency: np.ndarray  # (n, n) one-way seconds (RTT / 2), 0 on the diagonal
    measured: np.ndarray  # (n, n) bool: this very direction was probed (a reverse-filled one was not)
    # (n, 4) seconds of Top-K coding per peer, columns as records.CODEC_TERMS; 0 where unknown
    codec: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CODEC_TERMS))))
    # (n,) int: peers of one site (a data centre, one declared --site) reach another site
    # through one shared link per direction; by default every peer is its own site
    site: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))

    def __post_init__(self) -> None:
        if len(self.codec) == 0 and self.peer_ids:
            object.__setattr__(self, "codec", np.zeros((len(self.peer_ids), len(CODEC_TERMS))))
        if len(self.site) == 0 and self.peer_ids:
            object.__setattr__(self, "site", np.arange(len(self.peer_ids)))

    def link_resource(self, src: int, dst: int) -> tuple[str, int, int]:
        """What a transfer ``src -> dst`` occupies: the shared link from ``src``'s site to
        ``dst``'s, or the pair's own link inside one site."""
        a, b = int(self.site[src]), int(self.site[dst])
        return ("site", a, b) if a != b else ("pair", int(src), int(dst))

    def __len__(self) -> int:
        return len(self.peer_ids)

    def coding_s(
        self,
        src: np.ndarray | int,
        dst: np.ndarray | int,
        numel: np.ndarray | float,
        ratio: np.ndarray | float,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(sender, receiver) seconds of Top-K coding for ``numel`` elements sent ``src -> dst``
        at ``ratio`` (``cost.codec_seconds``; peers may be index arrays)."""
        return (
            codec_seconds(numel, ratio, self.codec[src, 0], self.codec[src, 1]),
            codec_seconds(numel, ratio, self.codec[dst, 2], self.codec[dst, 3]),
        )

    def link_codec(self, src: int, dst: int) -> tuple[float, float]:
        """Top-K coding of a link ``src -> dst``, both sides together: (seconds per dense
        element, seconds per kept entry)."""
        return (
            float(self.codec[src, 0] + self.codec[dst, 2]),
            float(self.codec[src, 1] + self.codec[dst, 3]),
        )

    @classmethod
    def from_arrays(
        cls,
        peer_ids: Sequence[str],
        speed: Sequence[float],
        memory: Sequence[float],
        bandwidth: np.ndarray,
        latency: np.ndarray | None = None,
        codec: np.ndarray | None = None,
        site: Sequence[int] | None = None,
    ) -> Topology:
        """A fully measured topology from plain arrays (tests, synthetic swarms); ``codec``
        (n, 4) as ``Topology.codec``, free where not given; ``site`` as ``Topology.site``."""
        n = len(peer_ids)
        bw = np.array(bandwidth, dtype=float)
        lat = np.zeros((n, n)) if latency is None else np.array(latency, dtype=float)
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, 0.0)
        topo = cls(
            tuple(peer_ids),
            np.asarray(speed, dtype=float),
            np.asarray(memory, dtype=float),
            bw,
            lat,
            ~np.eye(n, dtype=bool),
            np.zeros((n, len(CODEC_TERMS))) if codec is None else np.array(codec, dtype=float),
            np.arange(n) if site is None else np.array(site, dtype=int),
        )
        topo.validate()
        return topo

    @classmethod
    def from_records(cls, peers: Sequence[PeerRecord], links: Sequence[LinkRecord]) -> Topology:
        """Builds the planner's view of a swarm.

        Raises:
            PlanningError: no peers, a bad measurement, or a disconnected link graph.
        """
        if not peers:
            raise PlanningError("the swarm has no live peers to plan on")
        ids = tuple(sorted(p.peer_id for p in peers))
        pos = {pid: i for i, pid in enumerate(ids)}
        by_id = {p.peer_id: p for p in peers}
        n = len(ids)
        bw = np.full((n, n), np.nan)
        lat = np.full((n, n), np.nan)
        for link in links:
            if link.src in pos and link.dst in pos:
                bw[pos[link.src], pos[link.dst]] = link.bandwidth_bytes_per_s
                lat[pos[link.src], pos[link.dst]] = link.rtt_s / 2
        measured = ~np.isnan(bw)
        np.fill_diagonal(measured, False)
        _check_connected(ids, measured)
        bw, lat = infer_unmeasured(bw, lat)
        speed = np.array([by_id[i].train_flops for i in ids])
        memory = np.array([float(by_id[i].memory_bytes) for i in ids])
        codec = np.array([[by_id[i].topk_codec_s.get(t, 0.0) for t in CODEC_TERMS] for i in ids])
        first: dict[str, int] = {}  # a site's number: its first peer's; no declared site: its own
        site = np.array([first.setdefault(by_id[i].site or f"peer:{i}", k) for k, i in enumerate(ids)])
        topo = cls(ids, speed, memory, bw, lat, measured, codec, site)
        topo.validate()
        return topo

    def without(self, peer_id: str) -> Topology:
        """The same swarm without ``peer_id`` (its links stay in the other pairs' widest paths)."""
        return self.subset([p for p in self.peer_ids if p != peer_id])

    def subset(self, peer_ids: Sequence[str]) -> Topology:
        """The same measurements and inferences, for ``peer_ids`` only (in this order)."""
        pos = {pid: i for i, pid in enumerate(self.peer_ids)}
        keep = np.array([pos[pid] for pid in peer_ids], dtype=int)
        return Topology(
            tuple(peer_ids),
            self.speed[keep],
            self.memory[keep],
            self.bandwidth[np.ix_(keep, keep)],
            self.latency[np.ix_(keep, keep)],
            self.measured[np.ix_(keep, keep)],
            self.codec[keep],
            self.site[keep],
        )

    def link_records(self, measured_at: float) -> list[LinkRecord]:
        """Every ordered pair as a LinkRecord (one inferred or taken from its reverse has
        ``extra["inferred"] = 1``: no signed record of that direction vouches for it):
        what ``from_records`` rebuilds this very topology from, with the peers' records."""
        n = len(self.peer_ids)
        return [
            LinkRecord(
                src=self.peer_ids[i],
                dst=self.peer_ids[j],
                bandwidth_bytes_per_s=float(self.bandwidth[i, j]),
                rtt_s=float(2 * self.latency[i, j]),
                measured_at=measured_at,
                extra={} if self.measured[i, j] else {"inferred": 1.0},
            )
            for i in range(n)
            for j in range(n)
            if i != j
        ]

    def validate(self) -> None:
        """Raises PlanningError on NaN, negative or zero measurements."""
        n = len(self.peer_ids)
        for name, arr in (("speed", self.speed), ("memory", self.memory)):
            if arr.shape != (n,) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
                bad = [self.peer_ids[i][-8:] for i in np.flatnonzero(~np.isfinite(arr) | (arr < 0))]
                raise PlanningError(f"peer {name} must be finite and >= 0; bad for {bad}")
        if np.any(self.speed <= 0):
            raise PlanningError("every peer needs a positive measured speed")
        off = ~np.eye(n, dtype=bool)
        if (
            self.bandwidth.shape != (n, n)
            or np.any(np.isnan(self.bandwidth))
            or np.any(self.bandwidth[off] <= 0)
        ):
            raise PlanningError("link bandwidths must be positive numbers (no NaN, no zero)")
        if np.any(np.isnan(self.latency)) or np.any(self.latency < 0):
            raise PlanningError("link latencies must be >= 0 (no NaN)")
        if self.codec.shape != (n, len(CODEC_TERMS)) or not np.all((self.codec >= 0) & (self.codec < 1)):
            raise PlanningError(f"Top-K coding seconds must be (n, {len(CODEC_TERMS)}) values in [0, 1)")
        if self.site.shape != (n,):
            raise PlanningError(f"site labels must be one per peer, got shape {self.site.shape}")


def _check_connected(ids: tuple[str, ...], measured: np.ndarray) -> None:
    n = len(ids)
    seen, stack = {0}, [0]
    adjacency = measured | measured.T
    while stack:
        i = stack.pop()
        for j in np.flatnonzero(adjacency[i]):
            if j not in seen:
                seen.add(int(j))
                stack.append(int(j))
    if len(seen) < n:
        cut_off = [ids[i][-8:] for i in range(n) if i not in seen]
        raise PlanningError(
            f"the swarm is disconnected: no measured link joins peers {cut_off} to the rest "
            f"({len(seen)} of {n} peers reachable); wait for link probes or check their network"
        )


def connected_to(root: str, links: Sequence[LinkRecord]) -> set[str]:
    """The peers that measured links (either direction) join to ``root``, ``root`` included."""
    adjacent: dict[str, set[str]] = {}
    for link in links:
        adjacent.setdefault(link.src, set()).add(link.dst)
        adjacent.setdefault(link.dst, set()).add(link.src)
    seen, stack = {root}, [root]
    while stack:
        for other in adjacent.get(stack.pop(), ()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen
