"""Iterations a job draws from its data: micro-batches of ``(inputs, labels)``, in a seeded order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

__all__ = ["Batch", "TrainingData", "seeded_batches"]

Batch = list[tuple[torch.Tensor, torch.Tensor]]  # one iteration: (inputs, labels) per micro-batch


class TrainingData(Protocol):
    """A data set a ``JobRun`` draws its iterations from."""

    source: str

    @property
    def unit(self) -> str:
        """What the throughput counts: "tokens" or "images"."""
        ...

    @property
    def units_per_sample(self) -> int: ...

    @property
    def n_samples(self) -> int: ...

    def describe(self) -> str: ...

    def batches(self, micro_batch_size: int, n_micro_batches: int, *, seed: int) -> Iterator[Batch]: ...


def seeded_batches(
    n_samples: int,
    sample: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
    micro_batch_size: int,
    n_micro_batches: int,
    *,
    seed: int,
) -> Iterator[Batch]:
    """Endless iterations of ``n_micro_batches`` micro-batches, the samples drawn without
    replacement in a seeded order; ``sample(indices)`` makes one micro-batch's (inputs,
    labels)."""
    generator = torch.Generator().manual_seed(seed)
    per_iteration = micro_batch_size * n_micro_batches
    while True:
        order = torch.randperm(n_samples, generator=generator).tolist()
        for first in range(0, len(order) - per_iteration + 1, per_iteration):
            picks = order[first : first + per_iteration]
            yield [sample(picks[k : k + micro_batch_size]) for k in range(0, per_iteration, micro_batch_size)]
