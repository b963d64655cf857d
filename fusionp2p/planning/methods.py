"""A plan by a method's name: OP-Fence, or a FusionLLM baseline (``records.PLAN_METHODS``).

The data owner runs the job's inputs and its loss, outside the plan: a plan places the
model over the other peers.
"""

from __future__ import annotations

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.baselines import baseline_plan
from fusionp2p.planning.cost import CostConfig
from fusionp2p.planning.opfence import op_fence
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.topology import PlanningError, Topology
from fusionp2p.records import PLAN_METHODS

__all__ = ["PLAN_METHODS", "plan_job"]


def plan_job(dag: OpDag, topo: Topology, data_owner: str, *, method: str, cost: CostConfig) -> Plan:
    """A plan of ``dag`` over the peers of ``topo`` other than ``data_owner``: OP-Fence, or a
    baseline with ``cost``'s compression (``"equal-number"``) or its own
    (``"equal-computation/adaptive"``, ...).

    Raises:
        ConfigError: an unknown method.
        PlanningError: no peer besides the data owner, or the model fits nowhere.
    """
    if method not in PLAN_METHODS:
        raise ConfigError(f"plan method must be one of {list(PLAN_METHODS)}, got {method!r}")
    peers = topo.without(data_owner)
    if not len(peers):
        raise PlanningError("the swarm has no live peer besides this data owner to run the model on")
    if method == "op-fence":
        return op_fence(dag, peers, cost)
    name, _, kind = method.partition("/")
    return baseline_plan(name, dag, peers, cost, kind or cost.compression.kind)  # type: ignore[arg-type]
