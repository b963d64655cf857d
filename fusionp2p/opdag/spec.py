"""A model spec: what peers exchange instead of code or a pickled model.

A spec names a model *family* (``"gpt2"``, ``"llama"``, ``"digits-cnn"``, or one a peer's
operator enabled; see ``families.py``), its config (a JSON object validated against the
family's schema), the seed its initial weights come from and the shape of one
micro-batch's input. Every peer builds the same model from it and traces the same
OP-DAG; the data owner checks that by the graph's fingerprint. Building goes through a
``ModelRegistry``: a spec never imports anything itself.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.config import load_json_object
from fusionp2p.errors import ConfigError
from fusionp2p.opdag.families import BUILTIN_FAMILIES, DigitsCNN, ModelFamily, ModelRegistry

__all__ = ["MAX_INPUT_NUMEL", "DigitsCNN", "ModelSpec"]

MAX_SPEC_BYTES = 16 << 10
MAX_INPUT_NUMEL = 1 << 28  # elements of one micro-batch's input
_MAX_INPUT_DIMS = 8
_INPUT_DTYPES = {"int64": torch.int64, "float32": torch.float32}
_STRIP = {f.name: f.strip_prefix for f in BUILTIN_FAMILIES}


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model every peer of a job runs a part of."""

    family: str  # a family in the peer's ModelRegistry: "gpt2", "llama", "digits-cnn", "pkg.mod:factory"
    config: dict[str, Any] = field(default_factory=dict)  # validated against the family's schema
    input_shape: tuple[int, ...] = (1, 16)  # one micro-batch's input
    input_dtype: str = "int64"  # token ids; "float32" for images
    seed: int = 0  # initial weights are drawn from this seed, identically on every peer

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not 0 < len(self.family) <= 128:
            raise ConfigError(
                f"ModelSpec.family must be a family name of 1-128 chars, got {self.family!r:.80}"
            )
        if self.input_dtype not in _INPUT_DTYPES:
            raise ConfigError(f"ModelSpec.input_dtype must be one of {sorted(_INPUT_DTYPES)}")
        dims = self.input_shape
        if (
            not isinstance(dims, tuple)
            or not 0 < len(dims) <= _MAX_INPUT_DIMS
            or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims)
        ):
            raise ConfigError(
                f"ModelSpec.input_shape must be 1-{_MAX_INPUT_DIMS} positive integers, got {dims!r:.80}"
            )
        if math.prod(dims) > MAX_INPUT_NUMEL:
            raise ConfigError(f"ModelSpec.input_shape {dims} has more than {MAX_INPUT_NUMEL} elements")
        if not isinstance(self.config, dict):
            raise ConfigError("ModelSpec.config must be a JSON object")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"ModelSpec.seed must be an integer in [0, 2^63), got {self.seed!r:.40}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "config": self.config,
            "input_shape": list(self.input_shape),
            "input_dtype": self.input_dtype,
            "seed": self.seed,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelSpec:
        """Parses a spec a peer sent (the config is checked later, against the family).

        Raises:
            ConfigError: not JSON, too large or deep, or a field of the wrong type.
        """
        return cls.from_dict(load_json_object(text, "model spec", MAX_SPEC_BYTES))

    @classmethod
    def from_dict(cls, body: object) -> ModelSpec:
        """A spec from decoded JSON (ConfigError on a missing or mistyped field)."""
        if not isinstance(body, dict):
            raise ConfigError("a model spec must be a JSON object")
        shape = body.get("input_shape")
        if not isinstance(shape, list):
            raise ConfigError(f"model spec input_shape must be a list, got {shape!r:.40}")
        try:
            return cls(
                family=body["family"],
                config=body.get("config", {}),
                input_shape=tuple(shape),
                input_dtype=body.get("input_dtype", "int64"),
                seed=body.get("seed", 0),
            )
        except KeyError as e:
            raise ConfigError(f"model spec misses the field {e}") from e

    def resolve(self, registry: ModelRegistry | None = None) -> tuple[ModelFamily, dict[str, Any]]:
        """The family (from ``registry``; default: built-ins and installed entry points) and
        the config validated against it.

        Raises:
            UnknownModelError: the family is not in the registry.
            ConfigError: the config breaks the family's schema.
        """
        family = (registry or ModelRegistry()).resolve(self.family)
        return family, family.validate(self.config)

    def build(self, registry: ModelRegistry | None = None) -> torch.nn.Module:
        """The model with its initial weights (seeded, so identical on every peer).

        Raises:
            UnknownModelError / ConfigError: see ``resolve``.
        """
        family, config = self.resolve(registry)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return family.build(config)

    def example_input(self) -> torch.Tensor:
        return torch.zeros(self.input_shape, dtype=_INPUT_DTYPES[self.input_dtype])

    @property
    def strip_prefix(self) -> str:
        """The wrapper prefix dropped from module paths (built-in causal LMs: ``"model."``)."""
        return _STRIP.get(self.family, "")

    @property
    def input_numel(self) -> int:
        return math.prod(self.input_shape)

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
