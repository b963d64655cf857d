"""Samples per second of one pipeline against R data-parallel replicas on local peers.

    python -m benchmarks.replicas_bench [--model gpt2|resnet] [--speed 0.02] [--steps 6]
                                        [--replicas 1,2,4,8]

As many local peers as the largest R, each computing as a device ``--speed`` times as
fast as this machine (``fusionp2p peer --emulated-speed``: the throttle sleeps the rest,
as a slower GPU leaves the CPU free), so that R replicas can run side by side on a 2-core
machine. One job of a fixed global batch (8 micro-batches: of 2 x 64 tokens for a 4-layer
GPT-2, of 4 images of 3 x 32 x 32 for a ResNet-18 of width 16) runs as R pipelines of 2
stages (this process, the data owner, holds the first and last operators and the loss;
one peer the rest), each replica on its own peer, its stage's gradients averaged through
hivemind before every optimizer step (``runtime/replicated.py``). Reported per R: the
median step time after the first, samples per second, scaling efficiency against R = 1,
the median seconds the slowest stage peer spent averaging in a step (with "(g of R)" if
an average had only g replicas) against the cost model's estimate of that all-reduce
(``planning.replicas.averaging_seconds`` over the links the peers measured), and the
replicas' parameters checked to agree at the end (``Pipeline.check_replicas``).
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
from fusionp2p.planning import Topology
from fusionp2p.planning.replicas import averaging_seconds
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.replicated import ReplicatedDriver
from fusionp2p.swarm import Swarm
from fusionp2p.training.pipeline import Pipeline

SPECS = {
    "gpt2": ModelSpec(
        "gpt2",
        {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 64},
        input_shape=(2, 64),
    ),
    "resnet": ModelSpec(
        "resnet",
        {"depth": 18, "num_classes": 10, "width": 16},
        input_shape=(4, 3, 32, 32),
        input_dtype="float32",
    ),
}
LOSS = {"gpt2": "lm", "resnet": "classification"}
N_MB = 8


def batches(model: str, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    shape = SPECS[model].input_shape
    if model == "resnet":
        return [
            (torch.randn(shape, generator=g), torch.randint(0, 10, shape[:1], generator=g))
            for _ in range(N_MB)
        ]
    return [(x, x) for x in (torch.randint(0, 512, shape, generator=g) for _ in range(N_MB))]


def estimated_averaging(swarm: Swarm, pipe: Pipeline) -> float | None:
    """The cost model's all-reduce seconds for the peers' stage, over the links they measured
    (None while a link between two of them is not measured yet)."""
    driver = pipe.driver
    if not isinstance(driver, ReplicatedDriver):
        return None
    dag, partition = driver.traced.dag, driver.partition
    topo = Topology.from_records(swarm.peers(), swarm.links())
    row = {p: i for i, p in enumerate(topo.peer_ids)}
    worst = 0.0
    for stage in range(partition.n_stages):
        if stage == partition.data_stage:
            continue
        grad_bytes = sum(n.param_bytes for n in dag.nodes if partition.stage_of.get(n.id) == stage)
        owners = [replica.setups[stage].peers[stage][0] for replica in driver.replicas]
        if any(p not in row for p in owners):
            return None
        peers = [row[p] for p in owners]
        if any(topo.bandwidth[a, b] <= 0 for a in peers for b in peers if a != b):
            return None
        worst = max(worst, averaging_seconds(float(grad_bytes), peers, topo))
    return worst


def run(swarm: Swarm, model: str, replicas: int, steps: int) -> tuple[float, float, int, float | None]:
    """Median seconds per step after the first, median seconds the slowest stage peer spent
    averaging in a step, the fewest replicas in any average, and the estimate of that
    averaging; raises if the replicas diverged."""
    options = JobOptions(
        n_micro_batches=N_MB, optimizer=OptimizerConfig(lr=1e-3), timeout=300, loss=LOSS[model]
    )
    with swarm.data_owner().pipeline(SPECS[model], n_stages=2, replicas=replicas, options=options) as pipe:
        times, averaging, groups = [], [], []
        for step in range(steps):
            began = time.perf_counter()
            pipe.train_step(batches(model, step), timeout=600)
            times.append(time.perf_counter() - began)
            stages = pipe.stage_averaging()[1:]  # the peers' stages: hivemind's all-reduce
            averaging.append(max(s for s, _ in stages))
            groups.append(min(g for _, g in stages))
        pipe.check_replicas(timeout=120)
        estimate = estimated_averaging(swarm, pipe)
    return statistics.median(times[1:]), statistics.median(averaging[1:]), min(groups[1:]), estimate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="gpt2")
    parser.add_argument("--speed", type=float, default=0.02, help="each peer's emulated device speed")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--replicas", default="1,2,4")
    args = parser.parse_args()
    counts = [int(r) for r in args.replicas.split(",")]
    n_peers = max(counts)
    spec = SPECS[args.model]
    with tempfile.TemporaryDirectory(prefix="fusionp2p-replicas-") as workdir:
        peer_args = [["--no-coordinator", "--probe-period", "20", "--emulated-speed", str(args.speed)]]
        with (
            LocalSwarm(
                n_peers, swarm="replicas-bench", workdir=workdir, peer_args=peer_args * n_peers
            ) as local,
            Swarm(local.initial_peers, swarm=local.swarm) as swarm,
        ):
            deadline = time.monotonic() + 120
            while len(swarm.peers()) < n_peers and time.monotonic() < deadline:
                time.sleep(0.5)
            samples = N_MB * spec.input_shape[0]
            print(
                f"{spec.family} {spec.config}, {N_MB} micro-batches of {list(spec.input_shape)} per step, "
                f"{n_peers} peers at {args.speed}x"
            )
            print(
                f"{'replicas':>8} {'step s':>8} {'samples/s':>10} {'efficiency':>10} {'averaging s':>11} "
                f"{'estimate s':>10}"
            )
            base = None
            for r in counts:
                step_s, averaging_s, group, estimate = run(swarm, args.model, r, args.steps)
                rate = samples / step_s
                base = base or rate / r
                shown = "-" if r == 1 else f"{averaging_s:.2f}" + ("" if group == r else f" ({group} of {r})")
                guess = "-" if estimate is None else f"{estimate:.3f}"
                print(
                    f"{r:>8} {step_s:>8.2f} {rate:>10.2f} {rate / (base * r):>10.2f} {shown:>11} {guess:>10}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
