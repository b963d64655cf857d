"""OP-Fence against the baselines and the exact optimum on seeded synthetic swarms.

    python benchmarks/plan_bench.py [--swarms 50] [--n-micro-batches 8] [--ratio 100]

Per swarm: peers, clusters found / made, OP-Fence's estimated pipelined iteration time,
each baseline's (equal-number / equal-computation x none / uniform / adaptive Top-K), the
exact optimum where it runs (chain OP-DAG, <= 7 peers) and OP-Fence's gap to it, and what
the local search after the DP gained. Then OP-Fence against the exact solver on
``--tiny`` seeded tiny swarms (chains of 4-9 nodes, 2-7 peers, half of them memory-tight),
memory-tight swarms (a GPT-2 XL at micro-batch 1 on an asymmetric swarm, GPT-2 small on
small-memory peers, a 200-peer swarm) against a memory-aware lower bound, and the time to
plan 1,000 peers on a 500-node OP-DAG, and a traced GPT-2 small (534 nodes, the data
owner's part pinned to one peer, as a coordinator plans a job) on 200 and 1,000 peers in 8
bandwidth clusters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from fusionp2p.opdag import OpDag, OpNode, TransformerShape, transformer_dag
from fusionp2p.planning import (
    BASELINES,
    CompressionPolicy,
    CostConfig,
    PlanningError,
    Topology,
    baseline_plan,
    cluster_peers,
    exact_plan,
    op_fence,
    synthetic_swarm,
)

GPT2_SMALL = TransformerShape("gpt2", 12, 768, 12, 50257, 1024, 3072, 12, True)
GPT2_LARGE = TransformerShape("gpt2", 36, 1280, 20, 50257, 1024, 5120, 20, True)
GPT2_XL = TransformerShape("gpt2", 48, 1600, 25, 50257, 1024, 6400, 25, True)
COMPRESSIONS = ("none", "uniform", "adaptive")


def compare(swarms: int, cost: CostConfig, exact_max_peers: int) -> int:
    dag = transformer_dag(GPT2_SMALL, seq_len=1024, micro_batch=4, granularity="block")
    names = [f"{b[:9]}/{c[:5]}" for b in BASELINES for c in COMPRESSIONS]
    print(
        f"GPT-2 small OP-DAG ({len(dag)} block-level nodes), micro-batch 4x1024 tokens, "
        f"n_b={cost.n_micro_batches}, user ratio {cost.compression.ratio:g}"
    )
    print(
        f"{'seed':>4} {'peers':>5} {'clus':>4} {'op-fence s':>10} "
        + " ".join(f"{n:>15}" for n in names)
        + f" {'exact s':>8} {'gap':>6} {'plan s':>6} {'LS gain':>7}"
    )
    gaps, wins, worse, ls_gains = [], [], 0, []
    for seed in range(swarms):
        peers, links, labels = synthetic_swarm(seed)
        topo = Topology.from_records(peers, links)
        start = time.perf_counter()
        plan = op_fence(dag, topo, cost)
        took = time.perf_counter() - start
        ls_gains.append(op_fence(dag, topo, cost, local_search=False).iteration_s / plan.iteration_s - 1)
        base = [baseline_plan(b, dag, topo, cost, c).iteration_s for b in BASELINES for c in COMPRESSIONS]
        exact = exact_plan(dag, topo, cost).iteration_s if len(topo) <= exact_max_peers else None
        gap = None if exact is None else plan.iteration_s / exact - 1
        if gap is not None:
            gaps.append(gap)
        best_base = min(base)
        worse += plan.iteration_s > best_base * (1 + 1e-9)
        wins.append(best_base / plan.iteration_s)
        print(
            f"{seed:>4} {len(topo):>5} {len(cluster_peers(topo))}/{max(labels) + 1} "
            f"{plan.iteration_s:>10.3f} "
            + " ".join(f"{b:>15.3f}" for b in base)
            + (f" {exact:>8.3f} {gap * 100:>5.1f}%" if exact is not None else f" {'-':>8} {'-':>6}")
            + f" {took:>6.2f} {ls_gains[-1] * 100:>6.2f}%"
        )
    print(
        f"\nOP-Fence worse than the best baseline on {worse} of {swarms} swarms; "
        f"median speed-up over the best baseline {statistics.median(wins):.2f}x (min {min(wins):.2f}x)"
    )
    print(
        f"local search after the DP: median gain {statistics.median(ls_gains) * 100:.2f}%, "
        f"max {max(ls_gains) * 100:.2f}%, improved {sum(g > 1e-9 for g in ls_gains)} of {swarms} plans"
    )
    if gaps:
        print(
            f"gap to the exact optimum on {len(gaps)} swarms: median {statistics.median(gaps) * 100:.1f}%, "
            f"max {max(gaps) * 100:.1f}%"
        )
    return worse


def chain_dag(n_nodes: int, rng: np.random.Generator) -> OpDag:
    nodes = []
    for i in range(n_nodes):
        flops = float(rng.uniform(1e9, 5e10))
        nodes.append(
            OpNode(
                f"op{i}",
                "synthetic",
                (f"op{i - 1}",) if i else (),
                fwd_flops=flops,
                bwd_flops=2 * flops,
                param_bytes=int(rng.uniform(1e5, 5e7)),
                output_bytes=int(rng.uniform(1e5, 2e7)),
                saved_bytes=int(rng.uniform(1e5, 2e7)),
            )
        )
    return OpDag(tuple(nodes), name=f"chain-{n_nodes}")


def memory_lower_bound(dag: OpDag, topo: Topology, cost: CostConfig) -> float:
    """A bound no plan of a chain OP-DAG beats: ``L + (n_b - 1) x B``. ``B`` is the least
    bottleneck compute per micro-batch at which the peers can host all the work: peer p
    does at most ``min(B x speed_p, cap_p)`` FLOPs, where ``cap_p`` is the most FLOPs of
    nodes whose memory (weights, grads, optimizer state, one micro-batch of activations)
    fits it, as a fractional knapsack. ``L``, the critical path, holds every node's compute
    once: at least the work on the fastest peer, and at least ``B``. Communication is left
    out, so on slow links the bound is loose. ``inf`` when every cap together cannot hold
    the model."""
    flops = np.array([n.fwd_flops + n.bwd_flops for n in dag.nodes])
    mem = np.array([cost.param_multiplier * n.param_bytes + n.saved_bytes for n in dag.nodes], dtype=float)
    order = np.argsort(-flops / np.maximum(mem, 1.0))
    cum_mem, cum_flops = np.cumsum(mem[order]), np.cumsum(flops[order])
    caps = []
    for room in cost.memory_headroom * topo.memory:
        k = int(np.searchsorted(cum_mem, room, side="right"))
        if k >= len(order):
            caps.append(cum_flops[-1])
            continue
        below = (cum_flops[k - 1], cum_mem[k - 1]) if k else (0.0, 0.0)
        caps.append(below[0] + flops[order[k]] * (room - below[1]) / max(mem[order[k]], 1.0))
    cap, work = np.array(caps), flops.sum()
    if cap.sum() < work * (1 - 1e-12):
        return float("inf")
    lo, hi = 0.0, work / topo.speed.max() + work / topo.speed.min()
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if np.minimum(mid * topo.speed, cap).sum() >= work else (mid, hi)
    return max(hi, work / topo.speed.max()) + (cost.n_micro_batches - 1) * hi


def memory_tight(cost: CostConfig) -> None:
    cases = [  # name, model, micro-batch, synthetic_swarm's arguments
        ("GPT-2 XL, micro-batch 1, 12 asymmetric peers", GPT2_XL, 1, dict(n_peers=12, memory_gib=(4, 8, 40))),
        ("GPT-2 small, micro-batch 1, 16 small peers", GPT2_SMALL, 1, dict(n_peers=16, memory_gib=(1, 2))),
        ("GPT-2 large, micro-batch 1, 200 peers", GPT2_LARGE, 1, dict(n_peers=200, memory_gib=(1, 2, 4))),
    ]
    print(
        f"\nmemory-tight swarms (3 clusters; model memory = weights, grads, optimizer, one micro-batch):"
        f"\n{'case':<46} {'need GiB':>8} {'usable':>8} {'op-fence s':>10} {'bound s':>8} {'/bound':>7} "
        f"{'stages':>6} {'plan s':>6}"
    )
    for name, shape, micro_batch, swarm in cases:
        dag = transformer_dag(shape, seq_len=1024, micro_batch=micro_batch, granularity="block")
        peers, links, _ = synthetic_swarm(7, n_clusters=3, **swarm)  # type: ignore[arg-type]
        topo = Topology.from_records(peers, links)
        need = sum(cost.param_multiplier * n.param_bytes + n.saved_bytes for n in dag.nodes) / 2**30
        usable = cost.memory_headroom * topo.memory.sum() / 2**30
        bound = memory_lower_bound(dag, topo, cost)
        start = time.perf_counter()
        try:
            plan = op_fence(dag, topo, cost)
            took = time.perf_counter() - start
            ratio = plan.iteration_s / bound
            got = f"{plan.iteration_s:>10.3f} {bound:>8.3f} {ratio:>6.2f}x {len(plan.stages):>6}"
        except PlanningError as e:
            took = time.perf_counter() - start
            got = f"refused: {e}"[:60]
        print(f"{name:<46} {need:>8.1f} {usable:>8.1f} {got} {took:>6.2f}")


def tiny_case(seed: int) -> tuple[OpDag, Topology]:
    """A chain of 4-9 nodes on 2-7 peers; odd seeds have just 1.2-1.8x the memory needed."""
    rng = np.random.default_rng(seed)
    dag = chain_dag(int(rng.integers(4, 10)), rng)
    n = int(rng.integers(2, 8))
    bw = np.exp(rng.uniform(np.log(1e6), np.log(1e9), (n, n)))
    memory = rng.uniform(0.5, 2.0, n)
    need = sum(4 * node.param_bytes + node.saved_bytes for node in dag.nodes)
    memory *= need * (rng.uniform(1.2, 1.8) if seed % 2 else 20.0) / memory.sum()
    speed = np.exp(rng.uniform(np.log(1e12), np.log(1e13), n))
    return dag, Topology.from_arrays([f"p{i}" for i in range(n)], speed, memory, bw, np.full((n, n), 1e-3))


def versus_exact(count: int, cost: CostConfig) -> None:
    gaps, refused, both_refused = [], 0, 0
    for seed in range(count):
        dag, topo = tiny_case(seed)
        try:
            exact = exact_plan(dag, topo, cost).iteration_s
        except PlanningError:
            exact = None
        try:
            got = op_fence(dag, topo, cost).iteration_s
        except PlanningError:
            got = None
        if exact is None:
            both_refused += got is None
            continue
        if got is None:
            refused += 1
            continue
        gaps.append(got / exact - 1)
    print(
        f"\nOP-Fence vs the exact solver on {count} seeded tiny swarms: placed {len(gaps)} of the "
        f"{len(gaps) + refused} the exact solver places ({both_refused} fit nowhere); gap median "
        f"{statistics.median(gaps) * 100:.2f}%, worst {max(gaps) * 100:.2f}%, exact on "
        f"{sum(g < 1e-9 for g in gaps)}"
    )


def scale(n_peers: int, n_nodes: int, cost: CostConfig) -> None:
    rng = np.random.default_rng(0)
    peers, links, _ = synthetic_swarm(1000, n_peers=n_peers, n_clusters=8)
    start = time.perf_counter()
    topo = Topology.from_records(peers, links)
    built = time.perf_counter() - start
    dag = chain_dag(n_nodes, rng)
    start = time.perf_counter()
    plan = op_fence(dag, topo, cost)
    took = time.perf_counter() - start
    print(
        f"\nscale: {n_peers} peers ({len(links)} links), {n_nodes}-node OP-DAG: topology {built:.2f} s, "
        f"OP-Fence {took:.2f} s -> {len(plan.stages)} stages, {plan.iteration_s:.3f} s per iteration"
    )


def traced_scale(peer_counts: list[int], cost: CostConfig) -> None:
    """A job's plan as a coordinator makes it: a traced GPT-2 small, the data owner framed."""
    from fusionp2p.opdag.offline import OfflineModel, offline_dag
    from fusionp2p.planning.methods import plan_job
    from fusionp2p.planning.owner import OwnerFrame, owner_part
    from fusionp2p.planning.replicas import plan_replicas

    dag = offline_dag(OfflineModel("gpt2", {}, seq_len=1024, micro_batch=4, trace=True))
    for n_peers in peer_counts:
        peers, links, _ = synthetic_swarm(1000, n_peers=n_peers, n_clusters=8)
        topo = Topology.from_records(peers, links)
        start = time.perf_counter()
        plan = plan_job(dag, topo, topo.peer_ids[0], method="op-fence", cost=cost)
        took = time.perf_counter() - start
        print(
            f"traced GPT-2 small ({len(dag)} nodes, data owner framed), {n_peers} peers in 8 clusters: "
            f"OP-Fence {took:.2f} s -> {len(plan.stages)} stages, {plan.iteration_s:.3f} s per iteration"
        )
        part = owner_part(dag)
        assert part is not None
        frame = OwnerFrame(0, part)  # peer 0 is the data owner, as in plan_job above
        start = time.perf_counter()
        auto = plan_replicas(dag, topo, cost, "auto", frame=frame)
        took = time.perf_counter() - start
        rates = []
        for r in (1, 2, 4, 8):
            try:
                rate = plan_replicas(dag, topo, cost, r, frame=frame).micro_batches_per_s
                rates.append(f"R={r} {rate:.1f}")
            except PlanningError:
                rates.append(f"R={r} no fit")
        print(
            f"  replicas 'auto' {took:.2f} s -> R={len(auto.replicas)} of {len(auto.replicas[0])} stages, "
            f"{auto.micro_batches_per_s:.1f} micro-batches/s (step {auto.step_s:.3f} s, averaging "
            f"{max(auto.averaging_s):.3f} s); each R: {', '.join(rates)}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swarms", type=int, default=50)
    parser.add_argument("--n-micro-batches", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=100.0)
    parser.add_argument("--exact-max-peers", type=int, default=7)
    parser.add_argument("--tiny", type=int, default=50, help="seeded tiny swarms against the exact solver")
    parser.add_argument("--scale-peers", type=int, default=1000)
    parser.add_argument("--scale-nodes", type=int, default=500)
    args = parser.parse_args()
    cost = CostConfig(n_micro_batches=args.n_micro_batches, compression=CompressionPolicy(ratio=args.ratio))
    worse = compare(args.swarms, cost, args.exact_max_peers) if args.swarms else 0
    if args.tiny:
        versus_exact(args.tiny, cost)
    memory_tight(cost)
    if args.scale_peers:
        scale(args.scale_peers, args.scale_nodes, cost)
        traced_scale([200, args.scale_peers], cost)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
