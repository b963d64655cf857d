"""Why a model fits nowhere: the binding memory constraint, and the knob that helps.

When no split of the OP-DAG fits the peers' memory, a planner's error should say which
constraint binds, with numbers, instead of blaming the weights:

1. one operator node alone needs more than the largest peer offers: no split can place
   it (its weights, grads and optimizer state, plus its saved activations for one
   micro-batch);
2. the whole model needs more than all candidate peers offer together (each stage keeps
   the activations of at least one micro-batch);
3. neither, so the memory is there but scattered: no contiguous split puts each piece on
   a peer that can hold it (stage k of S keeps ``cost.in_flight`` micro-batches).
"""

from __future__ import annotations

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig, in_flight
from fusionp2p.planning.topology import Topology

__all__ = ["explain_no_fit"]

GIB = float(1 << 30)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def explain_no_fit(dag: OpDag, topo: Topology, cost: CostConfig, peers: list[int] | None = None) -> str:
    """One line naming the binding memory constraint of planning ``dag`` on ``peers`` (all
    of ``topo`` by default) and what would help."""
    peers = list(range(len(topo))) if peers is None else peers
    usable = [cost.memory_headroom * float(topo.memory[p]) for p in peers]
    largest = max(usable, default=0.0)
    needs = [cost.param_multiplier * n.param_bytes + n.saved_bytes for n in dag.nodes]
    worst = max(range(len(needs)), key=needs.__getitem__)
    node = dag.nodes[worst]
    if needs[worst] > largest:
        activations = node.saved_bytes
        knob = (
            "a smaller micro-batch"
            if activations >= cost.param_multiplier * node.param_bytes
            else "a peer with more memory, or a finer OP-DAG (--granularity sublayer)"
        )
        return (
            f"node {node.id!r} alone needs {_gib(needs[worst])} (weights, grads and optimizer state "
            f"{_gib(cost.param_multiplier * node.param_bytes)}, activations {_gib(activations)} per "
            f"micro-batch) and the largest peer offers {_gib(largest)} usable: try {knob}"
        )
    total = sum(needs)  # every stage holds at least one micro-batch's activations
    if total > sum(usable):
        return (
            f"the model needs at least {_gib(total)} over all its stages (weights, grads, optimizer state, "
            f"and activations of at least one micro-batch in flight each) and the {len(peers)} candidate "
            f"peer(s) offer {_gib(sum(usable))} usable in total: try more peers or a smaller micro-batch"
        )
    window = in_flight(cost.n_micro_batches, max(1, len(peers)))
    return (
        f"the {len(peers)} candidate peer(s) offer {_gib(sum(usable))} usable in total (the largest "
        f"{_gib(largest)}) for a model of at least {_gib(total)}, but no contiguous split puts each piece "
        f"on a peer that can hold it (stage k of S keeps the activations of "
        f"min({cost.n_micro_batches}, S - k) micro-batches, up to {window} here): try peers with more "
        f"memory each, fewer micro-batches per step, or a smaller micro-batch"
    )
