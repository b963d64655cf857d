"""An iteration played out: the runtime's 1F1B schedule over a plan's peers and links.

``estimate`` bounds an iteration by ``L + (n_b - 1) * B`` (critical path plus the busiest
resource), which assumes the busiest resource never waits once the pipeline is full. It
does wait when one micro-batch's path crosses the same resource several times with other
work in between (equal-number plans crossing one slow site link four times, say): the
bound then runs low by 1.3x and more. ``simulate`` replays what the runtime does
(``runtime.compute``): every peer computes one task at a time; stage k admits the forward
of micro-batch m only when fewer than ``in_flight[k]`` micro-batches hold activations
there, and a forward held for that runs as soon as the backward that admits it ends;
otherwise a backward goes before any forward, and arrival order decides. Each directed
link resource (``Topology.link_resource``) carries one transfer at a time, in arrival order,
for the transfer's bytes over its bandwidth; the link's latency is not occupancy: a
transfer arrives that long after it left the link, and the next one may already be on the
wire: a stream keeps up to ``window`` messages in flight (``records.limits.MAX_UNACKED``),
so a transfer waits for the acknowledgement of the one ``window`` before it, which comes
back one latency after that one arrived. Pure: numbers in, seconds out.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from fusionp2p.records.limits import MAX_UNACKED

__all__ = ["Hop", "simulate"]


@dataclass(frozen=True)
class Hop:
    """Traffic from stage ``src`` to stage ``dst`` (``src < dst``) per micro-batch: the
    seconds each way occupies its link (bytes over bandwidth), the resource each direction
    occupies (``None``: the two stages share a peer, the hop is free), and each direction's
    one-way latency (a transfer arrives that long after its occupancy ends)."""

    src: int
    dst: int
    fwd_s: float
    bwd_s: float
    fwd_resource: Hashable | None
    bwd_resource: Hashable | None
    fwd_latency_s: float = 0.0
    bwd_latency_s: float = 0.0


# a stage's forward / backward; a hop's forward / gradient on its link, then arriving at its
# end, then its acknowledgement back at the sender
_FWD, _BWD, _SEND, _RETURN, _SENT, _RETURNED, _SENT_ACKED, _RETURNED_ACKED = range(8)


def simulate(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    peers: Sequence[Hashable],
    hops: Sequence[Hop],
    n_micro_batches: int,
    in_flight: Sequence[int],
    window: int = MAX_UNACKED,
) -> float:
    """Seconds from the first forward to the last backward of ``n_micro_batches``, stage k
    running on ``peers[k]`` for ``fwd_s[k]`` / ``bwd_s[k]`` per micro-batch, each remote
    hop's stream keeping at most ``window`` transfers unacknowledged each way."""
    n = len(peers)
    into: list[list[int]] = [[] for _ in range(n)]  # hops whose activations stage k reads
    out: list[list[int]] = [[] for _ in range(n)]  # hops whose gradients stage k waits for
    for h, hop in enumerate(hops):
        into[hop.dst].append(h)
        out[hop.src].append(h)

    def resource(kind: int, index: int) -> Hashable | None:
        if kind in (_FWD, _BWD):
            return ("peer", peers[index])
        hop = hops[index]
        return hop.fwd_resource if kind == _SEND else hop.bwd_resource

    durations = (fwd_s, bwd_s, [h.fwd_s for h in hops], [h.bwd_s for h in hops])  # by task kind

    waiting: dict[tuple[int, int, int], int] = {}  # task -> unmet inputs
    for m in range(n_micro_batches):
        for k in range(n):
            gate = 1 if m >= in_flight[k] else 0
            waiting[_FWD, k, m] = len(into[k]) + gate
            waiting[_BWD, k, m] = 1 + len(out[k])
        for h, hop in enumerate(hops):
            windowed = m >= window and hop.fwd_resource is not None  # a stream, not one peer
            waiting[_SEND, h, m] = 1 + windowed
            waiting[_RETURN, h, m] = 1 + windowed
    queues: dict[Hashable, list[tuple[int, float, int, int, int]]] = {}
    busy_until: dict[Hashable, float] = {}
    events: list[tuple[float, int, int, int]] = []  # (finish, kind, index, micro-batch)
    order = 0

    def ready(kind: int, index: int, m: int, now: float, *, held: bool = False) -> None:
        nonlocal order
        res = resource(kind, index)
        if res is None:  # a hop between two stages of one peer
            heapq.heappush(events, (now, kind, index, m))
            return
        # a held forward its window just admitted, then backward before forward, then arrival
        first = -1 if held else 0 if kind in (_BWD, _RETURN) else 1
        order += 1
        heapq.heappush(queues.setdefault(res, []), (first, now, order, kind, index * n_micro_batches + m))

    def release(task: tuple[int, int, int], now: float, *, gate: bool = False) -> None:
        waiting[task] -= 1
        if waiting[task] == 0:
            ready(*task, now, held=gate)

    def start_free(now: float) -> None:
        for res, queue in queues.items():
            if queue and busy_until.get(res, 0.0) <= now:
                _, _, _, kind, code = heapq.heappop(queue)
                index, m = divmod(code, n_micro_batches)
                busy_until[res] = now + durations[kind][index]
                heapq.heappush(events, (busy_until[res], kind, index, m))

    for k in range(n):
        for m in range(n_micro_batches):
            if waiting[_FWD, k, m] == 0:
                ready(_FWD, k, m, 0.0)
    start_free(0.0)
    end = 0.0
    while events:
        now, kind, index, m = heapq.heappop(events)
        end = max(end, now)
        if kind == _FWD:
            for h in out[index]:
                release((_SEND, h, m), now)
            release((_BWD, index, m), now)
        elif kind == _SEND:
            heapq.heappush(events, (now + hops[index].fwd_latency_s, _SENT, index, m))
        elif kind == _SENT:
            release((_FWD, hops[index].dst, m), now)
            if hops[index].fwd_resource is not None and m + window < n_micro_batches:
                heapq.heappush(events, (now + hops[index].bwd_latency_s, _SENT_ACKED, index, m))
        elif kind == _SENT_ACKED:
            release((_SEND, index, m + window), now)
        elif kind == _RETURNED_ACKED:
            release((_RETURN, index, m + window), now)
        elif kind == _BWD:
            for h in into[index]:
                release((_RETURN, h, m), now)
            if m + in_flight[index] < n_micro_batches:
                release((_FWD, index, m + in_flight[index]), now, gate=True)
        elif kind == _RETURN:
            heapq.heappush(events, (now + hops[index].bwd_latency_s, _RETURNED, index, m))
        else:  # _RETURNED
            release((_BWD, hops[index].src, m), now)
            if hops[index].fwd_resource is not None and m + window < n_micro_batches:
                heapq.heappush(events, (now + hops[index].fwd_latency_s, _RETURNED_ACKED, index, m))
        start_free(now)
    unfinished = [task for task, left in waiting.items() if left > 0]
    if unfinished:
        raise ValueError(
            f"the schedule cannot finish: {len(unfinished)} task(s) wait forever, e.g. {unfinished[0]}"
        )
    return end
