"""The wire format of a Top-K-compressed tensor, and its strict decoder.

    body = index section | values (k x value dtype)

Indices use the smallest encoding for their density: ``int32`` (4 B each), ``delta16``
(2 B each: gaps between sorted indices, when every gap < 65536), or ``bitmap`` (numel/8 B).
When sparsity would not pay (ratio ~1), the tensor goes ``dense``. FusionLLM's format
(fp32 values + int64 indices) costs 12 B per kept entry; this one 4-8 B (2-6 B with fp16
values). ``decode`` checks every header field against the body before touching memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fusionp2p.compression.topk import k_for_ratio, topk_indices, topk_rows
from fusionp2p.errors import ProtocolError
from fusionp2p.records import TOPK_VALUE_DTYPES, WIRE_DTYPES, TopKHeader

__all__ = [
    "DTYPES",
    "Encoded",
    "PayloadError",
    "decode",
    "decode_at",
    "decode_with_indices",
    "encode",
    "encode_at",
    "paper_bytes",
]

DTYPES = {name: getattr(torch, name) for name in TOPK_VALUE_DTYPES}  # the torch dtype of each name
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_NUMEL = (1 << 31) - 1


class PayloadError(ProtocolError):
    """A compressed payload whose header and body disagree, or that breaks the format."""


@dataclass(frozen=True)
class Encoded:
    """What ``encode`` produced: the header and body to send, and what the receiver will see."""

    header: TopKHeader
    body: bytes
    indices: torch.Tensor  # int64, sorted: positions kept (all of them when dense)
    values: torch.Tensor  # the kept values as the receiver decodes them (after value-dtype rounding)

    @property
    def nbytes(self) -> int:
        return len(self.body)


def paper_bytes(k: int) -> int:
    """Bytes of FusionLLM's format for k entries: fp32 values + int64 indices."""
    return k * 12


