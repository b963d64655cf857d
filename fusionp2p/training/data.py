"""What a data owner trains on, by the job's ``[data] kind``: text for causal LMs, images
for classifiers. Either way the samples never leave the data owner's process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from fusionp2p.errors import ConfigError

if TYPE_CHECKING:
    from fusionp2p.training.job_spec import JobSpec

__all__ = ["DATA_KINDS", "Batch", "TrainingData", "load_data", "seeded_batches"]

DATA_KINDS = ("text", "digits")

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


def load_data(job: JobSpec) -> TrainingData:
    """The job's data, by ``[data] kind``: ``"text"`` (a byte-level corpus of ``data_path``,
    "" = the stdlib's source) or ``"digits"`` (scikit-learn's bundled digits as
    ``image_channels`` x ``image_size``² images).

    Raises:
        ConfigError: a missing path, too little text, or an unknown kind.
    """
    # imported here: both modules build on this one's batching
    if job.data_kind == "text":
        from fusionp2p.training.corpus import TextCorpus

        return TextCorpus.load(job.data_path, seq_len=job.seq_len, max_bytes=job.max_bytes)
    if job.data_kind == "digits":
        from fusionp2p.training.images import DigitImages

        return DigitImages.load(image_size=job.image_size, channels=job.image_channels)
    raise ConfigError(f"[data] kind: must be one of {list(DATA_KINDS)}, got {job.data_kind!r:.40}")
