"""OP-Fence's search over one order of peers: a dynamic program over contiguous cuts.

Given a peer sequence (``opfence.py`` chooses the orders), the DP runs over contiguous
cuts of the OP-DAG's topological order where any peer may be left out, from the end of
the OP-DAG so it knows each stage's depth (the micro-batches it holds under 1F1B). It
first finds the smallest possible bottleneck B*, then, for a few caps c >= B*, the
smallest critical path with every resource under c; each result is estimated exactly
and the best pipelined iteration time wins.

With a data owner (``owner.OwnerFrame``) the sequence starts with a slot of the data
owner's over its head and ends with one over its tail; the other slots place the middle.
So the DP prices the links from and to the data owner like every other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.chain import ChainCosts
from fusionp2p.planning.cost import CostConfig, planned_budgets, planned_ratios
from fusionp2p.planning.estimate import Estimate, Stage, estimate
from fusionp2p.planning.owner import OwnerFrame
from fusionp2p.planning.topology import Topology

__all__ = ["contiguous_stages", "search_sequence"]

_CAP_FACTORS = (1.0, 1.15, 1.5, 2.5, math.inf)


def contiguous_stages(assignment: Sequence[tuple[int, int, int]]) -> list[Stage]:
    """Stages from (peer, start, end) triples over the topological order."""
    return [Stage(peer, tuple(range(s, e))) for peer, s, e in assignment]


def _positions(ch: ChainCosts, max_positions: int) -> np.ndarray:
    """Cut positions the DP may use: all, or quantiles of the work for a very long OP-DAG."""
    if ch.n <= max_positions:
        return np.arange(ch.n + 1)
    work = ch.flops_fwd + ch.flops_bwd
    targets = np.linspace(0, work[-1], max_positions + 1)
    pos = np.unique(np.clip(np.searchsorted(work, targets), 0, ch.n))
    return np.union1d(pos, [0, ch.n])


def _followers(depth: int) -> tuple[np.ndarray, np.ndarray]:
    """For each depth d, the depths a stage after a depth-d stage may have (at most two,
    ``-1`` for none): stage k holds ``min(d_next + 1, depth - 1)``, so d follows d - 1, and
    the last depth (that many or more) follows itself too."""
    first, second = np.full(depth, -1), np.full(depth, -1)
    for d in range(depth):
        dns = [dn for dn in range(depth) if min(dn + 1, depth - 1) == d]
        first[d], second[d] = ([*dns, -1, -1])[:2]
    return first, second


Triples = list[tuple[int, int, int]]


def _dp_caps(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, caps: Sequence[float] | None
) -> list[tuple[float, Triples]]:
    """One DP pass over K cut positions and m sequence slots, from the end of the OP-DAG,
    for each of ``caps`` at once (``None``: one pass that minimizes the bottleneck).

    ``stage[d, j, s, e]``: seconds of slot j covering positions s..e (indices into the cut
    positions) while it holds the activations of d + 1 micro-batches (inf where that does
    not fit; the last depth stands for that many or more); ``link_*[l, j, s]``: link l -> j
    at position s. Stage k of S holds ``min(n_b, S - k)`` micro-batches (``cost.in_flight``),
    the number of stages from it to the end, so the DP runs over suffixes and knows that
    depth exactly. With a cap, the DP minimizes the critical path with every element <= cap.
    Returns, per cap, the value and (slot, s, e) triples.

    A stage of slot j over [s, e) followed by slot l from e costs ``stage[d, j, s, e]``
    combined with ``via[d, j, e]``, the best over l of the link j -> l at e combined with
    l's value from e. ``via`` does not depend on s, so it is made once per position, as
    soon as the values from that position are known: m^2 work per position, not per pair
    of positions. Ties go to the first follower depth, then the lowest slot, then the
    earliest cut, as a search over every (l, e) in that order would pick: each choice is
    kept as one key, ``(follower * m + l) * K + e``, so one ``min`` both picks and breaks
    ties. Everything the loop reads is laid out per position beforehand (the caps, and
    the rule that a follower's slot comes later), so each step is a few whole-array ops.
    """
    depth, m, k1, _ = stage.shape
    last = k1 - 1
    bottleneck = caps is None
    n_caps = 1 if caps is None else len(caps)
    cap = np.full(1, np.inf) if caps is None else np.asarray(caps, dtype=float)
    later = np.triu(np.ones((m, m), dtype=bool), 1)  # [j, l]: slot l comes after slot j
    by_cut = link_max.transpose(2, 0, 1)  # [e, j, l]
    if bottleneck:  # [c, e, j, 1, l]: what the link j -> l at e adds to l's value
        hop = np.where(later, by_cut, np.inf)[None, :, :, None]
    else:
        allowed = later & (by_cut[None] <= cap[:, None, None, None])
        hop = np.where(allowed, link_fill.transpose(2, 0, 1)[None], np.inf)[:, :, :, None]
    by_start = np.ascontiguousarray(stage.transpose(2, 3, 0, 1))  # [s, e, d, j]
    cap_of = cap[:, None, None, None]
    rows = np.arange(n_caps * depth * m)
    value = np.full((n_caps, k1, depth + 1, m), np.inf)  # [c, s, d, j]: positions s.., first stage on j
    # (depth row ``depth``: no stage, for a follower depth that does not exist)
    back = np.full((n_caps, k1, depth, m), -1, dtype=np.int64)  # the key of the next stage, -1: none
    via = np.full((n_caps, k1, depth, m), np.inf)  # [c, e, d, j]: the best continuation from cut e
    via_key = np.zeros((n_caps, k1, depth, m), dtype=np.int64)  # its key
    first, second = _followers(depth)
    dn_of = np.where(np.stack([first, second]) >= 0, np.stack([first, second]), depth)  # [which, d]
    follower_depth = dn_of.T  # [d, which]
    none_key = 2 * m * k1
    alone = stage[0, :, :, last].T  # [s, j]: the last stage holds one micro-batch
    alone = np.where(alone[None] <= cap[:, None, None], alone[None], np.inf)  # [c, s, j]

    for s in range(last - 1, -1, -1):
        here = value[:, s]
        here[:, 0] = alone[:, s]
        if s + 1 < last and m >= 2:
            cont = via[:, s + 1 : last]  # [c, e, d, j]
            st = by_start[s, s + 1 : last][None]
            cand = np.maximum(cont, st) if bottleneck else np.where(st <= cap_of, cont + st, np.inf)
            found = cand.min(axis=1)  # [c, d, j]
            key = np.where(cand == found[:, None], via_key[:, s + 1 : last], none_key).min(axis=1)
            better = found < here[:, :depth]
            here[:, :depth] = np.where(better, found, here[:, :depth])
            back[:, s] = np.where(better, key, -1)
        # via[:, s]: the best over (follower depth, slot l) from the values at s
        prev = here[:, follower_depth][:, :, None]  # [c, d, 1, which, l]
        hops = hop[:, s][:, None]  # [c, 1, j, 1, l]
        cand = (np.maximum(prev, hops) if bottleneck else prev + hops).reshape(rows.size, 2 * m)
        rank = cand.argmin(axis=1)  # the first follower, then the lowest slot
        via[:, s] = cand[rows, rank].reshape(n_caps, depth, m)
        via_key[:, s] = (rank * k1 + s).reshape(n_caps, depth, m)
    return [_walk(value[c, :, :depth], back[c], dn_of, last) for c in range(n_caps)]


def _walk(value: np.ndarray, back: np.ndarray, dn_of: np.ndarray, last: int) -> tuple[float, Triples]:
    """The best value from position 0 and its stages, followed through ``back`` (keys, as
    ``_dp_caps`` makes them)."""
    k1, depth, m = value.shape
    d, j = (int(x) for x in np.unravel_index(int(np.argmin(value[0])), (depth, m)))
    total = float(value[0, d, j])
    if not math.isfinite(total):
        return total, []
    out, s = [], 0
    while True:
        key = int(back[s, d, j])
        if key < 0:
            out.append((j, s, last))
            return total, out
        rank, e = divmod(key, k1)
        which, nxt = divmod(rank, m)
        out.append((j, s, e))
        j, s, d = nxt, e, int(dn_of[which, d])


def _dp(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, cap: float | None
) -> tuple[float, Triples]:
    """``_dp_caps`` for one cap (``None``: the smallest bottleneck)."""
    return _dp_caps(stage, link_fill, link_max, None if cap is None else [cap])[0]


def _fits(stage: np.ndarray, triples: Triples) -> bool:
    """Whether every stage of ``triples`` fits while holding its true number of micro-batches."""
    n, depth = len(triples), stage.shape[0]
    return all(np.isfinite(stage[min(n - k, depth) - 1, j, s, e]) for k, (j, s, e) in enumerate(triples))


def _dp_depths_caps(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, caps: Sequence[float] | None
) -> list[tuple[float, Triples]]:
    """``_dp_caps`` with every stage's in-flight depth, computed cheaply when memory is
    loose: first as if every stage held one micro-batch (a relaxation: its optimum is a
    lower bound); where that optimum fits with its true depths it is the optimum, else the
    DP runs again over every depth, for those caps only."""
    results = _dp_caps(stage[:1], link_fill, link_max, caps)
    if stage.shape[0] == 1:
        return results
    again = [i for i, (_, triples) in enumerate(results) if triples and not _fits(stage, triples)]
    if again:
        redone = _dp_caps(stage, link_fill, link_max, None if caps is None else [caps[i] for i in again])
        for i, result in zip(again, redone, strict=True):
            results[i] = result
    return results


def _dp_depths(
    stage: np.ndarray, link_fill: np.ndarray, link_max: np.ndarray, cap: float | None
) -> tuple[float, Triples]:
    """``_dp_depths_caps`` for one cap (``None``: the smallest bottleneck)."""
    return _dp_depths_caps(stage, link_fill, link_max, None if cap is None else [cap])[0]


def _framed(
    frame: OwnerFrame | None, seq: Sequence[int], pos: np.ndarray, n: int
) -> tuple[list[int], np.ndarray, slice]:
    """The DP's slots (the data owner's head and tail around ``seq``), its cut positions
    (with the head's and the tail's), and which slots are ``seq``'s."""
    if frame is None:
        return list(seq), pos, slice(0, len(seq))
    part = frame.part
    head, tail = [frame.owner] * (part.head > 0), [frame.owner] * (part.tail < n)
    slots = [*head, *seq, *tail]
    return slots, np.union1d(pos, [part.head, part.tail]), slice(len(head), len(head) + len(seq))


