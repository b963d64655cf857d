"""The OP-DAG intermediate representation: nodes with costs, edges by name, a topological order.

Pure data (no torch): the planner reads FLOPs and bytes from here, and any tracer or
analytic model description can produce it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from fusionp2p.errors import FusionP2PError

__all__ = ["LOSS_ID", "OpDag", "OpDagError", "OpNode"]

LOSS_ID = "output"  # a traced OP-DAG's last node: the data owner's loss, reading the graph's outputs


class OpDagError(FusionP2PError, ValueError):
    """An OP-DAG is malformed: a cycle, a missing input, a duplicate id, a negative cost."""


@dataclass(frozen=True)
class OpNode:
    """One operator (or a coarse group of operators) of the model."""

    id: str
    kind: str  # "embedding", "transformer_block", "attention", "mlp", "lm_head", an aten op...
    inputs: tuple[str, ...] = ()  # ids of the nodes whose outputs this node consumes
    fwd_flops: float = 0.0  # forward FLOPs per micro-batch
    bwd_flops: float = 0.0  # backward FLOPs per micro-batch
    param_bytes: int = 0  # bytes of parameters this node owns (tied ones counted at each user)
    output_bytes: int = 0  # bytes of this node's output per micro-batch (what a cut carries)
    saved_bytes: int = 0  # bytes kept from forward for backward, per micro-batch
    module_path: str = ""  # e.g. "transformer.h.3.attn"
    output_shapes: tuple[tuple[int, ...], ...] = ()
    output_dtypes: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()  # names of parameters shared with other nodes
    pinned: bool = False  # runs with the data owner whatever the plan (reads its inputs, is the loss, ...)

    def __post_init__(self) -> None:
        for name in ("fwd_flops", "bwd_flops", "param_bytes", "output_bytes", "saved_bytes"):
            value = getattr(self, name)
            if not value >= 0:  # also catches NaN
                raise OpDagError(f"node {self.id!r}: {name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class OpDag:
    """Nodes in a topological order (checked): every input precedes its consumer."""

    nodes: tuple[OpNode, ...]
    name: str = ""
    meta: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            if node.id in seen:
                raise OpDagError(f"duplicate node id {node.id!r}")
            for src in node.inputs:
                if src not in seen:
                    raise OpDagError(
                        f"node {node.id!r} consumes {src!r}, which is not an earlier node "
                        "(missing, or the order is not topological / has a cycle)"
                    )
            seen.add(node.id)
        if not self.nodes:
            raise OpDagError("an OP-DAG needs at least one node")

    @classmethod
    def from_unordered(cls, nodes: Iterable[OpNode], name: str = "") -> OpDag:
        """Orders ``nodes`` topologically (stable) or raises OpDagError on a cycle."""
        pending = {n.id: n for n in nodes}
        order: list[OpNode] = []
        done: set[str] = set()
        while pending:
            ready = [n for n in pending.values() if all(i in done for i in n.inputs)]
            if not ready:
                missing = {
                    i for n in pending.values() for i in n.inputs if i not in done and i not in pending
                }
                what = f"missing inputs {sorted(missing)}" if missing else f"a cycle among {sorted(pending)}"
                raise OpDagError(f"cannot order the OP-DAG: {what}")
            for n in ready:
                order.append(n)
                done.add(n.id)
                del pending[n.id]
        return cls(tuple(order), name=name)

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def fingerprint(self) -> str:
        """``name:hash`` of the node ids in order: a planner and a runtime that split the same
        OP-DAG agree on it (a traced model's name carries its graph's own fingerprint)."""
        digest = hashlib.sha256("\n".join(n.id for n in self.nodes).encode()).hexdigest()[:16]
        return f"{self.name[:40]}:{digest}"

    @cached_property
    def index(self) -> dict[str, int]:
        """Position of each node id in the topological order."""
        return {n.id: i for i, n in enumerate(self.nodes)}

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for src in n.inputs:
                out[src].append(n.id)
        return {k: tuple(v) for k, v in out.items()}

    def cut_bytes(self) -> list[int]:
        """``cut[p]``: bytes crossing the cut before position ``p`` (0..len), each tensor once.

        A tensor produced before ``p`` and consumed at or after ``p`` crosses it: residual
        and skip connections are counted where they cross.
        """
        cut = [0] * (len(self.nodes) + 1)
        for i, node in enumerate(self.nodes):
            users = [self.index[c] for c in self.consumers[node.id]]
            if users:
                last = max(users)
                for p in range(i + 1, last + 1):
                    cut[p] += node.output_bytes
        return cut

    @cached_property
    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(producer, consumer) positions of every edge, as two arrays."""
        pairs = np.array(
            [(self.index[src], i) for i, n in enumerate(self.nodes) for src in n.inputs], dtype=np.int64
        ).reshape(-1, 2)
        return pairs[:, 0], pairs[:, 1]

    def column(self, name: str) -> np.ndarray:
        """One cost field of every node, in order, as a float array (``"fwd_flops"``,
        ``"bwd_flops"``, ``"param_bytes"``, ``"output_bytes"``, ``"saved_bytes"``)."""
        cached = self._columns.get(name)
        if cached is None:
            cached = self._columns[name] = np.array([getattr(n, name) for n in self.nodes], dtype=float)
        return cached

    @cached_property
    def _columns(self) -> dict[str, np.ndarray]:
        return {}

    def stage_sums(self, owner: np.ndarray, n_stages: int, name: str) -> np.ndarray:
        """``column(name)`` summed per stage, given each node's stage ``owner[i]``."""
        return np.bincount(owner, weights=self.column(name), minlength=n_stages)

    def traffic(self, owner: Sequence[int] | np.ndarray) -> dict[tuple[int, int], int]:
        """Bytes per micro-batch from stage a to stage b (in that order), given each node's
        stage ``owner[i]``. A tensor is sent once to each other stage that consumes it.
        """
        own = np.asarray(owner, dtype=np.int64)
        producer, consumer = self.edges
        to = own[consumer]
        crossing = own[producer] != to
        width = int(own.max(initial=0)) + 1
        sends = np.unique(producer[crossing] * width + to[crossing])  # (tensor, stage) once each
        tensor, dst = np.divmod(sends, width)
        pair = own[tensor] * width + dst
        keys, where = np.unique(pair, return_inverse=True)
        total = np.bincount(where, weights=self.column("output_bytes")[tensor], minlength=len(keys))
        return {(int(k) // width, int(k) % width): int(b) for k, b in zip(keys, total, strict=True)}

    @property
    def total_fwd_flops(self) -> float:
        return sum(n.fwd_flops for n in self.nodes)

    @property
    def total_param_bytes(self) -> int:
        return sum(n.param_bytes for n in self.nodes)
