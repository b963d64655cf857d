"""A plan by a method's name: OP-Fence, or a FusionLLM baseline (``records.PLAN_METHODS``).

The data owner is a peer of the plan: the part of the model that must run with it (its
inputs, embeddings, loss: ``planning.owner``) is its stages, and the methods place the
rest over the other peers, pricing the links to and from it. An OP-DAG without such a part
(a hand-made one) is placed over the other peers only.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.baselines import baseline_plan
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.opfence import op_fence
from fusionp2p.planning.owner import framed
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import Topology
from fusionp2p.records import PLAN_METHODS

__all__ = ["PLAN_METHODS", "plan_job"]


def plan_job(dag: OpDag, topo: Topology, data_owner: str, *, method: str, cost: CostConfig) -> Plan:
    """A plan of ``dag`` over the peers of ``topo``: the data owner's part pinned to
    ``data_owner`` (which ``topo`` holds, with its links), the rest over the other peers
    by OP-Fence, or a baseline with ``cost``'s compression (``"equal-number"``) or its own
    (``"equal-computation/adaptive"``, ...).

    Raises:
        ConfigError: an unknown method.
        PlanningError: no peer besides the data owner, or the model fits nowhere.
    """
    if method not in PLAN_METHODS:
        raise ConfigError(f"plan method must be one of {list(PLAN_METHODS)}, got {method!r}")
    topo, frame = framed(dag, topo, data_owner)
    if method == "op-fence":
        return op_fence(dag, topo, cost, frame=frame)
    name, _, kind = method.partition("/")
    return baseline_plan(name, dag, topo, cost, kind or cost.compression.kind, frame=frame)  # type: ignore[arg-type]