def _pin(stage: np.ndarray, frame: OwnerFrame | None, pos: np.ndarray, inner: slice) -> np.ndarray:
    """``stage`` with the data owner's slots over exactly its head and tail, and the
    other slots inside the middle (inf elsewhere)."""
    if frame is None:
        return stage
    part = frame.part
    h, t = int(np.searchsorted(pos, part.head)), int(np.searchsorted(pos, part.tail))
    out = np.full_like(stage, np.inf)
    out[:, inner, h : t + 1, h : t + 1] = stage[:, inner, h : t + 1, h : t + 1]
    if inner.start:  # the head's slot
        out[:, 0, 0, h] = stage[:, 0, 0, h]
    if inner.stop < stage.shape[1]:  # the tail's slot
        out[:, -1, t, -1] = stage[:, -1, t, -1]
    return out


def _stage_depths(ch: ChainCosts, seq: Sequence[int], n_micro_batches: int, pos: np.ndarray) -> np.ndarray:
    """``[d, j, s, e]``: each slot's stage matrices holding 1, 2, ... micro-batches, up to
    the first depth from which memory no longer makes a difference."""
    most = max(1, min(n_micro_batches, len(seq)))
    mats = [np.stack([ch.stage_matrix(p, held, pos) for p in seq]) for held in range(1, most + 1)]
    used = most
    while used > 1 and np.array_equal(mats[used - 2], mats[-1]):
        used -= 1
    return np.stack(mats[:used])


