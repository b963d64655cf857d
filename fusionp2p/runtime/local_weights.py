"""Pretrained tensors a stage loads from its own peer's copy (``fusionp2p peer --weights-dir``).

A data owner fine-tuning a model its stage peers already have (the same ``save_pretrained``
directory, downloaded once by each) sends each stage a ``LocalWeights`` record instead of
the tensors: every tensor's key in the files and the sha256 of its bytes as the data
owner's copy holds them. The stage looks for each key in the safetensors files under its
weights directory, checks its digest, casts it to the model's dtype and loads it, one
bounded piece at a time. A missing tensor or another digest is refused in one line naming
the tensor, and the data owner then sends that stage its tensors itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from fusionp2p.errors import ProtocolError
from fusionp2p.records import LocalWeights
from fusionp2p.runtime.executor import Executor
from fusionp2p.runtime.shard_store import tensor_digest
from fusionp2p.runtime.stage_state import chunks

__all__ = ["MAX_WEIGHT_FILES", "load_local_weights"]

logger = logging.getLogger(__name__)

MAX_WEIGHT_FILES = 10_000  # safetensors files looked at under a weights directory


def _index(root: Path) -> dict[str, list[Path]]:
    """Every tensor key under ``root`` -> the files holding one of that name."""
    where: dict[str, list[Path]] = {}
    for count, path in enumerate(sorted(root.rglob("*.safetensors"))):
        if count >= MAX_WEIGHT_FILES:
            break
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    where.setdefault(key, []).append(path)
        except Exception as e:  # a foreign or torn file: the others may still hold the model
            logger.info("skipping %s in the weights directory: %s", path, str(e)[:120])
    return where


def _tensors(root: Path, record: LocalWeights) -> Iterator[tuple[str, torch.Tensor]]:
    where = _index(root)
    for name, key, digest, dtype in record.tensors:
        found = None
        for path in where.get(key, []):
            with safe_open(str(path), framework="pt") as f:
                tensor = f.get_tensor(key)
            if tensor_digest(tensor) == digest:
                found = tensor
                break
        if found is None:
            what = "has no" if key not in where else "has another"
            raise ProtocolError(f"the weights directory {what} tensor {key} (for {name})")
        yield name, found.to(getattr(torch, dtype)).contiguous()


def load_local_weights(executor: Executor, record: LocalWeights, root: str | None, chunk_bytes: int) -> int:
    """Loads ``record``'s tensors from the files under ``root`` into ``executor``, one
    piece at a time; how many. Blocking: run it on the compute thread.

    Raises:
        ProtocolError: no weights directory, a tensor the stage does not hold, or one that
            is missing there or has another digest (nothing further is loaded).
    """
    if root is None:
        raise ProtocolError("this peer keeps no pretrained weights (it has no --weights-dir)")
    sizes = executor.state_sizes()
    unknown = [name for name, *_ in record.tensors if name not in sizes]
    if unknown:
        raise ProtocolError(f"this stage holds no {unknown[:3]}")
    count = 0
    for piece in chunks(_tensors(Path(root), record), chunk_bytes):
        executor.load_state(safetensors.torch.save(piece))
        count += len(piece)
    return count
