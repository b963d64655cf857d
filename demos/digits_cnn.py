"""Train a two-layer CNN on scikit-learn's bundled digits, split over local peer processes.

    python demos/digits_cnn.py [--peers 2] [--epochs 4]

Starts a local swarm (real `fusionp2p peer` processes on loopback), splits the CNN into
``peers + 1`` stages: this process is the data owner (it reads the images, runs the first
convolution, computes the loss and never sends an image or a label), every peer runs one
more stage. Prints the loss per step with a progress bar, then the test accuracy of the
trained weights, fetched back from the peers. Every process it starts ends with it.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
from sklearn.datasets import load_digits
from tqdm import tqdm

from fusionp2p.config import OptimizerConfig
from fusionp2p.launch import LocalSwarm
from fusionp2p.opdag.spec import build_model
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.swarm import Swarm


def digits(
    batch: int, seed: int = 0
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """Training micro-batches of ``batch`` images (the rest dropped) and a 20% test split."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = len(labels) // 5
    test, train = order[:n_test], order[n_test:]
    batches = [
        (images[train[i : i + batch]], labels[train[i : i + batch]])
        for i in range(0, len(train) - batch + 1, batch)
    ]
    return batches, images[test], labels[test]


def train(
    args: argparse.Namespace,
    spec: ModelSpec,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    local: LocalSwarm,
) -> dict[str, torch.Tensor] | None:
    """Trains over the local swarm's peers; the trained weights (None if the swarm did not form)."""
    steps_per_epoch = len(batches) // args.micro_batches
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        deadline = time.monotonic() + 60
        while len(swarm.peers()) < args.peers:
            if time.monotonic() > deadline:
                print(f"error: the peers did not join; logs in {local.workdir}", file=sys.stderr)
                return None
            time.sleep(0.5)
        options = JobOptions(
            n_micro_batches=args.micro_batches, optimizer=OptimizerConfig(lr=args.lr), loss="classification"
        )
        with swarm.data_owner().pipeline(spec, n_stages=args.peers + 1, options=options) as pipeline:
            part = pipeline.partition
            for stage in range(part.n_stages):
                owner = "this process (data owner)" if stage == 0 else pipeline.peers[stage - 1].peer_id[:16]
                n_ops = sum(len(s.nodes) for s in part.stage_segments(stage) if s.kind == "ops")
                print(f"  stage {stage}: {n_ops:3d} operators on {owner}")
            for epoch in range(args.epochs):
                bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step")
                for step in bar:
                    group = batches[step * args.micro_batches : (step + 1) * args.micro_batches]
                    bar.set_postfix(loss=f"{pipeline.train_step(group):.4f}")
                bar.close()
            return pipeline.fetch("params")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2, help="peer processes (stages = peers + 1)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="images per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    spec = ModelSpec("digits-cnn", {"channels": 16}, input_shape=(args.batch, 1, 8, 8), input_dtype="float32")
    batches, test_x, test_y = digits(args.batch)
    print(f"digits: {len(batches) * args.batch} training images, {len(test_y)} test images", flush=True)
    print(f"starting {args.peers} local peers...", flush=True)
    started = time.monotonic()
    # no coordinator: this demo splits the model by hand (a swarm with one runs only its plans)
    no_coordinator = [["--no-coordinator"]] * args.peers
    with LocalSwarm(args.peers, swarm="digits", log_level="warning", peer_args=no_coordinator) as local:
        weights = train(args, spec, batches, local)
    if weights is None:
        return 1
    model = build_model(spec)
    model.load_state_dict(weights)
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    elapsed = time.monotonic() - started
    print(f"test accuracy: {accuracy:.1%} after {args.epochs} epochs ({elapsed:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
