"""Planning: records and an OP-DAG in, a Plan out. Pure: no network, no clock, no asyncio.

- ``topology.py``: the swarm as arrays (speed, memory, bandwidth, latency); PlanningError.
- ``infer.py``: the bandwidth and latency of pairs nobody measured, from those measured.
- ``cost.py``: wire format, compression policies and adaptive ratios (§5.2), CostConfig.
- ``estimate.py``: sequential and pipelined iteration time and memory of a partition (§3.6).
- ``calibrate.py``: a plan's estimate again, with speeds from the compute its stages reported.
- ``chain.py``: vectorized stage/link costs over the topological order.
- ``cluster.py``: Leiden/Louvain clusters on the bandwidth graph.
- ``opfence.py``: OP-Fence (§4).
- ``baselines.py``: equal-number and equal-computation partitions.
- ``exact.py``: exhaustive optimum for small chain cases.
- ``plan.py``: the Plan and its per-stage wire records.
- ``synthetic.py``: seeded synthetic swarms and networks.
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
    planned_ratios,
)
from fusionp2p.planning.estimate import Estimate, LinkEstimate, Stage, estimate, estimate_segments
from fusionp2p.planning.exact import exact_plan, is_chain
from fusionp2p.planning.opfence import op_fence
from fusionp2p.planning.plan import Plan
from fusionp2p.planning.synthetic import synthetic_swarm
from fusionp2p.planning.topology import PlanningError, Topology

__all__ = [
    "BASELINES",
    "NO_COMPRESSION",
    "PAPER_WIRE",
    "PLANNED_MAX_RATIO",
    "WIRE",
    "CompressionPolicy",
    "CostConfig",
    "Estimate",
    "LinkEstimate",
    "Plan",
    "PlanningError",
    "Stage",
    "Topology",
    "WireFormat",
    "adaptive_ratios",
    "baseline_plan",
    "cluster_peers",
    "codec_seconds",
    "estimate",
    "estimate_segments",
    "exact_plan",
    "is_chain",
    "op_fence",
    "planned_ratios",
    "synthetic_swarm",
]
