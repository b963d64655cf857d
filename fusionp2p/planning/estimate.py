"""Iteration-time and memory estimates of a partition (FusionLLM §3.6).

A partition is a list of ``Stage`` s (a peer and the OP-DAG positions it runs). Per
micro-batch, stage s computes for ``flops / speed``; each pair of stages with traffic has a
forward link (activations) and a backward link (gradients), each ``alpha + wire / bw`` in
its own direction; a compressed link also costs Top-K coding time on both of its peers,
on their devices and on the forward path. Resources are peers (their stages share one
device) and directed links: a peer pair's own inside a site, one shared link per direction
between two sites (``Topology.link_resource``). A link's latency is on the path, not its
occupancy: a transfer holds its link for ``wire / bw``, and the next may start while the
last is still in flight (issue 39: pricing ``alpha`` as busy time made a 40 ms path cost
2-12x its latency at 1-16 micro-batches). With ``L`` the forward plus backward critical
path and ``B`` the busiest resource:

    sequential (one micro-batch at a time):  n_b * L + C
    pipelined  (n_b micro-batches in flight): L + (n_b - 1) * B + C
    scheduled  (what a step is expected to take): the runtime's 1F1B schedule played out
               over these resources (``planning.schedule``), + C

``C`` is the step's control round trip: when the OP-DAG ends in the data owner's loss (a
pinned last node, ``planning.owner``), the peer that runs it sends every other peer of
the plan the optimizer step once its last backward is done and waits for each reply, one
round trip to the farthest of them per iteration.

Plans are chosen by the pipelined form (``iteration_s``: the paper's, cheap and in closed
form, which the exact solver vectorizes); a plan's reported estimate is the scheduled one
(``expected_s``), which also sees a resource wait between two of its uses within a step
or stay busy where the closed form counts the critical path on top of the busiest resource.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import (
    CostConfig,
    adaptive_ratios,
    planned_budgets,
    planned_ratios,
    stage_in_flight,
)
from fusionp2p.planning.schedule import Hop, simulate
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = [
    "Estimate",
    "Estimated",
    "LinkEstimate",
    "Stage",
    "estimate",
    "estimate_segments",
    "shared_bandwidth",
    "step_round_trip",
]


@dataclass(frozen=True)
class Stage:
    """A sub-DAG and its owner: ``nodes`` are positions in the OP-DAG's topological order."""

    peer: int  # index into the Topology
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class LinkEstimate:
    """Traffic between two stages, per micro-batch."""

    src: int  # stage index
    dst: int
    dense_bytes: float
    ratio: float
    wire_bytes: float
    fwd_s: float  # activations src -> dst: one-way latency + wire bytes / bandwidth
    bwd_s: float  # gradients dst -> src, the same
    codec_s: float = 0.0  # Top-K coding on both peers, both directions (0 when dense)
    fwd_latency_s: float = 0.0  # of fwd_s, the one-way latency: path time, not link occupancy
    bwd_latency_s: float = 0.0

    @property
    def fwd_busy_s(self) -> float:
        """Seconds the forward transfer occupies its link (latency overlaps in flight)."""
        return self.fwd_s - self.fwd_latency_s

    @property
    def bwd_busy_s(self) -> float:
        """Seconds the gradient transfer occupies its link."""
        return self.bwd_s - self.bwd_latency_s


@dataclass(frozen=True)
class Estimate:
    """What a partition is expected to cost."""

    sequential_s: float
    pipelined_s: float  # critical path + (n_b - 1) x the busiest resource
    bottleneck_s: float
    critical_path_s: float
    compute_s: tuple[float, ...]  # per stage, forward + backward, per micro-batch
    codec_s: tuple[float, ...]  # per stage, Top-K coding of its compressed links, per micro-batch
    links: tuple[LinkEstimate, ...]
    memory_bytes: tuple[float, ...]  # per stage
    fits: bool  # every peer's stages fit its memory
    control_s: float = 0.0  # per iteration: the data owner's step round trip to its farthest peer
    play: Callable[[], float] | None = field(default=None, repr=False, compare=False)  # -> scheduled_s

    @property
    def iteration_s(self) -> float:
        """The pipelined iteration time, or inf when the partition does not fit in memory:
        what planners rank partitions by."""
        return self.pipelined_s if self.fits else float("inf")

    @functools.cached_property
    def scheduled_s(self) -> float:
        """The runtime's 1F1B schedule played out (``planning.schedule``); run on first
        use, since planners' searches make many estimates and rank by ``iteration_s``."""
        return self.play() + self.control_s if self.play is not None else self.pipelined_s

    @property
    def expected_s(self) -> float:
        """The scheduled iteration time, or inf when the partition does not fit in memory:
        what a step of this plan is expected to take."""
        return self.scheduled_s if self.fits else float("inf")


class Estimated:
    """What carries an ``estimate`` (a plan, a re-estimate): its times, read through."""

    estimate: Estimate

    @property
    def iteration_s(self) -> float:
        """What the partition was chosen by (``Estimate.iteration_s``)."""
        return self.estimate.iteration_s

    @property
    def expected_s(self) -> float:
        """What a step is expected to take (``Estimate.expected_s``)."""
        return self.estimate.expected_s


