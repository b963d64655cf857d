"""Top-K selection: the reference (the spec) and a fast exact CPU path.

``topk_reference`` is ``torch.topk`` on magnitudes: what every fast path and kernel is
tested against. ``topk_fast`` finds a threshold from a random sample, keeps the entries
above it (a superset of the top k with high probability) and runs ``torch.topk`` on those
few: exactly k indices, the same set as the reference up to ties, several times faster
on large tensors. When the sample misjudges (fewer than k candidates) it falls back to
the reference, so it is never wrong, only occasionally not faster.

``topk_rows`` keeps the k largest of each row (the last dimension) instead: every token
of an activation keeps its strongest features, where a global Top-K can drop whole
tokens. It converges better at the same ratio (benchmarks/convergence.py) and keeps every
gap between kept positions under twice the row length, so the indices go as 2-byte gaps.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FAST_MIN_NUMEL", "k_for_ratio", "topk_fast", "topk_indices", "topk_reference", "topk_rows"]

FAST_MIN_NUMEL = 1 << 19  # below this torch.topk is as fast (measured: benchmarks/compression_bench.py)
_SAMPLE = 100_000
_SLACK = 1.5  # aim for 1.5 k candidates, so the sampled threshold rarely lands above the k-th


def k_for_ratio(numel: int, ratio: float) -> int:
    """Entries kept at ratio ``ratio`` (keep numel / ratio, at least one)."""
    if ratio < 1:
        raise ValueError(f"a Top-K ratio must be >= 1, got {ratio}")
    return max(1, min(numel, math.ceil(numel / ratio)))


def topk_reference(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (sorted ascending, int64) of the k largest-magnitude entries of a 1-D tensor."""
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def topk_fast(flat: torch.Tensor, k: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Same contract as ``topk_reference``, by sampled threshold + exact refinement."""
    n = flat.numel()
    if n < FAST_MIN_NUMEL or k * 4 > n:
        return topk_reference(flat, k)
    mag = flat.abs()
    sample = mag[torch.randint(0, n, (_SAMPLE,), generator=generator, device=flat.device)]
    wanted = min(_SAMPLE, max(1, math.ceil(_SAMPLE * k / n * _SLACK)))
    threshold = torch.topk(sample, wanted, sorted=False).values.min()
    candidates = (mag >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return topk_reference(flat, k)
    chosen = torch.topk(mag.index_select(0, candidates), k, sorted=False).indices
    return candidates.index_select(0, chosen).sort().values


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The dispatcher: CUDA kernel on GPUs when CuPy is there, else the fast CPU path."""
    if flat.is_cuda:
        from fusionp2p.kernels import topk_cuda

        return topk_cuda(flat, k)
    return topk_fast(flat, k)


def topk_rows(tensor: torch.Tensor, k_row: int) -> torch.Tensor:
    """Flat indices (sorted ascending, int64) of the ``k_row`` largest-magnitude entries
    of each row along ``tensor``'s last dimension."""
    width = tensor.shape[-1]
    if not 1 <= k_row <= width:
        raise ValueError(f"k_row must be in [1, {width}], got {k_row}")
    rows = tensor.detach().reshape(-1, width)
    local = torch.topk(rows.abs(), k_row, dim=1, sorted=False).indices.sort(dim=1).values
    offsets = torch.arange(rows.shape[0], device=rows.device).unsqueeze(1) * width
    return (local + offsets).reshape(-1)
