"""Tensors as OpData bodies: dense little-endian bytes, or Top-K-compressed (``compression``)."""

from __future__ import annotations

import math
import sys

import torch

from fusionp2p.compression import wire
from fusionp2p.errors import ProtocolError, RecordError
from fusionp2p.records import TOPK_VALUE_DTYPES, WIRE_DTYPES, OpData, TopKHeader
from fusionp2p.runtime.executor import Body

__all__ = ["DTYPES", "body_bytes", "decode_body", "encode_body", "encode_grad_at", "max_body_bytes"]

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in WIRE_DTYPES}
assert sys.byteorder == "little", "the OpData wire format is little-endian"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    return WIRE_DTYPES[name]


def max_body_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """The largest body an OpData of such a tensor may carry: dense, or Top-K-compressed
    (float32 values at most; sparse only when smaller than those values sent dense)."""
    size = itemsize(dtype)
    return math.prod(shape) * (max(size, 4) if dtype in TOPK_VALUE_DTYPES else size)


def body_bytes(header: OpData) -> int | None:
    """The body length a dense header implies (None when compressed)."""
    if header.zero:
        return 0
    if header.compression:
        return None
    return header.numel * itemsize(header.dtype)


def encode_body(
    tensor: torch.Tensor, ratio: float = 1.0
) -> tuple[bytes, bytes | memoryview, torch.Tensor | None]:
    """``(compression, body, kept)`` for ``tensor``: Top-K at ``ratio`` for float tensors
    when > 1, row by row (``compression.topk_rows``: each token keeps its strongest
    features); ``kept`` holds the positions sent when the body is sparse (else None). A
    dense body is a view of the tensor's own memory (no copy)."""
    tensor = tensor.detach().contiguous()
    if ratio > 1 and dtype_name(tensor.dtype) in TOPK_VALUE_DTYPES and tensor.numel():
        encoded = wire.encode(tensor, ratio, rows=True)
        kept = encoded.indices if encoded.header.index_format != "dense" else None
        return encoded.header.to_wire(), encoded.body, kept
    return b"", _host(tensor).reshape(-1).view(torch.uint8).numpy().data, None


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory: itself on the CPU, else copied into a pinned buffer."""
    if not tensor.is_cuda:
        return tensor
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    pinned.copy_(tensor)
    return pinned


def encode_grad_at(grad: torch.Tensor, kept: torch.Tensor) -> tuple[bytes, bytes]:
    """``(compression, body)`` of the gradient of an activation that was sent sparse."""
    encoded = wire.encode_at(grad.detach().contiguous(), kept)
    return encoded.header.to_wire(), encoded.body


def decode_body(
    header: OpData, body: Body, kept: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensor an OpData carries, and the positions it kept when it came sparse.

    ``kept`` are the positions of the forward this is the gradient of, for a ``shared``
    payload.

    Raises:
        ProtocolError: the body's length or its compression header disagrees with the
            header, or a shared payload comes without (matching) forward positions.
    """
    dtype = DTYPES[header.dtype]
    if header.zero:
        if body:
            raise ProtocolError("a zero gradient carries no body")
        return torch.zeros(header.shape, dtype=dtype), None
    if len(body) != header.body_bytes:
        raise ProtocolError(f"body of {len(body)} bytes, header says {header.body_bytes}")
    if header.compression:
        try:
            topk = TopKHeader.from_wire(header.compression)
        except RecordError as e:
            raise ProtocolError(f"bad compression header: {e}") from e
        if topk.shape != header.shape or topk.dtype != header.dtype:
            raise ProtocolError(
                f"compression header says {topk.shape}/{topk.dtype}, OpData {header.shape}/{header.dtype}"
            )
        if topk.index_format == "shared":
            if kept is None:
                raise ProtocolError(
                    f"a shared-index gradient of {header.producer!r} that was not sent sparse"
                )
            return wire.decode_at(topk, body, kept), None
        return wire.decode_with_indices(topk, body, max_numel=header.numel)
    expected = header.numel * itemsize(header.dtype)
    if len(body) != expected:
        raise ProtocolError(f"dense body of {len(body)} bytes, expected {expected} for {header.shape}")
    if not expected:
        return torch.zeros(header.shape, dtype=dtype), None
    writable = body if isinstance(body, bytearray) else bytearray(body)  # a received payload already is
    return torch.frombuffer(writable, dtype=dtype).reshape(header.shape), None
