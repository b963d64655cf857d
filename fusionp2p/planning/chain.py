"""Vectorized costs of contiguous partitions of an OP-DAG's topological order.

A stage covering positions ``[s, e)`` on peer p computes ``(F[e] - F[s]) / speed[p]``; the
cut at position c carries ``cut[c]`` bytes (every tensor produced before c and used at or
after it). For a chain OP-DAG these are exact; with skip connections that jump over a
whole stage they count such a tensor on each link it passes, so the planner only uses
them to search, and ``estimate`` has the last word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig, codec_seconds
from fusionp2p.planning.topology import Topology

__all__ = ["ChainCosts", "SlotPairs"]


class ChainCosts:
    """Prefix sums of an OP-DAG plus the swarm, for fast stage and link costs."""

    def __init__(self, dag: OpDag, topo: Topology, cost: CostConfig) -> None:
        self.dag, self.topo, self.cost = dag, topo, cost
        self.n = len(dag)
        self.flops_fwd = np.concatenate([[0.0], np.cumsum([n.fwd_flops for n in dag.nodes])])
        self.flops_bwd = np.concatenate([[0.0], np.cumsum([n.bwd_flops for n in dag.nodes])])
        self.params = np.concatenate([[0.0], np.cumsum([float(n.param_bytes) for n in dag.nodes])])
        self.saved = np.concatenate([[0.0], np.cumsum([float(n.saved_bytes) for n in dag.nodes])])
        self.cut = np.array(dag.cut_bytes(), dtype=float)
        self._stage_cache: dict[tuple[int, int, bytes], np.ndarray] = {}

    def stage_matrix(self, peer: int, inflight: int, positions: np.ndarray | None = None) -> np.ndarray:
        """``[s, e]``: forward+backward seconds of the stage from ``positions[s]`` to ``positions[e]``
        on ``peer``; inf where empty or too big for the peer's memory. Memoized."""
        pos = np.arange(self.n + 1) if positions is None else positions
        key = (peer, inflight, pos.tobytes())
        cached = self._stage_cache.get(key)
        if cached is not None:
            return cached
        flops = (self.flops_fwd + self.flops_bwd)[pos]
        params, saved = self.params[pos], self.saved[pos]
        t = (flops[None, :] - flops[:, None]) / self.topo.speed[peer]
        mem = self.cost.param_multiplier * (params[None, :] - params[:, None]) + inflight * (
            saved[None, :] - saved[:, None]
        )
        s_idx, e_idx = np.indices(t.shape)
        bad = (e_idx <= s_idx) | (mem > self.cost.memory_headroom * self.topo.memory[peer])
        self._stage_cache[key] = out = np.where(bad, np.inf, t)
        return out

    def slot_pairs(self, seq: Sequence[int]) -> SlotPairs:
        """The links between the slots of a peer sequence, as ``[a, b, 1]`` arrays."""
        peers = np.asarray(seq, dtype=np.int64)
        src, dst = peers[:, None], peers[None, :]
        codec = self.topo.codec
        later = np.triu(np.ones((len(peers), len(peers)), dtype=bool), 1) & (src != dst)
        return SlotPairs(
            src=src,
            dst=dst,
            used=later[..., None],
            latency=self.topo.latency[src, dst][..., None],
            latency_back=self.topo.latency[dst, src][..., None],
            bandwidth=self.topo.bandwidth[src, dst][..., None],
            bandwidth_back=self.topo.bandwidth[dst, src][..., None],
            codec=((codec[src, 0] + codec[dst, 2])[..., None], (codec[src, 1] + codec[dst, 3])[..., None]),
        )

    def link_matrices(
        self, pairs: SlotPairs, positions: np.ndarray, ratio: np.ndarray | float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``[a, b, c]``: (forward, backward, forward busy, backward busy) seconds of the link
        from slot a to a later slot b at cut ``positions[c]``, at Top-K ``ratio`` (broadcast
        to ``[a, b, c]``); 0 where b is not later than a or both slots are one peer (the data
        owner's head and tail). The forward holds the link's Top-K coding time (``estimate``
        counts it as the peers' work too); the busy times leave out the latency, which is
        in flight, not occupancy."""
        cut = self.cut[positions][None, None, :]
        wire_fmt, codec = self.cost.wire, self.topo.codec
        with np.errstate(divide="ignore", invalid="ignore"):  # a peer's link to itself: masked below
            wire = wire_fmt.wire_bytes(cut, ratio)
            numel = cut / wire_fmt.dense_value_bytes
            send = codec_seconds(numel, ratio, codec[pairs.src, 0][..., None], codec[pairs.src, 1][..., None])
            recv = codec_seconds(numel, ratio, codec[pairs.dst, 2][..., None], codec[pairs.dst, 3][..., None])
            fwd = pairs.latency + wire / pairs.bandwidth + send + recv
            bwd = pairs.latency_back + wire / pairs.bandwidth_back
            out = (fwd, bwd, fwd - pairs.latency, bwd - pairs.latency_back)
        return tuple(np.where(pairs.used, x, 0.0) for x in out)  # type: ignore[return-value]


@dataclass(frozen=True)
class SlotPairs:
    """Every (slot a, slot b) link of a peer sequence, as arrays of shape ``[a, b, 1]``."""

    src: np.ndarray  # [a, 1]: each slot's peer
    dst: np.ndarray  # [1, b]
    used: np.ndarray  # b comes after a, on another peer
    latency: np.ndarray  # a -> b
    latency_back: np.ndarray  # b -> a
    bandwidth: np.ndarray
    bandwidth_back: np.ndarray
    codec: tuple[np.ndarray, np.ndarray]  # Top-K coding, both sides: per dense element, per kept entry
