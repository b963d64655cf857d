"""Wire limits every reader enforces, whichever message carries the number."""

from __future__ import annotations

__all__ = [
    "AVERAGING_CODECS",
    "MAX_EPOCH",
    "MAX_MICRO_BATCHES",
    "MAX_NODES",
    "MAX_REPLICAS",
    "MAX_STAGES",
    "MAX_TOPK_RATIO",
    "MAX_UNACKED",
]

MAX_MICRO_BATCHES = 4096  # micro-batches of one iteration
MAX_STAGES = 1024  # stages of one plan or job (a peer may allow fewer: ExecLimits.max_stages)
MAX_REPLICAS = 256  # data-parallel replicas of one job
# how replicas send the gradients they average (hivemind's codecs): bytes per fp32 value
AVERAGING_CODECS: dict[str, int] = {"none": 4, "fp16": 2}
MAX_NODES = 1 << 20  # OP-DAG positions an assignment may name
MAX_TOPK_RATIO = 1000.0  # no link is compressed harder than this
MAX_EPOCH = 1 << 53  # a coordinator epoch (readers keep real ones far below: coordination.election)
MAX_UNACKED = 64  # OpData messages a sender keeps unacknowledged on one stream (its window)
