"""Bandwidth and RTT probes over the same stream transport that tensors use.

``PROBE_PROTOCOL`` (``records/probe.py``) on one stream, prober -> server: ``ping_count``
tiny round trips (the RTT is their median), then a bounded payload (goodput = bytes /
(elapsed - RTT)). The server refuses frames over ``max_bytes`` in total or of an
unexpected kind with a protocol error. ``LinkEstimator`` estimates each link from its
last ``window`` samples (the highest bandwidth and the lowest RTT among them, as BBR does:
a probe can only under-measure a link, when it shares it with training traffic or other
probes), sizes the next probe of each link to take about ``target_seconds``, and picks the
bounded sample of peers to probe next.

What a peer measures stays bounded at any swarm size: at most ``MAX_LINKS_PER_PEER`` links,
the ``NEAR_LINKS`` fastest (its own cluster, densely) and the most recently measured of
the rest (a random sample that rotates: representatives of the other clusters). Once it
holds that many, each round re-measures its stalest links and explores one or two peers it
never measured, half of them hints (peers its fastest neighbours measured fast, likely in
its cluster), half at random; a faster newcomer displaces the slowest near link, any other
the oldest sample. The coordinator infers the pairs nobody measured (``planning.infer``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from fusionp2p.config import ProbeConfig
from fusionp2p.errors import ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.records import MAX_LINKS_PER_PEER, PROBE_PROTOCOL, LinkRecord
from fusionp2p.records.probe import MAX_PING_PAYLOAD, PROBE_ACK, PROBE_FRAME_BYTES, PROBE_NONCE

__all__ = [
    "HIGH_RTT_S",
    "HINT_SOURCES",
    "NEAR_LINKS",
    "LinkEstimator",
    "LinkSample",
    "hints_from",
    "probe_bytes",
    "probe_link",
    "serve_probe",
]

NEAR_LINKS = 40  # of a peer's MAX_LINKS_PER_PEER links, this many are its fastest
_RTT_FLOOR = 100e-6  # seconds: a loopback or LAN pair counts as this near
HINT_SHARE = 0.75  # of a full peer's explorations, this share follows hints
HINT_SOURCES = 2  # hints: the links of this many of the peer's fastest neighbours
RAMP_SHARE = 2  # a probe's first 1/RAMP_SHARE covers TCP's ramp-up; the rest is timed as settled
BDP_PROBES = 8  # a probe carries at least this many bandwidth-delay products of its link
HIGH_RTT_S = 0.02  # a round trip this long or longer is a long-haul link
HIGH_RTT_BYTES = 4 << 20  # ... which a probe measures with at least this many bytes
_MIN_SETTLED_S = 2e-3  # a settled part shorter than this is timer noise: the whole transfer counts
_MIN_SETTLED_BYTES = 64 << 10
_MAX_SETTLED_GAIN = 4.0  # the settled rate counts up to this many times the whole transfer's


@dataclass(frozen=True)
class LinkSample:
    """One probe's raw result."""

    bandwidth_bytes_per_s: float
    rtt_s: float
    nbytes: int
    seconds: float


async def serve_probe(stream: FrameStream, *, max_bytes: int, timeout: float) -> None:
    """Answers one prober on ``stream``.

    Raises:
        ProtocolError: an unexpected frame kind, or more than ``max_bytes`` of DATA.
    """
    received = 0
    while True:
        kind, payload = await stream.recv(max_payload=PROBE_FRAME_BYTES, timeout=timeout)
        if kind is FrameKind.PING:
            if len(payload) > MAX_PING_PAYLOAD:
                raise ProtocolError(f"PING payload of {len(payload)} bytes > {MAX_PING_PAYLOAD}")
            await stream.send(FrameKind.PONG, payload, timeout=timeout)
        elif kind is FrameKind.DATA:
            received += len(payload)
            if received > max_bytes:
                raise ProtocolError(f"probe sent {received} bytes > limit {max_bytes}")
        elif kind is FrameKind.END:
            await stream.send(FrameKind.ACK, PROBE_ACK.pack(received), timeout=timeout)
            return
        else:
            raise ProtocolError(f"unexpected {kind.name} frame in a probe")


