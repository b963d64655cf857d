"""OP-Fence against the baselines and the exact optimum on seeded synthetic swarms.

    python benchmarks/plan_bench.py [--swarms 50] [--n-micro-batches 8] [--ratio 100]

Per swarm: peers, clusters found / made, OP-Fence's estimated pipelined iteration time,
each baseline's (equal-number / equal-computation x none / uniform / adaptive Top-K), the
exact optimum where it runs (chain OP-DAG, <= 7 peers) and OP-Fence's gap to it. Then the
medians, and the time to plan 1,000 peers on a 500-node OP-DAG.
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
    Topology,
    baseline_plan,
    cluster_peers,
    exact_plan,
    op_fence,
    synthetic_swarm,
)

GPT2_SMALL = TransformerShape("gpt2", 12, 768, 12, 50257, 1024, 3072, 12, True)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swarms", type=int, default=50)
    parser.add_argument("--n-micro-batches", type=int, default=8)
    parser.add_argument("--ratio", type=float, default=100.0)
    parser.add_argument("--exact-max-peers", type=int, default=7)
    parser.add_argument("--scale-peers", type=int, default=1000)
    parser.add_argument("--scale-nodes", type=int, default=500)
    args = parser.parse_args()
    cost = CostConfig(n_micro_batches=args.n_micro_batches, compression=CompressionPolicy(ratio=args.ratio))
    worse = compare(args.swarms, cost, args.exact_max_peers)
    if args.scale_peers:
        scale(args.scale_peers, args.scale_nodes, cost)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
