"""Images a data owner trains a classifier on: scikit-learn's bundled handwritten digits.

1,797 grey 8x8 images of 10 classes, on every machine that has scikit-learn, nothing
downloaded. A ResNet wants larger, 3-channel input: the images are scaled (bilinear) to
``image_size`` pixels and repeated over ``channels``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fusionp2p.training.batches import Batch, seeded_batches

__all__ = ["DIGIT_CLASSES", "DigitImages"]

DIGIT_CLASSES = 10


@dataclass
class DigitImages:
    """Digits as float32 ``[n, channels, size, size]`` images in [0, 1] and int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str = "scikit-learn digits"
    unit: str = "images"
    units_per_sample: int = 1

    @classmethod
    def load(cls, *, image_size: int = 8, channels: int = 1) -> DigitImages:
        from sklearn.datasets import load_digits

        data = load_digits()
        images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if image_size != images.shape[-1]:
            images = torch.nn.functional.interpolate(
                images, size=(image_size, image_size), mode="bilinear", align_corners=False
            )
        images = images.expand(-1, channels, -1, -1).contiguous()
        return cls(images, torch.tensor(data.target, dtype=torch.int64))

    @property
    def n_samples(self) -> int:
        return len(self.labels)

    def describe(self) -> str:
        c, h, w = self.images.shape[1:]
        return f"{self.n_samples} images ({c}x{h}x{w}, {DIGIT_CLASSES} classes) from {self.source}"

    def batches(self, micro_batch_size: int, n_micro_batches: int, *, seed: int) -> Iterator[Batch]:
        """Endless iterations of ``(images, labels)`` micro-batches in a seeded order."""
        return seeded_batches(
            self.n_samples,
            lambda picks: (self.images[picks], self.labels[picks]),
            micro_batch_size,
            n_micro_batches,
            seed=seed,
        )
