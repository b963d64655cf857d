"""The losses a data owner computes on its own stage (they never leave it), by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["LOSSES", "LossFn", "classification_loss", "lm_loss"]

LossFn = Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor]


def lm_loss(outputs: Sequence[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM's logits against ``labels`` (the input ids)."""
    logits = outputs[0]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
    )


def classification_loss(outputs: Sequence[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits against integer labels."""
    return torch.nn.functional.cross_entropy(outputs[0], labels)


LOSSES: dict[str, LossFn] = {"lm": lm_loss, "classification": classification_loss}