async def probe_link(
    transport: Transport, peer_id: str, *, nbytes: int, ping_count: int, timeout: float
) -> LinkSample:
    """Measures RTT and goodput from this peer to ``peer_id``.

    The payload goes in two parts with a PING between them; the server answers that PING
    once the first part arrived, and the final ACK once all of it did, so the time between
    their arrivals here is the second part's transfer at the rate the link settled on
    (TCP's ramp-up is spent on the first part; over 80 ms of RTT a 1 MiB probe read half
    the link as a whole). The goodput is the better of that and the whole transfer's.

    Raises:
        PeerUnreachableError: the peer did not answer within ``timeout``.
        ProtocolError: the peer answered with the wrong frames.
    """
    async with asyncio.timeout(timeout):
        stream = await transport.open(peer_id, PROBE_PROTOCOL, timeout=timeout)
        try:
            rtts = []
            for i in range(ping_count):
                nonce = PROBE_NONCE.pack(i)
                start = time.perf_counter()
                await stream.send(FrameKind.PING, nonce, timeout=timeout)
                kind, payload = await stream.recv(max_payload=MAX_PING_PAYLOAD, timeout=timeout)
                if kind is not FrameKind.PONG or payload != nonce:
                    raise ProtocolError(f"expected PONG {i}, got {kind.name}")
                rtts.append(time.perf_counter() - start)
            rtt = statistics.median(rtts)
            first = nbytes // RAMP_SHARE
            answers = asyncio.create_task(_marker_then_ack(stream, PROBE_NONCE.pack(ping_count), timeout))
            try:
                start = time.perf_counter()
                await _send_bytes(stream, first, timeout)
                await stream.send(FrameKind.PING, PROBE_NONCE.pack(ping_count), timeout=timeout)
                await _send_bytes(stream, nbytes - first, timeout)
                await stream.send(FrameKind.END, timeout=timeout)
                marker_at, ack_at, acked = await answers
            finally:
                answers.cancel()
            seconds = ack_at - start
            if acked != nbytes:
                raise ProtocolError(f"peer acknowledged {acked} bytes of {nbytes}")
        finally:
            await stream.close()
    whole = nbytes / max(seconds - rtt, seconds * 0.5, 1e-6)
    settled = ack_at - marker_at
    rate = whole
    if settled >= _MIN_SETTLED_S and nbytes - first >= _MIN_SETTLED_BYTES:
        rate = min(max(whole, (nbytes - first) / settled), _MAX_SETTLED_GAIN * whole)
    return LinkSample(bandwidth_bytes_per_s=rate, rtt_s=rtt, nbytes=nbytes, seconds=seconds)


async def _send_bytes(stream: FrameStream, nbytes: int, timeout: float) -> None:
    chunk = bytes(min(PROBE_FRAME_BYTES, max(nbytes, 1)))
    sent = 0
    while sent < nbytes:
        piece = chunk[: min(len(chunk), nbytes - sent)]
        await stream.send(FrameKind.DATA, piece, timeout=timeout)
        sent += len(piece)


async def _marker_then_ack(stream: FrameStream, nonce: bytes, timeout: float) -> tuple[float, float, int]:
    """When the marker PONG arrived, when the ACK did, and what it acknowledged."""
    kind, payload = await stream.recv(max_payload=MAX_PING_PAYLOAD, timeout=timeout)
    if kind is not FrameKind.PONG or payload != nonce:
        raise ProtocolError(f"expected the marker PONG, got {kind.name}")
    marker_at = time.perf_counter()
    kind, payload = await stream.recv(max_payload=PROBE_ACK.size, timeout=timeout)
    ack_at = time.perf_counter()
    if kind is not FrameKind.ACK or len(payload) != PROBE_ACK.size:
        raise ProtocolError(f"expected ACK, got {kind.name}")
    (acked,) = PROBE_ACK.unpack(payload)
    return marker_at, ack_at, acked


def probe_bytes(bandwidth_bytes_per_s: float, rtt_s: float, config: ProbeConfig) -> int:
    """The payload of a probe of a link last seen at this bandwidth and RTT: about
    ``config.target_seconds`` of it, at least ``BDP_PROBES`` bandwidth-delay products, and at
    least ``HIGH_RTT_BYTES`` over a long round trip (a short probe never leaves TCP's
    ramp-up there), within the config's bounds."""
    wanted = bandwidth_bytes_per_s * max(config.target_seconds, BDP_PROBES * rtt_s)
    if rtt_s >= HIGH_RTT_S:
        wanted = max(wanted, HIGH_RTT_BYTES)
    return max(config.min_bytes, min(config.max_bytes, int(wanted)))


def hints_from(links: Iterable[LinkRecord]) -> list[str]:
    """Destinations of neighbours' links, nearest first (bandwidth over RTT): the peers a
    probe round should try first, being likely in the neighbours' cluster."""
    ranked = sorted(links, key=lambda lk: -lk.bandwidth_bytes_per_s / max(lk.rtt_s, _RTT_FLOOR))
    return [lk.dst for lk in ranked]


@dataclass
class _LinkState:
    recent: deque[LinkSample]  # the last ``window`` samples
    measured_at: float
    samples: int

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return max(s.bandwidth_bytes_per_s for s in self.recent)

    @property
    def rtt_s(self) -> float:
        return min(s.rtt_s for s in self.recent)


