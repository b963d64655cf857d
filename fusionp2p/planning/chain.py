"""Vectorized costs of contiguous partitions of an OP-DAG's topological order.

A stage covering positions ``[s, e)`` on peer p computes ``(F[e] - F[s]) / speed[p]``; the
cut at position c carries ``cut[c]`` bytes (every tensor produced before c and used at or
after it). For a chain OP-DAG these are exact; with skip connections that jump over a
whole stage they count such a tensor on each link it passes, so the planner only uses
them to search, and ``estimate`` has the last word.
"""

from __future__ import annotations

import numpy as np

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.topology import Topology

__all__ = ["ChainCosts"]

_LINK_CACHE_ENTRIES = 1 << 14  # ~140 MiB for a 500-node OP-DAG at most; cleared when full


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
        self._link_cache: dict[tuple[int, int, float], tuple[np.ndarray, np.ndarray]] = {}

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

    def link_times(self, src: int, dst: int, ratio: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per cut position for a link src -> dst at ``ratio``;
        the forward holds the link's Top-K coding time (``estimate`` counts it as the peers'
        work too). Memoized for a scalar ratio (every order OP-Fence tries asks again)."""
        if src == dst:
            zeros = np.zeros_like(self.cut)
            return zeros, zeros
        if np.ndim(ratio) == 0:
            key = (src, dst, float(ratio))
            cached = self._link_cache.get(key)
            if cached is None:
                if len(self._link_cache) >= _LINK_CACHE_ENTRIES:
                    self._link_cache.clear()
                cached = self._link_cache[key] = self._link_times(src, dst, ratio)
            return cached
        return self._link_times(src, dst, ratio)

    def _link_times(self, src: int, dst: int, ratio: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        wire = self.cost.wire.wire_bytes(self.cut, ratio)
        send, recv = self.topo.coding_s(src, dst, self.cut / self.cost.wire.dense_value_bytes, ratio)
        fwd = self.topo.latency[src, dst] + wire / self.topo.bandwidth[src, dst] + send + recv
        bwd = self.topo.latency[dst, src] + wire / self.topo.bandwidth[dst, src]
        return fwd, bwd

    def dense_time(self, src: int, dst: int) -> np.ndarray:
        """Uncompressed forward seconds per cut position (what adaptive ratios scale with)."""
        return self.topo.latency[src, dst] + self.cut / self.topo.bandwidth[src, dst]
