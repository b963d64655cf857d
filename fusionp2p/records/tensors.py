"""Records that travel with tensors on the exec protocol: OpData (FusionLLM §3.4) and the
Top-K body's header; the table of the dtypes a tensor may have on the wire."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from fusionp2p.errors import RecordError
from fusionp2p.records.wire import WireRecord

__all__ = [
    "FLOAT_DTYPES",
    "OPDATA_DIRECTIONS",
    "OPDATA_DTYPES",
    "TOPK_INDEX_FORMATS",
    "TOPK_VALUE_DTYPES",
    "WIRE_DTYPES",
    "OpData",
    "TopKHeader",
]

# every dtype a tensor may have on the wire (little-endian), and its bytes per element;
# the names are torch's (``getattr(torch, name)``)
WIRE_DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
TOPK_VALUE_DTYPES = ("float32", "float16", "bfloat16")  # what Top-K compresses and sends
TOPK_INDEX_FORMATS = ("dense", "int32", "delta16", "bitmap", "shared")


@dataclass(frozen=True)
class TopKHeader(WireRecord):
    """How a Top-K-compressed tensor's body is laid out (carried in OpData's compression metadata).

    body = index section (``index_bytes``) followed by the values (``k`` x value dtype).
    ``shared``: no index section; the values sit at the indices of the forward message
    this is the gradient of, which both ends already hold.
    """

    KIND: ClassVar[str] = "topk"

    shape: tuple[int, ...]  # the dense tensor's shape
    dtype: str  # the dense tensor's dtype name
    value_dtype: str  # dtype of the kept values on the wire, one of TOPK_VALUE_DTYPES
    index_format: str  # one of TOPK_INDEX_FORMATS ("dense": no indices, every value sent)
    numel: int
    k: int  # entries kept
    index_bytes: int
    ratio: float  # the ratio asked for (numel / k when it was applied)
    base: int = 0  # delta16: the first index

    def __post_init__(self) -> None:
        if self.value_dtype not in TOPK_VALUE_DTYPES or self.dtype not in TOPK_VALUE_DTYPES:
            raise RecordError(
                f"TopKHeader dtypes must be in {TOPK_VALUE_DTYPES}, got {self.dtype}/{self.value_dtype}"
            )
        if self.index_format not in TOPK_INDEX_FORMATS:
            raise RecordError(
                f"TopKHeader.index_format must be in {TOPK_INDEX_FORMATS}, got {self.index_format!r}"
            )
        if any(d < 0 for d in self.shape) or math.prod(self.shape) != self.numel:
            raise RecordError(f"TopKHeader shape {self.shape} does not hold numel {self.numel}")
        if not 0 <= self.k <= self.numel or self.index_bytes < 0 or self.base < 0:
            raise RecordError(
                f"TopKHeader needs 0 <= k <= numel and sizes >= 0, got k={self.k}, numel={self.numel}"
            )


OPDATA_DIRECTIONS = ("forward", "backward")
OPDATA_DTYPES = tuple(WIRE_DTYPES)


@dataclass(frozen=True)
class OpData(WireRecord):
    """The header of one tensor crossing from one sub-DAG to another (FusionLLM §3.4).

    Forward: the output of ``producer`` for ``consumers`` (nodes of the receiving stage).
    Backward: the gradient of ``producer``'s output from ``consumers``' side. The tensor's
    bytes follow the header in the same message; ``compression`` holds a ``TopKHeader``
    when they are Top-K-compressed, and is empty for dense little-endian bytes.
    """

    KIND: ClassVar[str] = "opdata"

    job: str  # the job (plan) this belongs to; other jobs' OpData is rejected
    direction: str  # "forward" or "backward"
    producer: str  # OP-DAG node whose output (or its gradient) this is
    consumers: tuple[str, ...]  # OP-DAG nodes on the consuming side
    requires_grad: bool  # forward: the receiver must send a gradient back
    iteration: int
    micro_batch: int
    shape: tuple[int, ...]
    dtype: str  # one of OPDATA_DTYPES
    body_bytes: int  # length of the bytes that follow the header
    compression: bytes = b""  # a TopKHeader on the wire, or empty
    zero: bool = False  # backward: the gradient is all zeros and no body follows
    src_stage: int = 0
    dst_stage: int = 0
    plan_version: int = 1  # the version of the job's plan it was sent under; others are dropped

    def __post_init__(self) -> None:
        if self.direction not in OPDATA_DIRECTIONS:
            raise RecordError(f"OpData.direction must be one of {OPDATA_DIRECTIONS}, got {self.direction!r}")
        if self.dtype not in OPDATA_DTYPES:
            raise RecordError(f"OpData.dtype must be one of {OPDATA_DTYPES}, got {self.dtype!r}")
        if not self.producer or not self.consumers:
            raise RecordError("OpData needs a producer and at least one consumer")
        if min(self.iteration, self.micro_batch, self.body_bytes, self.src_stage, self.dst_stage) < 0:
            raise RecordError("OpData iteration, micro_batch, body_bytes and stages must be >= 0")
        if any(d < 0 for d in self.shape):
            raise RecordError(f"OpData.shape has a negative dimension: {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
