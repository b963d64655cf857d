"""The data owner's part of a plan: what runs with it whatever the plan, and where.

A traced OP-DAG marks the nodes that must run with the data owner (``OpNode.pinned``: the
nodes that read the raw inputs, what shares a parameter with them, what reads nothing
from other stages, and the loss). A plan places them before it places anything else, so
the data owner is a peer of the plan: its stages, its links to the first and from the
last peer stage, and its compute are in the estimate like any other. In topological order
the pinned nodes fall into three groups:

- the *head* ``[0, head)``: the leading pinned nodes (inputs, embeddings, masks), up to
  the first unpinned node that holds parameters, with the few unpinned nodes among them;
- the *tail* ``[tail, n)``: from the first pinned node that depends on an unpinned one
  (a tied LM head, the loss) to the end;
- *strays*: pinned nodes between the two that depend only on pinned ones (a position or
  mask computed inside a layer); they run with the head, and their outputs cross to the
  stage that reads them.

Planners place the *middle* ``[head, tail)`` over the other peers in contiguous stages
(``OwnerPart.frame`` adds the data owner's). An OP-DAG with no pinned node (a hand-made
one) has no part: it is planned over the other peers only, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.estimate import Stage
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = ["OwnerFrame", "OwnerPart", "framed", "owner_part"]


@dataclass(frozen=True)
class OwnerPart:
    """Where the data owner's pinned nodes sit in an OP-DAG's topological order."""

    n: int  # nodes of the OP-DAG
    head: int  # positions [0, head) run on the data owner, before every peer stage
    tail: int  # positions [tail, n) run on the data owner, after every peer stage
    strays: tuple[int, ...] = ()  # pinned positions in [head, tail): with the head

    def frame(self, owner: int, middle: Sequence[Stage]) -> list[Stage]:
        """The plan's stages: the data owner's head (with the strays), ``middle`` (stages
        over ``[head, tail)``, strays taken out, empty ones dropped), the data owner's tail."""
        strays = set(self.strays)
        head = (*range(self.head), *self.strays)
        out = [Stage(owner, tuple(sorted(head)))] if head else []
        for stage in middle:
            nodes = tuple(i for i in stage.nodes if i not in strays)
            if nodes:
                out.append(Stage(stage.peer, nodes))
        if self.tail < self.n:
            out.append(Stage(owner, tuple(range(self.tail, self.n))))
        return out

    def middle(self, stages: Sequence[Stage]) -> list[Stage]:
        """``frame``'s inverse: the middle of a plan ``frame`` made, its stages contiguous
        again (the strays put back)."""
        inner = list(stages)
        if inner and (self.head or self.strays):
            inner = inner[1:]
        if inner and self.tail < self.n:
            inner = inner[:-1]
        out = []
        start = self.head
        for k, stage in enumerate(inner):
            end = self.tail if k == len(inner) - 1 else min(inner[k + 1].nodes)
            out.append(Stage(stage.peer, tuple(range(start, end))))
            start = end
        return out


@dataclass(frozen=True)
class OwnerFrame:
    """A data owner (its index in the topology) and its part of the OP-DAG."""

    owner: int
    part: OwnerPart

    def frame(self, middle: Sequence[Stage]) -> list[Stage]:
        return self.part.frame(self.owner, middle)


def owner_part(dag: OpDag) -> OwnerPart | None:
    """The data owner's part of ``dag``, or None when no node is pinned.

    Raises:
        PlanningError: every node is the data owner's (nothing to place on a peer).
    """
    n = len(dag)
    pinned = [node.pinned for node in dag.nodes]
    if not any(pinned):
        return None
    after_free = [False] * n  # depends (transitively) on an unpinned node
    for i, node in enumerate(dag.nodes):
        after_free[i] = any(not pinned[j] or after_free[j] for j in (dag.index[s] for s in node.inputs))
    tail = min((i for i in range(n) if pinned[i] and after_free[i]), default=n)
    first_weights = next(
        (i for i, node in enumerate(dag.nodes) if not pinned[i] and node.param_bytes > 0), tail
    )
    head = max((i + 1 for i in range(min(first_weights, tail)) if pinned[i]), default=0)
    strays = tuple(i for i in range(head, tail) if pinned[i])
    if head >= tail or all(pinned[i] for i in range(head, tail)):
        raise PlanningError(
            f"every node of {dag.name or 'the model'} runs with the data owner: nothing to place on a peer"
        )
    return OwnerPart(n, head, tail, strays)


def framed(dag: OpDag, topo: Topology, data_owner: str) -> tuple[Topology, OwnerFrame | None]:
    """The topology a plan of ``dag`` places its peers' stages on, and the data owner's
    frame: ``data_owner`` pinned to its part, or (no part, or a data owner ``topo`` does
    not hold) no frame and ``topo`` without it.

    Raises:
        PlanningError: no peer besides the data owner.
    """
    if not len(topo.without(data_owner)):
        raise PlanningError("the swarm has no live peer besides this data owner to run the model on")
    part = owner_part(dag)
    if part is None or data_owner not in topo.peer_ids:
        return topo.without(data_owner), None
    return topo, OwnerFrame(topo.peer_ids.index(data_owner), part)
