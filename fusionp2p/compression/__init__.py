"""Top-K compression of activations and gradients (FusionLLM §5).

- ``topk.py``: the reference selection (the spec), the fast exact CPU path, the dispatcher
  to ``fusionp2p.kernels`` on CUDA, and row-wise selection (what the runtime sends).
- ``wire.py``: the wire format (values fp32/fp16/bf16; int32, delta16 or bitmap indices)
  and its strict decoder; ``encode_at``/``decode_at`` send an activation's gradient at the
  forward's kept indices (the exact gradient of the compressed forward, no index bytes).
- ``feedback.py``: error feedback per link and tensor, bounded; a link's compressor.

(Ratio warm-up, a job setting, is ``config.RatioWarmup``.) The layers and how they fit:
``docs/architecture.md``.
"""

from fusionp2p.compression.feedback import ErrorFeedback, LinkCompressor
from fusionp2p.compression.topk import k_for_ratio, topk_fast, topk_indices, topk_reference, topk_rows
from fusionp2p.compression.wire import (
    Encoded,
    PayloadError,
    decode,
    decode_at,
    encode,
    encode_at,
    paper_bytes,
)

__all__ = [
    "Encoded",
    "ErrorFeedback",
    "LinkCompressor",
    "PayloadError",
    "decode",
    "decode_at",
    "encode",
    "encode_at",
    "k_for_ratio",
    "paper_bytes",
    "topk_fast",
    "topk_indices",
    "topk_reference",
    "topk_rows",
]
