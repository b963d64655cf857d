"""CUDA kernels, installed as ``fusionp2p.kernels`` (CuPy comes with ``fusionp2p[cuda]``).

- ``topk_select.py``: exact Top-K on CUDA by a sampled threshold, an atomic compaction
  kernel, and ``torch.topk`` on the few candidates. CPU reference:
  ``fusionp2p.compression.topk.topk_reference``; test: ``tests/test_kernels_cuda.py``.

CuPy is imported lazily, on the first call, with an actionable message when missing.
"""

from fusionp2p.kernels.topk_select import topk_cuda

__all__ = ["topk_cuda"]
