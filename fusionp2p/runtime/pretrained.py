"""Pretrained weights on the data owner's disk, read lazily, one tensor at a time.

``[model] pretrained = "DIR"`` names a local ``save_pretrained`` directory (one
``model.safetensors``, or shards and their ``model.safetensors.index.json``) or a
``.safetensors`` file. Nothing is read until a stage needs it: ``check`` reads only the
files' headers (every tensor the model needs is there, in its shape), and ``read`` yields a
stage's tensors one by one through ``safe_open``, so the data owner never holds more than
one tensor of another stage. A tensor is found under the model's own name or under that
name without its leading wrapper attributes (the trace's ``model.transformer.h.0...`` is
transformers' ``transformer.h.0...``). No hub download ever happens.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fusionp2p.errors import ConfigError
from fusionp2p.records import LocalWeights
from fusionp2p.runtime.shard_store import tensor_digest

__all__ = ["INDEX_FILE", "PretrainedWeights", "SavedTensor", "saved_tensors"]

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class SavedTensor:
    """A tensor a saved model holds: its shape and dtype, and every name it goes by (a tied
    parameter is saved under one of them)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    names: tuple[str, ...]


def saved_tensors(program: Any) -> dict[str, SavedTensor]:
    """What a saved model holds of an exported ``program``, by each name the graph uses:
    its parameters and persistent buffers (not the buffers a model computes)."""
    signature = program.graph_signature
    state = program.state_dict
    names = [n for n in (*signature.inputs_to_parameters.values(), *signature.inputs_to_buffers.values())]
    aliases: dict[int, list[str]] = {}
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)
    return {
        n: SavedTensor(tuple(state[n].shape), state[n].dtype, tuple(aliases[id(state[n])]))
        for n in dict.fromkeys(names)
        if n in state
    }


def _files(path: Path) -> dict[str, Path]:
    """Every tensor name of ``path`` -> the safetensors file holding it (headers only)."""
    if path.is_file():
        files = [path]
    elif (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            files = sorted({path / str(f) for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"pretrained {path / INDEX_FILE}: not a safetensors index ({e})") from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"pretrained {path}: no .safetensors file (save the model with save_pretrained)")
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
        except Exception as e:
            reason = str(e)[:120]
            raise ConfigError(f"pretrained {file}: not a readable safetensors file ({reason})") from None
        where.update((name, file) for name in names)
    return where


class PretrainedWeights:
    """A model's weights in local safetensors files, for stages to start from.

    Raises:
        ConfigError: ``path`` does not exist or holds no readable safetensors file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise ConfigError(f"pretrained {self.path}: no such file or directory")
        self._where = _files(self.path)

    def _key(self, saved: SavedTensor) -> str | None:
        for name in saved.names:
            parts = name.split(".")
            for start in range(len(parts)):
                key = ".".join(parts[start:])
                if key in self._where:
                    return key
        return None

    def check(self, expected: Mapping[str, SavedTensor]) -> None:
        """Raises ConfigError, in one line naming the tensor, unless every tensor of
        ``expected`` (``saved_tensors``) is in the files in its shape, and floating where
        the model's is (it is cast on reading)."""
        for name, saved in expected.items():
            shape, dtype = saved.shape, saved.dtype
            key = self._key(saved)
            if key is None:
                raise ConfigError(f"pretrained {self.path}: no tensor {name} (nor under a shorter name)")
            with safe_open(str(self._where[key]), framework="pt") as f:
                piece = f.get_slice(key)
                got_shape, got_dtype = tuple(piece.get_shape()), piece.get_dtype()
            if got_shape != tuple(shape):
                raise ConfigError(
                    f"pretrained {self.path}: tensor {key} has shape {list(got_shape)}, the model's "
                    f"{name} has {list(shape)}"
                )
            if dtype.is_floating_point != (got_dtype in _DTYPES):
                raise ConfigError(
                    f"pretrained {self.path}: tensor {key} is {got_dtype}, the model's {name} is {dtype}"
                )

    def local_record(self, names: Iterable[str], expected: Mapping[str, SavedTensor]) -> LocalWeights:
        """What a stage holding ``names`` may load from its own copy of these files: each
        tensor's key and the sha256 of its bytes as saved (read here one at a time).

        Raises:
            ConfigError: a file became unreadable since ``check``.
        """
        entries = []
        for name, tensor in self._raw(names, expected):
            key = self._key(expected[name])
            dtype = str(expected[name].dtype).removeprefix("torch.")
            entries.append((name, key or name, tensor_digest(tensor), dtype))
        return LocalWeights(tuple(entries))

    def _raw(
        self, names: Iterable[str], expected: Mapping[str, SavedTensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            key = self._key(expected[name])
            if key is None:
                raise ConfigError(f"pretrained {self.path}: no tensor {name}")
            try:
                with safe_open(str(self._where[key]), framework="pt") as f:
                    tensor = f.get_tensor(key)
            except Exception as e:
                reason = str(e)[:120]
                raise ConfigError(f"pretrained {self._where[key]}: cannot read {key} ({reason})") from None
            yield name, tensor

    def read(
        self, names: Iterable[str], expected: Mapping[str, SavedTensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors ``names`` (checked with ``check``), one at a time, in their dtypes.

        Raises:
            ConfigError: a file became unreadable since ``check``.
        """
        for name, tensor in self._raw(names, expected):
            yield name, tensor.to(expected[name].dtype).contiguous()
