"""The planner: hand-computed estimates, clustering, OP-Fence against baselines and the optimum."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fusionp2p.opdag import OpDag, OpNode, TransformerShape, transformer_dag
from fusionp2p.planning import (
    BASELINES,
    PAPER_WIRE,
    WIRE,
    CompressionPolicy,
    CostConfig,
    Plan,
    PlanningError,
    Stage,
    Topology,
    adaptive_ratios,
    baseline_plan,
    cluster_peers,
    estimate,
    exact_plan,
    op_fence,
    planned_ratios,
    synthetic_swarm,
)
from fusionp2p.planning.local_search import improve
from fusionp2p.records import LinkRecord, PeerRecord, PlanStageRecord

GB = 1 << 30
GPT2_SMALL = TransformerShape("gpt2", 12, 768, 12, 50257, 1024, 3072, 12, True)


def gpt2_small(*, seq_len: int, micro_batch: int) -> OpDag:
    return transformer_dag(GPT2_SMALL, seq_len=seq_len, micro_batch=micro_batch, granularity="block")


def two_node_dag() -> OpDag:
    return OpDag(
        (
            OpNode(
                "a",
                "x",
                (),
                fwd_flops=1e12,
                bwd_flops=2e12,
                param_bytes=1_000_000,
                output_bytes=1_000_000,
                saved_bytes=500,
            ),
            OpNode("b", "x", ("a",), fwd_flops=1e12, bwd_flops=2e12, output_bytes=4, saved_bytes=100),
        )
    )


def two_peers(bw: float = 1e6, latency: float = 0.01) -> Topology:
    return Topology.from_arrays(
        ["p0", "p1"], [1e12, 2e12], [GB, GB], np.full((2, 2), bw), np.full((2, 2), latency)
    )


def test_estimate_matches_a_hand_computed_two_stage_case() -> None:
    cost = CostConfig(n_micro_batches=4, compression=CompressionPolicy(kind="none"))
    est = estimate(two_node_dag(), two_peers(), [Stage(0, (0,)), Stage(1, (1,))], cost)
    assert est.compute_s == pytest.approx((3.0, 1.5))
    (link,) = est.links
    assert (link.dense_bytes, link.ratio, link.wire_bytes) == (1_000_000, 1.0, 1_000_000)
    assert link.fwd_s == pytest.approx(1.01) and link.bwd_s == pytest.approx(1.01)
    # forward 1 + 1.01 + 0.5, backward 1 + 1.01 + 2
    assert est.critical_path_s == pytest.approx(6.52)
    assert est.bottleneck_s == pytest.approx(3.0)
    assert est.sequential_s == pytest.approx(4 * 6.52)
    assert est.pipelined_s == pytest.approx(6.52 + 3 * 3.0)
    # 4x params (weights, grads, 2 Adam moments) + saved activations of 2 in-flight micro-batches
    assert est.memory_bytes == pytest.approx((4_000_000 + 2 * 500, 1 * 100))
    assert est.fits


def test_compression_counts_the_index_overhead_of_the_wire_format() -> None:
    cost = CostConfig(n_micro_batches=1, compression=CompressionPolicy(kind="uniform", ratio=10))
    (link,) = estimate(two_node_dag(), two_peers(), [Stage(0, (0,)), Stage(1, (1,))], cost).links
    assert link.wire_bytes == 25_000 * (4 + 2) + 32  # 250k fp32 values / 10, 2-byte gaps, header
    assert link.fwd_s == pytest.approx(0.01 + link.wire_bytes / 1e6)
    assert float(PAPER_WIRE.wire_bytes(1_000_000, 10)) == 25_000 * 12 + 32  # the paper's coefficient 3
    assert float(WIRE.wire_bytes(1_000_000, 1.5)) == 1_000_000  # sparse would be bigger: send dense


def test_adaptive_ratios_compress_slow_links_harder() -> None:
    policy = CompressionPolicy(kind="adaptive", ratio=100, max_ratio=120)
    assert adaptive_ratios(np.array([1.0, 2.0, 3.0]), policy).tolist() == [50.0, 100.0, 120.0]
    assert adaptive_ratios(np.array([0.001, 10.0]), policy)[0] == 1.0
    assert adaptive_ratios(np.array([1.0, 2.0]), CompressionPolicy(kind="uniform", ratio=7)).tolist() == [
        7,
        7,
    ]


def test_stages_on_one_peer_share_its_device_and_need_no_link() -> None:
    dag = OpDag.from_unordered(
        [
            OpNode(
                f"n{i}", "x", (f"n{i - 1}",) if i else (), fwd_flops=1e12, bwd_flops=1e12, output_bytes=10**6
            )
            for i in range(3)
        ]
    )
    cost = CostConfig(n_micro_batches=2, compression=CompressionPolicy(kind="none"))
    est = estimate(dag, two_peers(), [Stage(0, (0,)), Stage(1, (1,)), Stage(0, (2,))], cost)
    assert [lk.fwd_s > 0 for lk in est.links] == [True, True]
    assert est.bottleneck_s == pytest.approx(4.0)  # peer 0 computes stages 0 and 2: 2 + 2 s
    with pytest.raises(PlanningError, match="earlier stage"):
        estimate(dag, two_peers(), [Stage(0, (2,)), Stage(1, (0, 1))], cost)
    with pytest.raises(PlanningError, match="without a stage"):
        estimate(dag, two_peers(), [Stage(0, (0,))], cost)


def test_cut_bytes_count_skip_connections_where_they_cross() -> None:
    dag = OpDag.from_unordered(
        [
            OpNode("in", "x", (), output_bytes=10),
            OpNode("f", "x", ("in",), output_bytes=20),
            OpNode("add", "x", ("in", "f"), output_bytes=30),
        ]
    )
    assert dag.cut_bytes() == [0, 10, 30, 0]
    assert dag.traffic([0, 1, 1]) == {(0, 1): 10}  # one send of "in" to stage 1, used twice there


def test_clustering_finds_the_obvious_clusters() -> None:
    bw = np.full((7, 7), 10e6)
    for group in ([0, 1, 2], [3, 4], [5, 6]):
        bw[np.ix_(group, group)] = 1e9
    topo = Topology.from_arrays([f"p{i}" for i in range(7)], [1e12] * 7, [GB] * 7, bw)
    assert cluster_peers(topo, "leiden") == [[0, 1, 2], [3, 4], [5, 6]]
    assert cluster_peers(topo, "louvain") == [[0, 1, 2], [3, 4], [5, 6]]


def _records(n: int, links: list[tuple[int, int, float]]) -> tuple[list[PeerRecord], list[LinkRecord]]:
    peers = [
        PeerRecord(
            peer_id=f"p{i}",
            maddrs=(),
            device="cpu",
            device_name="x",
            flops={"float32": 1e12},
            memory_bytes=GB,
            total_memory_bytes=GB,
            state="idle",
            started_at=0,
            updated_at=0,
        )
        for i in range(n)
    ]
    return peers, [
        LinkRecord(src=f"p{a}", dst=f"p{b}", bandwidth_bytes_per_s=bw, rtt_s=0.02, measured_at=0)
        for a, b, bw in links
    ]


def test_topology_fills_reverse_and_unmeasured_links_and_refuses_a_disconnected_swarm() -> None:
    peers, links = _records(3, [(0, 1, 100.0), (1, 2, 50.0)])
    topo = Topology.from_records(peers, links)
    assert topo.bandwidth[1, 0] == 100.0  # from the reverse direction
    assert topo.bandwidth[0, 2] == 87.5  # inferred: the cluster's upper quartile (too few links for caps)
    assert topo.latency[0, 2] == pytest.approx(0.01)  # the median latency measured in the cluster
    assert topo.measured[0, 1] and not topo.measured[0, 2]
    peers, links = _records(4, [(0, 1, 100.0), (2, 3, 100.0)])
    with pytest.raises(PlanningError, match="disconnected"):
        Topology.from_records(peers, links)
    with pytest.raises(PlanningError, match="no live peers"):
        Topology.from_records([], [])


@pytest.mark.parametrize("bad", ["nan_bandwidth", "negative_speed", "nan_memory"])
def test_bad_measurements_get_a_clear_planning_error(bad: str) -> None:
    bw, speed, memory = np.full((2, 2), 1e6), [1e12, 1e12], [GB, GB]
    if bad == "nan_bandwidth":
        bw[0, 1] = np.nan
    elif bad == "negative_speed":
        speed[1] = -1.0
    else:
        memory[0] = math.nan
    with pytest.raises(PlanningError, match=r"bandwidth|speed|memory"):
        Topology.from_arrays(["a", "b"], speed, memory, bw)


def test_a_model_that_fits_nowhere_gets_a_planning_error() -> None:
    dag = gpt2_small(seq_len=128, micro_batch=1)
    tiny = Topology.from_arrays(["a", "b"], [1e12, 1e12], [0.1 * GB, 0.1 * GB], np.full((2, 2), 1e9))
    with pytest.raises(PlanningError, match="does not fit"):
        op_fence(dag, tiny, CostConfig())
    with pytest.raises(PlanningError, match="memory"):
        exact_plan(dag, tiny, CostConfig())


def test_exact_solver_agrees_with_brute_force_over_estimate() -> None:
    dag = OpDag.from_unordered(
        [
            OpNode(
                f"n{i}",
                "x",
                (f"n{i - 1}",) if i else (),
                fwd_flops=(i + 1) * 1e11,
                bwd_flops=(i + 1) * 2e11,
                param_bytes=10**6,
                output_bytes=(5 - i) * 10**6,
                saved_bytes=10**5,
            )
            for i in range(5)
        ]
    )
    bw = np.array([[0, 2e8, 3e6], [1e8, 0, 5e7], [4e6, 6e7, 0]])
    topo = Topology.from_arrays(["a", "b", "c"], [1e12, 3e12, 2e12], [GB] * 3, bw, np.full((3, 3), 0.005))
    cost = CostConfig(n_micro_batches=6)
    brute = math.inf
    for k in range(1, 4):
        for seq in itertools.permutations(range(3), k):
            for cuts in itertools.combinations(range(1, 5), k - 1):
                bounds = (0, *cuts, 5)
                stages = [Stage(p, tuple(range(bounds[j], bounds[j + 1]))) for j, p in enumerate(seq)]
                brute = min(brute, estimate(dag, topo, stages, cost).iteration_s)
    assert exact_plan(dag, topo, cost).iteration_s == pytest.approx(brute)
    assert op_fence(dag, topo, cost).iteration_s <= brute * 1.10


def test_op_fence_beats_the_baselines_and_stays_near_the_optimum_on_synthetic_swarms() -> None:
    dag = gpt2_small(seq_len=1024, micro_batch=4)
    cost = CostConfig(n_micro_batches=8)
    gaps = []
    for seed in range(8):
        peers, links, _ = synthetic_swarm(seed, n_peers=4 + seed % 4)
        topo = Topology.from_records(peers, links)
        plan = op_fence(dag, topo, cost)
        assert plan.estimate.fits
        for name in BASELINES:
            for kind in ("none", "uniform", "adaptive"):
                assert plan.iteration_s <= baseline_plan(name, dag, topo, cost, kind).iteration_s
        gaps.append(plan.iteration_s / exact_plan(dag, topo, cost).iteration_s - 1)
    assert min(gaps) >= -1e-9  # the optimum is a lower bound
    assert float(np.median(gaps)) <= 0.10


def test_plan_travels_as_small_stage_records() -> None:
    dag = transformer_dag(
        TransformerShape("llama", 4, 256, 4, 1000, 512, 688, 2, False),
        seq_len=64,
        micro_batch=2,
        granularity="sublayer",
    )
    peers, links, _ = synthetic_swarm(3, n_peers=6)
    topo = Topology.from_records(peers, links)
    plan = op_fence(dag, topo, CostConfig())
    records = plan.to_records(plan_id="p1", epoch=3, made_by=topo.peer_ids[0], made_at=1.0)
    wire = [r.to_wire() for r in records]
    assert all(len(w) < 1024 for w in wire)
    back = [PlanStageRecord.from_wire(w) for w in wire]
    assert Plan.stages_from_records(back, dag) == [
        (pid, s.nodes) for pid, s in zip(plan.peer_ids, plan.stages, strict=True)
    ]
    other = transformer_dag(
        TransformerShape("llama", 5, 256, 4, 1000, 512, 688, 2, False), seq_len=64, micro_batch=2
    )
    with pytest.raises(PlanningError, match="OP-DAG"):
        Plan.stages_from_records(back, other)
    spread = baseline_plan("equal-number", dag, topo, CostConfig(), "adaptive")
    spread_records = spread.to_records(plan_id="p2", epoch=1, made_by="x", made_at=0.0)
    assert len(spread_records) == 6
    with pytest.raises(PlanningError, match="stages"):
        Plan.stages_from_records(spread_records[:3] + spread_records[4:], dag)


def _chain(params: list[float], saved: list[float]) -> OpDag:
    return OpDag.from_unordered(
        [
            OpNode(
                f"n{i}",
                "x",
                (f"n{i - 1}",) if i else (),
                fwd_flops=1e11,
                bwd_flops=2e11,
                param_bytes=int(p),
                output_bytes=10**6,
                saved_bytes=int(s),
            )
            for i, (p, s) in enumerate(zip(params, saved, strict=True))
        ]
    )


def _peers(memory: list[float], speed: list[float] | None = None) -> Topology:
    n = len(memory)
    bw = np.full((n, n), 1e9)
    return Topology.from_arrays([f"p{i}" for i in range(n)], speed or [1e12] * n, memory, bw)


def test_a_refusal_names_the_binding_memory_constraint_and_the_knob() -> None:
    cost = CostConfig(n_micro_batches=4)  # weights x4 (grads, Adam moments), 90% of memory usable
    one_big_node = _chain([0.1 * GB, 0.5 * GB, 0.1 * GB], [0.01 * GB] * 3)
    with pytest.raises(PlanningError, match=r"node 'n1' alone needs 2\.01 GiB .* offers 0\.90 GiB usable"):
        op_fence(one_big_node, _peers([GB, GB, GB]), cost)
    big_activations = _chain([0.01 * GB] * 3, [0.1 * GB, 1.5 * GB, 0.1 * GB])
    with pytest.raises(PlanningError, match=r"alone needs .* try a smaller micro-batch"):
        op_fence(big_activations, _peers([GB, GB, GB]), cost)
    too_much_in_total = _chain([0.1 * GB] * 6, [0.01 * GB] * 6)
    with pytest.raises(PlanningError, match=r"needs at least 2\.\d\d GiB over all its stages .* 2 candidate"):
        op_fence(too_much_in_total, _peers([GB, GB]), cost)


def test_a_slow_peer_with_the_memory_a_model_needs_is_a_candidate() -> None:
    # 12 fast small peers and one slow one with the memory; 4 candidates per cluster at most
    dag = _chain([0.3 * GB, 0.3 * GB], [0.01 * GB] * 2)  # 2.4 GiB with grads and Adam moments
    memory = [0.5 * GB] * 12 + [8 * GB]
    speed = [1e13] * 12 + [1e11]
    plan = op_fence(dag, _peers(memory, speed), CostConfig(), max_candidates=4)
    assert plan.estimate.fits and 12 in {s.peer for s in plan.stages}


def test_local_search_only_improves_and_climbs_from_a_poor_plan_towards_the_optimum() -> None:
    dag = _chain([10**6] * 8, [10**5] * 8)
    dag = OpDag.from_unordered(
        [
            OpNode(
                n.id,
                "x",
                n.inputs,
                fwd_flops=(i % 4 + 1) * 1e11,
                bwd_flops=(i % 4 + 1) * 2e11,
                param_bytes=10**6,
                output_bytes=(8 - i) * 10**6,
                saved_bytes=10**5,
            )
            for i, n in enumerate(dag.nodes)
        ]
    )
    bw = np.array([[0, 2e8, 3e6, 1e8], [1e8, 0, 5e7, 2e6], [4e6, 6e7, 0, 9e7], [1e8, 3e6, 8e7, 0]])
    topo = Topology.from_arrays(
        ["a", "b", "c", "d"], [1e12, 3e12, 2e12, 5e11], [GB] * 4, bw, np.full((4, 4), 0.005)
    )
    cost = CostConfig(n_micro_batches=6)
    poor = baseline_plan("equal-number", dag, topo, cost, "none")
    est, stages = improve(dag, topo, cost, list(poor.stages), range(len(topo)))
    again = improve(dag, topo, cost, list(poor.stages), range(len(topo)))
    assert again[1] == stages  # deterministic: every coordinator gets the same plan
    optimum = exact_plan(dag, topo, cost).iteration_s
    assert est.iteration_s < poor.iteration_s * 0.9  # it climbs
    assert est.iteration_s <= optimum * 1.25
    plain = op_fence(dag, topo, cost, local_search=False)
    assert op_fence(dag, topo, cost).iteration_s <= plain.iteration_s  # never worse than the DP's plan


def test_planned_ratios_are_the_least_that_hide_each_link_under_the_bottleneck_compute() -> None:
    # hand-computed: budget 0.1 s; 10 ms latency; fp32 values + 2-byte gaps (6 B per entry), 32 B header
    policy = CompressionPolicy(kind="planned", ratio=1.0, max_ratio=100.0)
    dense = np.array([1e6, 8e6, 8e6, 8e6])  # bytes per micro-batch
    bw = np.array([1e8, 1e8, 1e7, 1e5])  # bytes/s
    got = planned_ratios(dense, bw, 0.01, 0.1, policy, WIRE)
    # 1 MB in 10 ms + 10 ms fits dense; 8 MB at 100 MB/s has room for 9 MB: dense fits too
    assert got[0] == 1.0 and got[1] == 1.0
    # 8 MB at 10 MB/s: 0.9 MB of room -> floor((0.9e6 - 32) / 6) entries of 2e6 values -> ratio 13.33
    assert got[2] == pytest.approx(2e6 / ((0.9e6 - 32) // 6))
    assert got[3] == 100.0  # 9 KB of room would need 1,780x: capped
    wire = WIRE.wire_bytes(8e6, got[2])
    assert 0.01 + wire / 1e7 <= 0.1 + 1e-9  # the chosen ratio does hide the link
    assert 0.01 + WIRE.wire_bytes(8e6, got[2] * 0.95) / 1e7 > 0.1  # and a smaller one would not


def test_the_planned_policy_compresses_only_links_that_would_be_the_bottleneck() -> None:
    dag = _chain([10**6] * 4, [10**5] * 4)  # 1 MB between nodes; 0.3 s of compute per node at 1 TFLOP/s
    fast, slow = 1e9, 1e6  # bytes/s
    bw = np.array([[0, fast, slow], [fast, 0, slow], [slow, slow, 0]])
    topo = Topology.from_arrays(["a", "b", "c"], [1e12] * 3, [GB] * 3, bw, np.full((3, 3), 0.001))
    planned = CompressionPolicy(kind="planned", ratio=1.0, max_ratio=100.0)
    cost = CostConfig(n_micro_batches=4, compression=planned)
    stages = [Stage(0, (0, 1)), Stage(1, (2,)), Stage(2, (3,))]  # compute 0.6, 0.3, 0.3 s
    est = estimate(dag, topo, stages, cost)
    ratios = {(lk.src, lk.dst): lk.ratio for lk in est.links}
    assert ratios[(0, 1)] == 1.0  # 1 MB at 1 GB/s: 2 ms, far under the 0.6 s bottleneck: dense
    # 1 MB at 1 MB/s is 1 s, far over the 0.6 s bottleneck. Its budget is also bounded by the
    # slack: with every link at its 1 ms latency an iteration takes L + (n_b - 1) B =
    # (1.2 s compute + 2 hops x 2 directions x 1 ms) + 3 x 0.6 s = 3.004 s; each of the 4
    # link-directions may add 5% / 4 of that: budget = 1 ms + 0.0375 s = 0.03855 s < 0.6 s.
    budget = 0.001 + 0.05 * 3.004 / 4
    assert ratios[(1, 2)] == pytest.approx(2.5e5 / (((budget - 0.001) * 1e6 - 32) // 6))
    assert 0.001 + WIRE.wire_bytes(1e6, ratios[(1, 2)]) / slow <= budget + 1e-9  # the link is hidden
    assert est.bottleneck_s == pytest.approx(0.6)  # the compressed link is no longer the bottleneck
    dense = estimate(
        dag, topo, stages, CostConfig(n_micro_batches=4, compression=CompressionPolicy(kind="none"))
    )
    assert dense.bottleneck_s > 1.0 and est.pipelined_s < dense.pipelined_s
    assert op_fence(dag, topo, cost).iteration_s <= est.iteration_s + 1e-9