def _index_options(idx: np.ndarray, numel: int) -> list[tuple[int, str]]:
    k = len(idx)
    options = [(4 * k, "int32"), ((numel + 7) // 8, "bitmap")]
    if k and (k == 1 or int(np.diff(idx).max()) < 65536):
        options.append((2 * k, "delta16"))
    return sorted(options)


def _encode_indices(idx: np.ndarray, numel: int, fmt: str) -> bytes:
    if fmt == "int32":
        return idx.astype("<i4").tobytes()
    if fmt == "delta16":
        deltas = np.diff(idx, prepend=idx[0]).astype("<u2")
        return deltas.tobytes()
    bits = np.zeros(numel, dtype=bool)
    bits[idx] = True
    return np.packbits(bits, bitorder="little").tobytes()


def encode(
    tensor: torch.Tensor, ratio: float, *, value_dtype: str = "float32", rows: bool = False
) -> Encoded:
    """Top-K compresses ``tensor`` (any shape, float) at ``ratio``; with ``rows``, the
    top ``ceil(width / ratio)`` of each row of the last dimension (``topk_rows``) where
    rows are at least ``4 x ratio`` wide (narrower ones would round the ratio far down).
    The receiver decodes both the same way."""
    if value_dtype not in DTYPES:
        raise ValueError(f"value_dtype must be one of {sorted(DTYPES)}, got {value_dtype!r}")
    if tensor.dtype not in _NAMES:
        raise TypeError(f"can only compress {sorted(DTYPES)} tensors, got {tensor.dtype}")
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    if numel > _MAX_NUMEL:
        raise ValueError(f"tensor of {numel} elements is too large for one message")
    vdt = DTYPES[value_dtype]
    itemsize = WIRE_DTYPES[value_dtype]
    if numel and ratio > 1:
        width = tensor.shape[-1] if tensor.dim() >= 2 else 0
        if rows and width >= 4 * ratio:
            k_row = k_for_ratio(width, ratio)
            k, idx_t = numel // width * k_row, topk_rows(tensor, k_row)
        else:
            k = k_for_ratio(numel, ratio)
            idx_t = topk_indices(flat, k)
        idx = idx_t.cpu().numpy()
        index_bytes, fmt = _index_options(idx, numel)[0]
        if index_bytes + k * itemsize < numel * itemsize:
            values = flat.index_select(0, idx_t).to(vdt)
            header = TopKHeader(
                shape=tuple(tensor.shape),
                dtype=_NAMES[tensor.dtype],
                value_dtype=value_dtype,
                index_format=fmt,
                numel=numel,
                k=k,
                index_bytes=index_bytes,
                ratio=float(ratio),
                base=int(idx[0]) if fmt == "delta16" else 0,
            )
            body = _encode_indices(idx, numel, fmt) + _to_bytes(values)
            return Encoded(header, body, idx_t, values.to(tensor.dtype))
    values = flat.to(vdt)  # sparsity would not pay: send it dense
    header = TopKHeader(
        shape=tuple(tensor.shape),
        dtype=_NAMES[tensor.dtype],
        value_dtype=value_dtype,
        index_format="dense",
        numel=numel,
        k=numel,
        index_bytes=0,
        ratio=float(ratio),
    )
    return Encoded(
        header, _to_bytes(values), torch.arange(numel, device=flat.device), values.to(tensor.dtype)
    )


def encode_at(grad: torch.Tensor, indices: torch.Tensor, *, value_dtype: str = "float32") -> Encoded:
    """The gradient of a Top-K-compressed activation: its values at the forward's ``indices``.

    The forward sent ``topk(h)``; the exact gradient of that with respect to ``h`` is the
    incoming gradient masked to the kept positions, so only those k values go back, with
    no index section (``index_format="shared"``): the sender of the forward kept them.
    """
    if grad.dtype not in _NAMES or value_dtype not in DTYPES:
        raise TypeError(f"can only encode {sorted(DTYPES)} gradients, got {grad.dtype}/{value_dtype}")
    values = grad.detach().reshape(-1).index_select(0, indices.to(grad.device)).to(DTYPES[value_dtype])
    header = TopKHeader(
        shape=tuple(grad.shape),
        dtype=_NAMES[grad.dtype],
        value_dtype=value_dtype,
        index_format="shared",
        numel=grad.numel(),
        k=len(indices),
        index_bytes=0,
        ratio=grad.numel() / max(1, len(indices)),
    )
    return Encoded(header, _to_bytes(values), indices, values.to(grad.dtype))


def decode_at(
    header: TopKHeader, body: bytes | bytearray | memoryview, indices: torch.Tensor
) -> torch.Tensor:
    """The dense gradient from a ``shared`` payload and the indices the forward kept.

    Raises:
        PayloadError: not a shared payload, or its count or length disagrees with ``indices``.
    """
    if header.index_format != "shared" or header.index_bytes:
        raise PayloadError(f"expected a shared-index payload, got {header.index_format}")
    itemsize = WIRE_DTYPES[header.value_dtype]
    if header.k != len(indices) or len(body) != header.k * itemsize:
        raise PayloadError(
            f"shared payload of k={header.k} and {len(body)} bytes for {len(indices)} forward indices"
        )
    if len(indices) and (int(indices.max()) >= header.numel or int(indices.min()) < 0):
        raise PayloadError("forward indices outside the tensor")
    dense = torch.zeros(header.numel, dtype=DTYPES[header.dtype])
    if header.k:
        values = torch.frombuffer(bytearray(body), dtype=DTYPES[header.value_dtype])
        dense.index_copy_(0, indices.cpu(), values.to(dense.dtype))
    return dense.reshape(header.shape)


def _to_bytes(values: torch.Tensor) -> bytes:
    return values.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _decode_indices(header: TopKHeader, section: bytes | bytearray | memoryview) -> np.ndarray:
    k, numel, fmt = header.k, header.numel, header.index_format
    if fmt == "int32":
        idx = np.frombuffer(section, dtype="<i4").astype(np.int64)
    elif fmt == "delta16":
        deltas = np.frombuffer(section, dtype="<u2").astype(np.int64)
        if k and deltas[0] != 0:
            raise PayloadError("delta16 indices must start with a zero gap (the base is in the header)")
        idx = header.base + np.cumsum(deltas)
    else:
        bits = np.unpackbits(np.frombuffer(section, dtype=np.uint8), bitorder="little")
        if bits[numel:].any():
            raise PayloadError("bitmap marks positions past the end of the tensor")
        idx = np.flatnonzero(bits[:numel])
        if len(idx) != k:
            raise PayloadError(f"bitmap marks {len(idx)} positions, header says k={k}")
    if len(idx) != k:
        raise PayloadError(f"{len(idx)} indices for k={k}")
    if k and (idx[0] < 0 or idx[-1] >= numel or np.any(np.diff(idx) <= 0)):
        raise PayloadError(f"indices must be increasing and inside [0, {numel})")
    return idx


def decode(
    header: TopKHeader,
    body: bytes | bytearray | memoryview,
    *,
    max_numel: int = _MAX_NUMEL,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The dense tensor (zeros where nothing was kept).

    Raises:
        PayloadError: the body's length, the index count or range, or a size limit disagrees
            with the header; nothing is read or written out of bounds.
    """
    return decode_with_indices(header, body, max_numel=max_numel, device=device)[0]


def decode_with_indices(
    header: TopKHeader,
    body: bytes | bytearray | memoryview,
    *,
    max_numel: int = _MAX_NUMEL,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``decode``, and the positions kept (int64, sorted; None for a dense payload)."""
    if header.numel > max_numel:
        raise PayloadError(f"payload claims {header.numel} elements > limit {max_numel}")
    if header.index_format == "shared":
        raise PayloadError("a shared-index payload needs the forward's indices (decode_at)")
    itemsize = WIRE_DTYPES[header.value_dtype]
    expected_index = {
        "dense": 0,
        "int32": 4 * header.k,
        "delta16": 2 * header.k,
        "bitmap": (header.numel + 7) // 8,
    }[header.index_format]
    if header.index_bytes != expected_index:
        raise PayloadError(
            f"{header.index_format} index section of {header.index_bytes} bytes, "
            f"expected {expected_index} for k={header.k}, numel={header.numel}"
        )
    if header.index_format == "dense" and header.k != header.numel:
        raise PayloadError(f"dense payload with k={header.k} != numel={header.numel}")
    if len(body) != header.index_bytes + header.k * itemsize:
        raise PayloadError(
            f"body of {len(body)} bytes, header says {header.index_bytes} + {header.k} x {itemsize}"
        )
    values = torch.frombuffer(bytearray(body[header.index_bytes :]), dtype=DTYPES[header.value_dtype])
    out_dtype = DTYPES[header.dtype]
    if header.index_format == "dense":
        return values.to(out_dtype).reshape(header.shape).to(device), None
    idx = torch.from_numpy(_decode_indices(header, body[: header.index_bytes]))
    dense = torch.zeros(header.numel, dtype=out_dtype)
    dense.index_copy_(0, idx, values.to(out_dtype))
    return dense.reshape(header.shape).to(device), idx