def search_sequence(
    dag: OpDag,
    topo: Topology,
    cost: CostConfig,
    seq: Sequence[int],
    *,
    max_positions: int = 64,
    ch: ChainCosts | None = None,
    passes: int = 2,
    cap_factors: Sequence[float] = _CAP_FACTORS,
    frame: OwnerFrame | None = None,
) -> tuple[Estimate, list[Stage]] | None:
    """The best contiguous plan over the peer sequence ``seq`` (peers may be skipped),
    framed by the data owner's stages where ``frame`` gives them."""
    ch = ch or ChainCosts(dag, topo, cost)
    seq, pos, inner = _framed(frame, seq, _positions(ch, max_positions), ch.n)
    policy = cost.compression
    best: tuple[Estimate, list[Stage]] | None = None
    t_ref: float | None = None
    budget: float | None = None
    fastest, n_links = 0.0, 1
    stage = _pin(_stage_depths(ch, seq, cost.n_micro_batches, pos), frame, pos, inner)
    pairs = ch.slot_pairs(seq)
    for _ in range(passes):  # later passes: adaptive reference and planned budget from the previous
        ratio: np.ndarray | float
        if policy.kind == "none":
            ratio = 1.0
        elif policy.kind == "planned" and budget is None:  # first pass: the most it may compress
            ratio = policy.max_ratio
        elif policy.kind == "planned" and budget is not None:
            bw = np.minimum(pairs.bandwidth, pairs.bandwidth_back)
            lat = np.maximum(pairs.latency, pairs.latency_back)
            link_budget = planned_budgets(lat, budget, fastest, n_links, policy)
            with np.errstate(divide="ignore", invalid="ignore"):  # a peer's link to itself is not used
                ratio = planned_ratios(ch.cut[pos], bw, lat, link_budget, policy, cost.wire, pairs.codec)
        elif policy.kind == "uniform" or t_ref is None:
            ratio = policy.ratio
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                dense_t = pairs.latency + ch.cut[pos] / pairs.bandwidth
            ratio = np.clip(policy.ratio * dense_t / t_ref, 1.0, policy.max_ratio)
        link_f, link_b, busy_f, busy_b = ch.link_matrices(pairs, pos, ratio)
        link_fill, link_max = link_f + link_b, np.maximum(busy_f, busy_b)
        b_star, _ = _dp_depths(stage, link_fill, link_max, None)
        if not math.isfinite(b_star):
            return best
        for _, triples in _dp_depths_caps(stage, link_fill, link_max, [b_star * f for f in cap_factors]):
            if not triples:
                continue
            stages = contiguous_stages([(seq[j], int(pos[s]), int(pos[e])) for j, s, e in triples])
            if frame is not None:
                stages = frame.frame(
                    [
                        st
                        for st, (j, _, _) in zip(stages, triples, strict=True)
                        if inner.start <= j < inner.stop
                    ]
                )
            est = estimate(dag, topo, stages, cost)
            if best is None or est.iteration_s < best[0].iteration_s:
                best = (est, stages)
        if best is None:
            return None
        remote = [lk for lk in best[0].links if lk.wire_bytes > 0]
        if remote:
            peers = [s.peer for s in best[1]]
            t_ref = float(
                np.mean(
                    [
                        topo.latency[peers[lk.src], peers[lk.dst]]
                        + lk.dense_bytes / topo.bandwidth[peers[lk.src], peers[lk.dst]]
                        for lk in remote
                    ]
                )
            )
        busy: dict[int, float] = {}
        for planned_stage, seconds in zip(best[1], best[0].compute_s, strict=True):
            busy[planned_stage.peer] = busy.get(planned_stage.peer, 0.0) + seconds
        budget = max(busy.values())  # planned ratios: hide each link under this compute ...
        n_links = max(1, len(remote))  # ... and within the slack of about this fast an iteration
        fastest = (
            best[0].critical_path_s
            - sum(lk.fwd_s + lk.bwd_s for lk in remote)
            + (cost.n_micro_batches - 1) * budget
        )
    return best
