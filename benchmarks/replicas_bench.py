"""Samples per second of one pipeline against R data-parallel replicas on local peers.

    python -m benchmarks.replicas_bench [--speed 0.02] [--steps 6] [--replicas 1,2,4]

Four local peers, each computing as a device ``--speed`` times as fast as this machine
(``fusionp2p peer --emulated-speed``: the throttle sleeps the rest, as a slower GPU leaves
the CPU free), so that R replicas can run side by side on a 2-core machine. One GPT-2
job of a fixed global batch (8 micro-batches of 2 x 64 tokens) runs as R pipelines of 2
stages (this process, the data owner, holds the embeddings and the loss; one peer the
blocks), each replica on its own peer, its stage's gradients averaged through hivemind
before every optimizer step (``runtime/replicated.py``). Reported per R: the median step
time after the first, samples per second, scaling efficiency against R = 1, the median
seconds the slowest stage peer spent averaging in a step (with "(g of R)" if an average
had only g replicas), and the replicas' parameters checked to agree at the end
(``Pipeline.check_replicas``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from fusionp2p.config import OptimizerConfig
from fusionp2p.launch import LocalSwarm
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.swarm import Swarm

SPEC = ModelSpec(
    "gpt2",
    {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 64},
    input_shape=(2, 64),
)
N_MB, N_PEERS = 8, 4


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(x, x) for x in (torch.randint(0, 512, SPEC.input_shape, generator=g) for _ in range(N_MB))]


def run(swarm: Swarm, replicas: int, steps: int) -> tuple[float, float, int]:
    """Median seconds per step after the first, median seconds the slowest stage peer spent
    averaging in a step, and the fewest replicas in any average; raises if the replicas
    diverged."""
    options = JobOptions(n_micro_batches=N_MB, optimizer=OptimizerConfig(lr=1e-3), timeout=300)
    with swarm.data_owner().pipeline(SPEC, n_stages=2, replicas=replicas, options=options) as pipe:
        times, averaging, groups = [], [], []
        for step in range(steps):
            began = time.perf_counter()
            pipe.train_step(batches(step), timeout=600)
            times.append(time.perf_counter() - began)
            stages = pipe.stage_averaging()[1:]  # the peers' stages: hivemind's all-reduce
            averaging.append(max(s for s, _ in stages))
            groups.append(min(g for _, g in stages))
        pipe.check_replicas(timeout=120)
    return statistics.median(times[1:]), statistics.median(averaging[1:]), min(groups[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=0.02, help="each peer's emulated device speed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--replicas", default="1,2,4")
    args = parser.parse_args()
    counts = [int(r) for r in args.replicas.split(",")]
    with tempfile.TemporaryDirectory(prefix="fusionp2p-replicas-") as workdir:
        peer_args = [["--no-coordinator", "--probe-period", "60", "--emulated-speed", str(args.speed)]]
        with (
            LocalSwarm(
                N_PEERS, swarm="replicas-bench", workdir=workdir, peer_args=peer_args * N_PEERS
            ) as local,
            Swarm(local.initial_peers, swarm=local.swarm) as swarm,
        ):
            deadline = time.monotonic() + 120
            while len(swarm.peers()) < N_PEERS and time.monotonic() < deadline:
                time.sleep(0.5)
            samples = N_MB * SPEC.input_shape[0]
            print(
                f"GPT-2 {SPEC.config}, {N_MB} micro-batches of {list(SPEC.input_shape)} per step, "
                f"peers at {args.speed}x"
            )
            print(f"{'replicas':>8} {'step s':>8} {'samples/s':>10} {'efficiency':>10} {'averaging s':>11}")
            base = None
            for r in counts:
                step_s, averaging_s, group = run(swarm, r, args.steps)
                rate = samples / step_s
                base = base or rate / r
                shown = "-" if r == 1 else f"{averaging_s:.2f}" + ("" if group == r else f" ({group} of {r})")
                print(f"{r:>8} {step_s:>8.2f} {rate:>10.2f} {rate / (base * r):>10.2f} {shown:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
