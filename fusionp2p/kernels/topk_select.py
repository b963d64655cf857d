"""Exact Top-K on CUDA: sampled threshold, atomic compaction kernel, topk of the candidates."""

from __future__ import annotations

import importlib.resources
import math
from typing import Any

import torch

__all__ = ["cuda_source", "topk_cuda"]

_SAMPLE = 100_000
_SLACK = 1.5
_THREADS = 256
_kernel: Any = None
SOURCES = "cuda_sources"  # the repository's kernels/, shipped in the wheel under this name


def cuda_source(name: str) -> str:
    """The text of the CUDA source ``name`` (``kernels/`` at the top of the repository, as
    package data ``fusionp2p/cuda_sources`` in an installed wheel)."""
    return importlib.resources.files("fusionp2p").joinpath(SOURCES, name).read_text()


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "fusionp2p's CUDA kernels need CuPy: pip install 'fusionp2p[cuda]' (or cupy-cuda12x)"
        ) from e
    return cupy


def _select_kernel() -> Any:
    global _kernel
    if _kernel is None:
        module = _cupy().RawModule(code=cuda_source("select_above.cu"))
        _kernel = module.get_function("select_above")
    return _kernel


def topk_cuda(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, sorted) of the k largest-magnitude entries of a 1-D CUDA tensor."""
    n = flat.numel()
    if n < (1 << 19) or 4 * k > n:
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    cupy = _cupy()
    x = flat.detach().float().contiguous()
    sample = x[torch.randint(0, n, (_SAMPLE,), device=x.device)].abs()
    wanted = min(_SAMPLE, max(1, math.ceil(_SAMPLE * k / n * _SLACK)))
    threshold = float(torch.topk(sample, wanted, sorted=False).values.min())
    capacity = max(2 * k, 1024)
    out = torch.empty(capacity, dtype=torch.int64, device=x.device)
    count = torch.zeros(1, dtype=torch.int64, device=x.device)
    blocks = min(65535, (n + _THREADS - 1) // _THREADS)
    with cupy.cuda.Device(x.device.index or 0):
        _select_kernel()(
            (blocks,),
            (_THREADS,),
            (
                cupy.from_dlpack(x),
                cupy.int64(n),
                cupy.float32(threshold),
                cupy.from_dlpack(out),
                cupy.from_dlpack(count),
                cupy.int64(capacity),
            ),
        )
    found = int(count.item())
    if found < k or found > capacity:  # the sample misjudged: exact but slower
        return torch.topk(x.abs(), k, sorted=False).indices.sort().values
    candidates = out[:found]
    chosen = torch.topk(x.index_select(0, candidates).abs(), k, sorted=False).indices
    return candidates.index_select(0, chosen).sort().values
