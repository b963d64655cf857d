"""Measured iteration time of a planned pipeline next to the cost model's estimate for it.

    python -m benchmarks.pipeline_bench [--micro-batches 1 2 4 8 16] [--json out.json]

A local swarm of 3 peer processes; this process is the data owner. A GPT-2-style model is
planned over the peers with the equal-computation baseline (so all 3 get a stage: 4
runtime stages with the data owner's) and trained for a few iterations per number of
micro-batches. Per row: the median measured iteration (forward, backward and optimizer
step on every stage), the cost model's pipelined estimate of the partition that really
runs (``Pipeline.estimate``: the data owner's stage and its links included, each peer as
its own device), and, because every peer here shares this machine's cores, the same
estimate with compute serialized over the machine (no two stages compute at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from fusionp2p.launch import LocalSwarm
from fusionp2p.records import ModelSpec
from fusionp2p.swarm import Swarm

SPEC = ModelSpec(
    "gpt2",
    {"n_layer": 8, "n_embd": 512, "n_head": 8, "vocab_size": 4096, "n_positions": 128},
    input_shape=(4, 128),
)


def run(micro_batches: list[int], iterations: int) -> list[dict[str, float]]:
    rows = []
    with (
        LocalSwarm(
            3, swarm="pipebench", log_level="warning", peer_args=[["--no-coordinator"]] * (3)
        ) as local,
        Swarm(local.initial_peers, swarm=local.swarm) as swarm,
    ):
        while len(swarm.peers()) < 3:
            time.sleep(0.5)
        owner = swarm.data_owner()
        topology = owner.topology()
        vocab = SPEC.config["vocab_size"]
        for n_mb in micro_batches:
            plan = owner.plan(SPEC, method="equal-computation/none", n_micro_batches=n_mb, topology=topology)
            with owner.pipeline(SPEC, plan=plan) as pipe:
                est = pipe.estimate(topology)
                times = []
                for it in range(iterations + 1):  # the first one warms up
                    batches = [
                        (x, x) for x in (torch.randint(0, vocab, SPEC.input_shape) for _ in range(n_mb))
                    ]
                    start = time.perf_counter()
                    pipe.train_step(batches)
                    if it:
                        times.append(time.perf_counter() - start)
                measured = statistics.median(times)
                serialized = max(est.scheduled_s, n_mb * sum(est.compute_s))
                rows.append(
                    {
                        "micro_batches": n_mb,
                        "stages": pipe.partition.n_stages,
                        "measured_s": measured,
                        "estimate_s": est.scheduled_s,  # the 1F1B schedule played out
                        "bound_s": est.pipelined_s,  # critical path + (n_b - 1) x the busiest
                        "sequential_estimate_s": est.sequential_s,
                        "one_machine_estimate_s": serialized,
                    }
                )
                print(
                    f"  {n_mb:>2} micro-batches: measured {measured:.2f} s, estimate "
                    f"{est.scheduled_s:.2f} s (bound {est.pipelined_s:.2f} s), "
                    f"serialized on this machine {serialized:.2f} s",
                    flush=True,
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = run(args.micro_batches, args.iterations)
    print(
        f"\n{'n_mb':>4} {'stages':>6} {'measured s':>10} {'estimate s':>10} {'meas/est':>9} "
        f"{'one-machine s':>13} {'meas/one':>9}"
    )
    for r in rows:
        print(
            f"{r['micro_batches']:>4} {r['stages']:>6} {r['measured_s']:>10.2f} {r['estimate_s']:>10.2f} "
            f"{r['measured_s'] / r['estimate_s']:>8.2f}x {r['one_machine_estimate_s']:>13.2f} "
            f"{r['measured_s'] / r['one_machine_estimate_s']:>8.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