class LinkEstimator:
    """Link estimates of one measuring peer (best of its last ``window`` samples per link),
    and the choice of what to probe next."""

    def __init__(self, src: str, config: ProbeConfig, *, rng: random.Random | None = None) -> None:
        self.src = src
        self.config = config
        self._links: dict[str, _LinkState] = {}
        self._rng = rng or random.Random()

    def update(self, dst: str, sample: LinkSample, now: float) -> LinkRecord:
        """Adds a sample to the window of ``dst``; returns the record to publish."""
        state = self._links.get(dst)
        if state is None:
            state = _LinkState(deque(maxlen=self.config.window), now, 0)
            self._links[dst] = state
        state.recent.append(sample)
        state.measured_at = now
        state.samples += 1
        self._bound()
        return self._record(dst, state)

    def _bound(self) -> None:
        """Keeps the ``NEAR_LINKS`` fastest links and the most recent of the rest."""
        if len(self._links) <= MAX_LINKS_PER_PEER:
            return
        by_speed = sorted(self._links, key=lambda d: (-self._tie(d), d))
        near = by_speed[:NEAR_LINKS]
        rest = sorted(by_speed[NEAR_LINKS:], key=lambda d: (-self._links[d].measured_at, d))
        keep = set(near) | set(rest[: MAX_LINKS_PER_PEER - NEAR_LINKS])
        self._links = {d: s for d, s in self._links.items() if d in keep}

    def fastest(self, count: int) -> list[str]:
        """The ``count`` peers this peer measured fastest links to."""
        return sorted(self._links, key=lambda d: (-self._tie(d), d))[:count]

    def _tie(self, dst: str) -> float:
        """How close ``dst`` is: bandwidth over RTT (a fast, near peer is likely in this
        peer's cluster; latency tells sites apart even behind a slow access link)."""
        state = self._links[dst]
        return state.bandwidth_bytes_per_s / max(state.rtt_s, _RTT_FLOOR)

    def _record(self, dst: str, state: _LinkState) -> LinkRecord:
        best = max(state.recent, key=lambda s: s.bandwidth_bytes_per_s)
        return LinkRecord(
            src=self.src,
            dst=dst,
            bandwidth_bytes_per_s=best.bandwidth_bytes_per_s,
            rtt_s=state.rtt_s,
            measured_at=state.measured_at,
            samples=state.samples,
            probe_bytes=best.nbytes,
        )

    def records(self, now: float, max_age: float) -> list[LinkRecord]:
        """Records of links measured within ``max_age`` seconds, to republish: the freshest
        ``MAX_LINKS_PER_PEER`` (what the directory holds of one peer)."""
        fresh = [(s.measured_at, dst) for dst, s in self._links.items() if now - s.measured_at <= max_age]
        fresh.sort(key=lambda item: (-item[0], item[1]))
        return [self._record(dst, self._links[dst]) for _, dst in fresh[:MAX_LINKS_PER_PEER]]

    def known_peers(self) -> set[str]:
        """Peers this estimator holds a measurement of."""
        return set(self._links)

    def forget(self, peers: Iterable[str]) -> None:
        """Drops estimates of peers that left."""
        for peer in peers:
            self._links.pop(peer, None)

    def next_probe_bytes(self, dst: str) -> int:
        """Payload for the next probe of ``dst`` (``probe_bytes`` of its estimate)."""
        state = self._links.get(dst)
        if state is None:
            return self.config.initial_bytes
        return probe_bytes(state.bandwidth_bytes_per_s, state.rtt_s, self.config)

    def probe_interval(self, *, busy: bool) -> float:
        """Seconds until the next probe round: longer while the peer is busy training."""
        return self.config.period * (self.config.busy_slowdown if busy else 1.0)

    def choose_targets(self, candidates: Iterable[str], now: float, hints: Iterable[str] = ()) -> list[str]:
        """Up to ``fanout`` peers to probe. While it holds fewer than ``MAX_LINKS_PER_PEER``
        links: peers never measured, ``hints`` first (in their order) and one at random.
        Then one exploration per round (a hint with probability ``HINT_SHARE``, else a
        random peer), and the stalest of its links (measured at least half a period ago)."""
        pool = [c for c in dict.fromkeys(candidates) if c != self.src]
        wanted = self.config.fanout
        unknown = [p for p in pool if p not in self._links]
        fresh = set(unknown)
        hinted = [h for h in dict.fromkeys(hints) if h in fresh]
        hinted_set = set(hinted)
        unknown = [p for p in self._rng.sample(unknown, min(len(unknown), 2 * wanted)) if p not in hinted_set]
        if len(self._links) < MAX_LINKS_PER_PEER:  # filling up: hints, and one random peer
            chosen = [*hinted[: wanted - 1], *unknown][:wanted]
        elif hinted and self._rng.random() < HINT_SHARE:
            chosen = hinted[:1]
        else:
            chosen = unknown[:1]
        explore = [*hinted, *unknown]
        due = sorted(
            (
                p
                for p in pool
                if p in self._links and now - self._links[p].measured_at >= self.config.period * 0.5
            ),
            key=lambda p: self._links[p].measured_at,
        )
        chosen += due[: self.config.fanout - len(chosen)]
        chosen += [p for p in explore if p not in chosen][: self.config.fanout - len(chosen)]
        return chosen