def _critical_path(fwd: np.ndarray, bwd: np.ndarray, hops: Sequence[tuple[int, int, float, float]]) -> float:
    """Forward plus backward critical path of stages in topological order; ``hops`` are
    (src stage, dst stage, forward seconds, backward seconds)."""
    finish_f = np.zeros(len(fwd))
    for k in range(len(fwd)):
        start = max((finish_f[a] + f for a, b, f, _ in hops if b == k), default=0.0)
        finish_f[k] = start + fwd[k]
    finish_b = np.zeros(len(bwd))
    for k in reversed(range(len(bwd))):
        start = max((finish_b[b] + g for a, b, _, g in hops if a == k), default=0.0)
        finish_b[k] = start + bwd[k]
    return float(finish_f.max() + finish_b.max())


def shared_bandwidth(topo: Topology, links: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per link ``(src peer, dst peer)``: the slower direction's bandwidth divided by how
    many of these links' transfers (activations one way, gradients back) share its link."""
    uses: dict[tuple[str, int, int], int] = {}
    for a, b in links:
        for key in (topo.link_resource(a, b), topo.link_resource(b, a)):
            uses[key] = uses.get(key, 0) + 1
    return np.array(
        [
            min(
                topo.bandwidth[a, b] / uses[topo.link_resource(a, b)],
                topo.bandwidth[b, a] / uses[topo.link_resource(b, a)],
            )
            for a, b in links
        ],
        dtype=float,
    )


def step_round_trip(dag: OpDag, topo: Topology, stages: Sequence[Stage]) -> float:
    """The step's control round trip (the module's ``C``): from the peer that runs the
    data owner's loss (a pinned last node) to the farthest other peer of ``stages`` and
    back; 0 when the OP-DAG does not end in one."""
    last = len(dag) - 1
    if not dag.nodes[last].pinned:
        return 0.0
    owner = next((s.peer for s in stages if last in s.nodes), None)
    others = {s.peer for s in stages} - {owner}
    if owner is None or not others:
        return 0.0
    return max(float(topo.latency[owner, p] + topo.latency[p, owner]) for p in others)


def estimate(
    dag: OpDag,
    topo: Topology,
    stages: Sequence[Stage],
    cost: CostConfig,
    ratios: dict[tuple[int, int], float] | None = None,
) -> Estimate:
    """Estimates a partition; ``ratios`` default to the cost config's compression policy.

    Raises:
        PlanningError: a node assigned twice or never, or stages whose traffic forms a cycle.
    """
    owner = np.full(len(dag), -1)
    for k, stage in enumerate(stages):
        for pos in stage.nodes:
            if owner[pos] != -1:
                raise PlanningError(f"node {dag.nodes[pos].id!r} is assigned to two stages")
            owner[pos] = k
    if np.any(owner < 0):
        raise PlanningError(
            f"nodes without a stage: {[dag.nodes[i].id for i in np.flatnonzero(owner < 0)][:5]}"
        )
    traffic = dag.traffic(owner)
    for a, b in traffic:
        if a > b:
            raise PlanningError(f"stage {a} sends to earlier stage {b}: order stages topologically")

    n_b = cost.n_micro_batches
    peers = [s.peer for s in stages]
    speed = topo.speed[peers]
    fwd = dag.stage_sums(owner, len(stages), "fwd_flops") / speed
    bwd = dag.stage_sums(owner, len(stages), "bwd_flops") / speed

    pairs = sorted(traffic)
    remote = [(a, b) for a, b in pairs if peers[a] != peers[b]]
    dense_t = np.array(
        [
            topo.latency[peers[a], peers[b]] + traffic[a, b] / topo.bandwidth[peers[a], peers[b]]
            for a, b in remote
        ]
    )
    compute: dict[object, float] = {}  # per peer: forward + backward seconds per micro-batch
    for k, p in enumerate(peers):
        compute[p] = compute.get(p, 0.0) + fwd[k] + bwd[k]
    if ratios is None and cost.compression.kind == "planned":
        budget = max(compute.values(), default=0.0)
        slow_bw = shared_bandwidth(topo, [(peers[a], peers[b]) for a, b in remote])
        slow_lat = np.array(
            [max(topo.latency[peers[a], peers[b]], topo.latency[peers[b], peers[a]]) for a, b in remote]
        )
        at_latency = [
            (a, b, topo.latency[peers[a], peers[b]], topo.latency[peers[b], peers[a]]) for a, b in remote
        ]
        fastest = _critical_path(fwd, bwd, at_latency) + (n_b - 1) * budget
        codec = np.array([topo.link_codec(peers[a], peers[b]) for a, b in remote]).reshape(-1, 2)
        planned = planned_ratios(
            np.array([traffic[ab] for ab in remote], dtype=float),
            slow_bw,
            slow_lat,
            planned_budgets(slow_lat, budget, fastest, len(remote), cost.compression),
            cost.compression,
            cost.wire,
            (codec[:, 0], codec[:, 1]),
        )
        ratios = dict(zip(remote, np.atleast_1d(planned).tolist(), strict=True))
    if ratios is None:
        ratios = dict(zip(remote, adaptive_ratios(dense_t, cost.compression).tolist(), strict=True))
    links = []
    coding = np.zeros(len(stages))
    for a, b in pairs:
        pa, pb = peers[a], peers[b]
        if pa == pb:
            links.append(LinkEstimate(a, b, traffic[a, b], 1.0, 0.0, 0.0, 0.0))
            continue
        r = float(ratios.get((a, b), 1.0))
        wire = float(cost.wire.wire_bytes(traffic[a, b], r))
        numel = traffic[a, b] / cost.wire.dense_value_bytes
        send, recv = (float(t) for t in topo.coding_s(pa, pb, numel, r))
        coding[a] += send
        coding[b] += recv
        links.append(
            LinkEstimate(
                a,
                b,
                traffic[a, b],
                r,
                wire,
                topo.latency[pa, pb] + wire / topo.bandwidth[pa, pb],
                topo.latency[pb, pa] + wire / topo.bandwidth[pb, pa],
                send + recv,
                float(topo.latency[pa, pb]),
                float(topo.latency[pb, pa]),
            )
        )

    critical = _critical_path(fwd, bwd, [(lk.src, lk.dst, lk.fwd_s + lk.codec_s, lk.bwd_s) for lk in links])

    busy: dict[object, float] = {**compute}  # peers, then links (Topology.link_resource)
    for k, p in enumerate(peers):
        busy[p] += coding[k]
    for lk in links:
        pa, pb = peers[lk.src], peers[lk.dst]
        if pa != pb:
            for key, seconds in (
                (topo.link_resource(pa, pb), lk.fwd_busy_s),
                (topo.link_resource(pb, pa), lk.bwd_busy_s),
            ):
                busy[key] = busy.get(key, 0.0) + seconds
    bottleneck = max(busy.values())

    in_flight = stage_in_flight(n_b, peers)
    control = step_round_trip(dag, topo, stages)
    params = dag.stage_sums(owner, len(stages), "param_bytes")
    saved = dag.stage_sums(owner, len(stages), "saved_bytes")
    memory = [
        cost.param_multiplier * float(p) + held * float(s)
        for p, s, held in zip(params, saved, in_flight, strict=True)
    ]
    per_peer: dict[int, float] = {}
    for k, p in enumerate(peers):
        per_peer[p] = per_peer.get(p, 0.0) + memory[k]
    fits = all(used <= cost.memory_headroom * topo.memory[p] for p, used in per_peer.items())

    def play() -> float:  # the runtime's schedule, run only where a plan's estimate is read
        def resource(a: int, b: int) -> Hashable | None:
            return topo.link_resource(peers[a], peers[b]) if peers[a] != peers[b] else None

        hops = [
            Hop(
                lk.src,
                lk.dst,
                lk.fwd_busy_s,
                lk.bwd_busy_s,
                resource(lk.src, lk.dst),
                resource(lk.dst, lk.src),
                lk.fwd_latency_s,
                lk.bwd_latency_s,
            )
            for lk in links
        ]
        return simulate((fwd + coding).tolist(), bwd.tolist(), peers, hops, n_b, in_flight)

    return Estimate(
        sequential_s=n_b * critical + control,
        pipelined_s=critical + (n_b - 1) * bottleneck + control,
        bottleneck_s=float(bottleneck),
        critical_path_s=critical,
        compute_s=tuple((fwd + bwd).tolist()),
        codec_s=tuple(coding.tolist()),
        links=tuple(links),
        memory_bytes=tuple(float(m) for m in memory),
        fits=fits,
        control_s=control,
        play=play,
    )


def estimate_segments(
    dag: OpDag,
    topo: Topology,
    segments: Sequence[tuple[str, Sequence[str]]],
    cost: CostConfig,
    ratios: dict[tuple[str, str], float] | None = None,
) -> Estimate:
    """The estimate of what a runtime actually runs: ``segments`` are (peer id, OP-DAG node
    ids) in an order where data only flows forward (a partition's segments by wave), several
    per peer where a peer runs non-contiguous parts; ``ratios[(src, dst)]`` by peer id
    (links not named are dense, as the runtime sends them).

    Raises:
        PlanningError: a peer or node the topology or OP-DAG does not know.
    """
    peer_index = {p: i for i, p in enumerate(topo.peer_ids)}
    stages = []
    for peer, nodes in segments:
        if peer not in peer_index:
            raise PlanningError(f"peer {peer[-8:]} is not in the topology")
        unknown = [n for n in nodes if n not in dag.index]
        if unknown:
            raise PlanningError(f"nodes {unknown[:3]} are not in the OP-DAG")
        stages.append(Stage(peer_index[peer], tuple(dag.index[n] for n in nodes)))
    peers = [p for p, _ in segments]
    by_stage = {  # what the runtime sends: the given ratios, dense elsewhere
        (a, b): (ratios or {}).get((peers[a], peers[b]), 1.0)
        for a in range(len(segments))
        for b in range(len(segments))
        if peers[a] != peers[b]
    }
    return estimate(dag, topo, stages, cost, by_stage)
