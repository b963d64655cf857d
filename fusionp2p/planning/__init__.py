"""Planning: records and an OP-DAG in, a Plan out. Pure: no network, no clock, no asyncio.

- ``topology.py``: the swarm as arrays (speed, memory, bandwidth, latency); PlanningError.
- ``infer.py``: the bandwidth and latency of pairs nobody measured, from those measured.
- ``cost.py``: wire format, compression policies (by a job's name for them) and adaptive
  ratios (§5.2), CostConfig.
- ``estimate.py``: sequential and pipelined iteration time and memory of a partition (§3.6).
- ``calibrate.py``: a plan's estimate again, with speeds from the compute its stages reported.
- ``chain.py``: vectorized stage/link costs over the topological order.
- ``cluster.py``: Leiden/Louvain clusters on the bandwidth graph.
- ``opfence.py``: OP-Fence (§4).
- ``baselines.py``: equal-number and equal-computation partitions.
- ``owner.py``: the data owner's part of a plan (pinned head and tail, strays).
- ``methods.py``: a plan by a method's name (OP-Fence or a baseline), ``plan_job``.
- ``schedule.py``: the runtime's 1F1B schedule played out, what a plan's estimate reports.
- ``fit.py``: why a model fits in no split (the message a refused job gets).
- ``local_search.py``: OP-Fence's improvement of a partition by moving its cuts.
- ``exact.py``: exhaustive optimum for small chain cases.
- ``plan.py``: the Plan, its per-stage wire records and how a runtime runs it (RuntimeLayout).
- ``synthetic.py``: seeded synthetic swarms and networks.

The layers and how they fit: ``docs/architecture.md``.
"""

from fusionp2p.planning.baselines import BASELINES, baseline_plan
from fusionp2p.planning.cluster import cluster_peers
from fusionp2p.planning.cost import (
    NO_COMPRESSION,
    PAPER_WIRE,
    PLANNED_MAX_RATIO,
    WIRE,
    CompressionPolicy,
    CostConfig,
    WireFormat,
    adaptive_ratios,
    codec_seconds,
    compression_policy,
    planned_ratios,
)
from fusionp2p.planning.estimate import Estimate, LinkEstimate, Stage, estimate, estimate_segments
from fusionp2p.planning.exact import exact_plan, is_chain
from fusionp2p.planning.methods import PLAN_METHODS, plan_job
from fusionp2p.planning.opfence import op_fence
from fusionp2p.planning.plan import Plan, RuntimeLayout
from fusionp2p.planning.synthetic import synthetic_swarm
from fusionp2p.planning.topology import PlanningError, Topology
from fusionp2p.planning.vouch import vouched_links

__all__ = [
    "BASELINES",
    "NO_COMPRESSION",
    "PAPER_WIRE",
    "PLANNED_MAX_RATIO",
    "PLAN_METHODS",
    "WIRE",
    "CompressionPolicy",
    "CostConfig",
    "Estimate",
    "LinkEstimate",
    "Plan",
    "PlanningError",
    "RuntimeLayout",
    "Stage",
    "Topology",
    "WireFormat",
    "adaptive_ratios",
    "baseline_plan",
    "cluster_peers",
    "codec_seconds",
    "compression_policy",
    "estimate",
    "estimate_segments",
    "exact_plan",
    "is_chain",
    "op_fence",
    "plan_job",
    "planned_ratios",
    "synthetic_swarm",
    "vouched_links",
]
