"""Error feedback: what Top-K dropped from a gradient is added to the next one on that link.

One residual per (link, tensor name), on the tensor's device. Memory is bounded: past
``max_bytes`` the least recently used residuals are dropped (and counted). ``reset()``
on re-plan, since links and ratios change.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable

import torch

from fusionp2p.compression.wire import Encoded, encode

__all__ = ["ErrorFeedback", "LinkCompressor"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residuals of gradients sent over compressed links."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._residuals: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def compress(
        self, key: Hashable, grad: torch.Tensor, ratio: float, *, value_dtype: str = "float32"
    ) -> Encoded:
        """Compresses ``grad`` plus the residual kept under ``key``; keeps the new residual."""
        residual = self._residuals.pop(key, None)
        if residual is not None:
            self._bytes -= residual.numel() * residual.element_size()
        corrected = grad if residual is None or residual.shape != grad.shape else grad + residual
        encoded = encode(corrected, ratio, value_dtype=value_dtype)
        if encoded.header.index_format == "dense" and value_dtype == "float32":
            return encoded  # nothing dropped, nothing to carry
        new = corrected.detach().clone().reshape(-1)
        new.index_add_(0, encoded.indices, -encoded.values.reshape(-1))
        size = new.numel() * new.element_size()
        while self._residuals and self._bytes + size > self.max_bytes:
            _, old = self._residuals.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
            self.evicted += 1
        if size <= self.max_bytes:
            self._residuals[key] = new.reshape(grad.shape)
            self._bytes += size
        else:
            logger.warning("a %d-byte residual exceeds the error-feedback budget; sending without it", size)
        return encoded

    def reset(self) -> None:
        """Forgets every residual (call on re-plan)."""
        self._residuals.clear()
        self._bytes = 0


class LinkCompressor:
    """Compression of one link of a Plan: its ratio, activations plain, gradients with feedback."""

    def __init__(
        self, ratio: float, *, value_dtype: str = "float32", feedback: ErrorFeedback | None = None
    ) -> None:
        self.ratio = ratio
        self.value_dtype = value_dtype
        self.feedback = feedback

    def activations(self, tensor: torch.Tensor) -> Encoded:
        """Compresses a forward activation (no feedback: each micro-batch is a new tensor)."""
        return encode(tensor, self.ratio, value_dtype=self.value_dtype)

    def gradient(self, key: Hashable, grad: torch.Tensor) -> Encoded:
        """Compresses a backward gradient, with error feedback when this link has it."""
        if self.feedback is None:
            return encode(grad, self.ratio, value_dtype=self.value_dtype)
        return self.feedback.compress(key, grad, self.ratio, value_dtype=self.value_dtype)
