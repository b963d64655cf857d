"""``Plan``: which peer runs which part of the OP-DAG, at which Top-K ratio per link.

Made by one coordinator from records; published as one small ``PlanStageRecord`` per
stage (node sets as ranges of the OP-DAG's topological order, outgoing links with ratios).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning.cost import CostConfig, in_flight, stage_in_flight
from fusionp2p.planning.estimate import Estimate, Estimated, Stage, estimate
from fusionp2p.planning.topology import PlanningError, Topology
from fusionp2p.records import PlanStageRecord, expand_ranges, node_ranges

__all__ = ["Plan", "RuntimeLayout", "RuntimeRatios", "plan_layout"]

RuntimeRatios = Mapping[tuple[int, int], float]  # (sending stage, receiving stage) -> Top-K ratio


class RuntimeLayout(NamedTuple):
    """How a runtime runs a job: runtime stage ``data_stage`` is the data owner (it reads
    the inputs and computes the loss), every other one a peer. A plan gives all of it
    (``Plan.layout``); a job split by hand may leave the assignment (contiguous pieces of
    equal forward FLOPs) and the depths (1F1B's) to the runtime."""

    peers: tuple[str, ...]  # per runtime stage
    assignment: Sequence[int] | Mapping[str, int] | None = None  # the stage of each OP-DAG position
    ratios: RuntimeRatios = MappingProxyType({})  # Top-K ratio of each runtime link (absent: dense)
    in_flight: tuple[int, ...] | None = None  # per stage: micro-batches it holds at once
    data_stage: int = 0


def plan_layout(
    peer_ids: Sequence[str],
    stage_nodes: Sequence[Sequence[int]],
    ratios: Mapping[tuple[int, int], float],
    n_micro_batches: int,
    data_owner: str,
) -> RuntimeLayout:
    """How a runtime runs a plan (``stage_nodes[k]``, the positions of plan stage ``k``,
    run by ``peer_ids[k]``) with ``data_owner`` as its stage 0: the runtime stages' peers
    (the data owner, then every other peer in the order of its first plan stage: a peer's
    plan stages run as one runtime stage), the runtime stage of each OP-DAG position, the
    Top-K ratio of each runtime link (two plan links on one: the milder), and each runtime
    stage's micro-batches in flight: the data owner's window, and for every other peer
    what the estimate counted for its plan stages (``cost.stage_in_flight``). Both the
    data owner and each stage (``coordination.plan_check``) derive it from the plan."""
    order = [data_owner, *(p for p in dict.fromkeys(peer_ids) if p != data_owner)]
    index = {peer: i for i, peer in enumerate(order)}
    runtime = [index[peer] for peer in peer_ids]
    positions = {pos: runtime[k] for k, nodes in enumerate(stage_nodes) for pos in nodes}
    assignment = tuple(positions[i] for i in range(len(positions)))
    out: dict[tuple[int, int], float] = {}
    for (a, b), ratio in ratios.items():
        if runtime[a] != runtime[b] and ratio > 1:
            key = (runtime[a], runtime[b])
            out[key] = min(out.get(key, ratio), ratio)
    per_stage = dict(zip(peer_ids, stage_in_flight(n_micro_batches, peer_ids), strict=True))
    held = [in_flight(n_micro_batches, len(order))]
    held += [per_stage[peer] for peer in order[1:]]
    if data_owner in per_stage:  # the data owner runs plan stages too: the larger of the two
        held[0] = max(held[0], per_stage[data_owner])
    return RuntimeLayout(tuple(order), assignment, MappingProxyType(out), tuple(held))


@dataclass(frozen=True)
class Plan(Estimated):
    """A partition with its per-link ratios and the estimate it was chosen for."""

    method: str  # "op-fence", "exact", "equal-number/uniform", ...
    dag: str  # the fingerprint of the OP-DAG it splits
    peer_ids: tuple[str, ...]  # owner of each stage
    stages: tuple[Stage, ...]
    ratios: dict[tuple[int, int], float]  # (src stage, dst stage) -> Top-K ratio
    n_micro_batches: int
    estimate: Estimate
    clusters: tuple[tuple[str, ...], ...] = field(default=())  # peer ids per bandwidth cluster
    version: int = 1  # a re-plan of the same job gets the next one; OpData names it

    def layout(self, data_owner: str) -> RuntimeLayout:
        """How a runtime runs this plan with ``data_owner`` as its stage 0 (``plan_layout``)."""
        nodes = [stage.nodes for stage in self.stages]
        return plan_layout(self.peer_ids, nodes, self.ratios, self.n_micro_batches, data_owner)

    @classmethod
    def build(
        cls,
        method: str,
        dag: OpDag,
        topo: Topology,
        stages: Sequence[Stage],
        cost: CostConfig,
        est: Estimate,
        clusters: Sequence[Sequence[int]] = (),
    ) -> Plan:
        ratios = {(lk.src, lk.dst): lk.ratio for lk in est.links}
        return cls(
            method,
            dag.fingerprint,
            tuple(topo.peer_ids[s.peer] for s in stages),
            tuple(stages),
            ratios,
            cost.n_micro_batches,
            est,
            tuple(tuple(topo.peer_ids[p] for p in c) for c in clusters),
        )

    def to_records(
        self, *, plan_id: str, epoch: int, made_by: str, made_at: float, data_owner: str = ""
    ) -> list[PlanStageRecord]:
        """One wire record per stage, for the DHT."""
        return [
            PlanStageRecord(
                plan_id=plan_id,
                epoch=epoch,
                stage=k,
                n_stages=len(self.stages),
                peer_id=self.peer_ids[k],
                dag=self.dag,
                node_ranges=node_ranges(stage.nodes),
                links_to={str(b): r for (a, b), r in self.ratios.items() if a == k},
                n_micro_batches=self.n_micro_batches,
                est_iteration_s=self.estimate.pipelined_s,
                made_by=made_by,
                made_at=made_at,
                data_owner=data_owner,
            )
            for k, stage in enumerate(self.stages)
        ]

    @classmethod
    def from_records(
        cls,
        records: Sequence[PlanStageRecord],
        dag: OpDag,
        topo: Topology,
        cost: CostConfig,
        *,
        method: str = "",
    ) -> Plan:
        """The plan a coordinator published, rebuilt over ``topo`` (which must hold its peers)
        with its ratios and a fresh estimate; ``version`` is its epoch.

        Raises:
            PlanningError: incomplete records, another OP-DAG, or a peer ``topo`` lacks.
        """
        owners = cls.stages_from_records(records, dag)
        index = {peer: i for i, peer in enumerate(topo.peer_ids)}
        missing = [peer[-8:] for peer, _ in owners if peer not in index]
        if missing:
            raise PlanningError(f"the plan names peers {missing} the topology does not hold")
        stages = tuple(Stage(index[peer], nodes) for peer, nodes in owners)
        ratios = {(r.stage, int(b)): ratio for r in records for b, ratio in r.links_to.items()}
        est = estimate(dag, topo, stages, cost, ratios)
        return cls(
            method or "published",
            records[0].dag,
            tuple(peer for peer, _ in owners),
            stages,
            ratios,
            records[0].n_micro_batches,
            est,
            version=records[0].epoch,
        )

    @staticmethod
    def stages_from_records(
        records: Sequence[PlanStageRecord], dag: OpDag
    ) -> list[tuple[str, tuple[int, ...]]]:
        """(peer id, node positions) per stage, checked against ``dag``.

        Raises:
            PlanningError: records of different plans, a missing stage, or another OP-DAG.
        """
        if not records:
            raise PlanningError("no plan records")
        first = records[0]
        by_stage = {r.stage: r for r in records if (r.plan_id, r.epoch) == (first.plan_id, first.epoch)}
        if sorted(by_stage) != list(range(first.n_stages)):
            raise PlanningError(f"plan {first.plan_id} has stages {sorted(by_stage)} of {first.n_stages}")
        if first.dag != dag.fingerprint:
            raise PlanningError(f"plan splits OP-DAG {first.dag}, this peer built {dag.fingerprint}")
        return [(by_stage[k].peer_id, expand_ranges(by_stage[k].node_ranges)) for k in range(first.n_stages)]

    def describe(self, dag: OpDag, data_owner: str = "") -> str:
        """A human-readable table of stages and links; ``data_owner``'s stages are marked."""
        est = self.estimate
        rows = [
            f"plan {self.method}: {len(self.stages)} stage(s), n_b={self.n_micro_batches}, "
            f"iteration {est.scheduled_s:.3f} s scheduled ({est.pipelined_s:.3f} s pipelined bound, "
            f"{est.sequential_s:.3f} s sequential), "
            f"bottleneck {est.bottleneck_s * 1e3:.1f} ms{'' if est.fits else ' (DOES NOT FIT)'}",
            f"{'STAGE':>5} {'PEER':<10} {'NODES':<28} {'COMPUTE ms':>10} {'MEMORY GiB':>10}",
        ]
        for k, stage in enumerate(self.stages):
            ids = [dag.nodes[i].id for i in stage.nodes]
            span = ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]} ({len(ids)})"
            mark = "*" if data_owner and self.peer_ids[k] == data_owner else ""
            rows.append(
                f"{k:>5} {self.peer_ids[k][-8:] + mark:<10} {span[:28]:<28} {est.compute_s[k] * 1e3:>10.1f} "
                f"{est.memory_bytes[k] / 2**30:>10.2f}"
            )
        if data_owner in self.peer_ids:
            rows.append("    * the data owner: its inputs, embeddings and loss, and its links to the peers")
        for lk in est.links:
            if lk.wire_bytes:
                rows.append(
                    f"  link {lk.src}->{lk.dst}: {lk.dense_bytes / 2**20:.1f} MiB dense, "
                    f"ratio {lk.ratio:.0f}, "
                    f"{lk.wire_bytes / 2**20:.2f} MiB on the wire, fwd {lk.fwd_s * 1e3:.1f} ms, "
                    f"bwd {lk.bwd_s * 1e3:.1f} ms"
                    + (
                        f" (in flight {lk.fwd_latency_s * 1e3:.1f} / {lk.bwd_latency_s * 1e3:.1f} ms of them)"
                        if lk.fwd_latency_s or lk.bwd_latency_s
                        else ""
                    )
                    + (f", Top-K coding {lk.codec_s * 1e3:.1f} ms" if lk.codec_s else "")
                )
        return "\n".join(rows)
