"""A model spec: what peers exchange instead of code or a pickled model.

A spec names a model (a registry name such as ``"gpt2"``, or an import path
``"package.module:factory"`` of a function on every peer), its config (a JSON object),
the seed its initial weights come from and the shape of one micro-batch's input. Every
peer builds the same model from it and traces the same OP-DAG; the data owner checks
that by the graph's fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.config import load_json_object
from fusionp2p.errors import ConfigError

__all__ = ["DigitsCNN", "ModelSpec", "register_model"]

_MAX_SPEC_BYTES = 64 << 10
_INPUT_DTYPES = {"int64": torch.int64, "float32": torch.float32}


class DigitsCNN(torch.nn.Module):
    """Two convolutions and a linear head for 8x8 grey images (scikit-learn's digits)."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = torch.nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(images))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _causal_lm(family: str) -> Callable[..., torch.nn.Module]:
    def build(**config: Any) -> torch.nn.Module:
        import transformers

        from fusionp2p.opdag.trace import CausalLMWrapper

        if family == "gpt2":
            config = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **config}
            return CausalLMWrapper(transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)))
        return CausalLMWrapper(transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)))

    return build


_REGISTRY: dict[str, Callable[..., torch.nn.Module]] = {
    "gpt2": _causal_lm("gpt2"),
    "llama": _causal_lm("llama"),
    "digits-cnn": DigitsCNN,
}


def register_model(name: str, factory: Callable[..., torch.nn.Module]) -> None:
    """Adds a model factory under ``name`` (it must be registered on every peer)."""
    if not name or ":" in name:
        raise ConfigError(f"a registry name must be non-empty and without ':', got {name!r}")
    _REGISTRY[name] = factory


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model every peer of a job runs a part of."""

    name: str  # registry name, or "package.module:factory"
    config: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the factory
    input_shape: tuple[int, ...] = (1, 16)  # one micro-batch's input
    input_dtype: str = "int64"  # token ids; "float32" for images
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("ModelSpec.name must be a registry name or 'module:attr'")
        if self.input_dtype not in _INPUT_DTYPES:
            raise ConfigError(f"ModelSpec.input_dtype must be one of {sorted(_INPUT_DTYPES)}")
        if not self.input_shape or any(not isinstance(d, int) or d < 1 for d in self.input_shape):
            raise ConfigError(f"ModelSpec.input_shape must be positive integers, got {self.input_shape}")
        if not isinstance(self.config, dict):
            raise ConfigError("ModelSpec.config must be a JSON object")

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "config": self.config,
                "input_shape": list(self.input_shape),
                "input_dtype": self.input_dtype,
                "seed": self.seed,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelSpec:
        """Parses a spec a peer sent.

        Raises:
            ConfigError: not JSON, too large, or a field of the wrong type.
        """
        body = load_json_object(text, "model spec", _MAX_SPEC_BYTES)
        try:
            return cls(
                name=body["name"],
                config=body.get("config", {}),
                input_shape=tuple(body["input_shape"]),
                input_dtype=body.get("input_dtype", "int64"),
                seed=int(body.get("seed", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"model spec misses or mistypes a field: {e!r}") from e

    def factory(self) -> Callable[..., torch.nn.Module]:
        if self.name in _REGISTRY:
            return _REGISTRY[self.name]
        module_name, _, attr = self.name.partition(":")
        if not attr:
            raise ConfigError(
                f"unknown model {self.name!r}: not in {sorted(_REGISTRY)} and not 'module:attr'"
            )
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot import model factory {self.name!r}: {e}") from e

    def build(self) -> torch.nn.Module:
        """The model with its initial weights (seeded, so identical on every peer)."""
        factory = self.factory()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            try:
                return factory(**self.config)
            except TypeError as e:
                raise ConfigError(f"model {self.name!r} rejects its config: {e}") from e

    def example_input(self) -> torch.Tensor:
        return torch.zeros(self.input_shape, dtype=_INPUT_DTYPES[self.input_dtype])

    @property
    def strip_prefix(self) -> str:
        return "model." if self.name in ("gpt2", "llama") else ""

    @property
    def input_numel(self) -> int:
        return math.prod(self.input_shape)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
