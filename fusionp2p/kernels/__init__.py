"""CUDA kernels, installed as ``fusionp2p.kernels`` (CuPy comes with ``fusionp2p[cuda]``).

- ``topk_select.py``: exact Top-K on CUDA by a sampled threshold, an atomic compaction
  kernel (``kernels/select_above.cu`` at the top of the repository, compiled from its
  text by CuPy), and ``torch.topk`` on the few candidates. CPU reference:
  ``fusionp2p.compression.topk.topk_reference``; test: ``tests/test_kernels_cuda.py``.

CuPy is imported lazily, on the first call, with an actionable message when missing.
"""

from fusionp2p.kernels.topk_select import cuda_source, topk_cuda

__all__ = ["cuda_source", "topk_cuda"]
