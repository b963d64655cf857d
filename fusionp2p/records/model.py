"""A model spec: what peers exchange instead of code or a pickled model.

A spec names a model *family* (``"gpt2"``, ``"llama"``, ``"digits-cnn"``, or one a peer's
operator enabled), its config (a JSON object, validated against the family's schema where
the model is built: ``opdag/families.py``), the seed its initial weights come from and the
shape of one micro-batch's input. Every peer builds the same model from it and traces the
same OP-DAG; the data owner checks that by the graph's fingerprint. A spec never imports
anything itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from fusionp2p.errors import ConfigError
from fusionp2p.records.wire import Limit, WireRecord

__all__ = ["INPUT_DTYPES", "MAX_INPUT_NUMEL", "ModelSpec"]

MAX_INPUT_NUMEL = 1 << 28  # elements of one micro-batch's input
_MAX_INPUT_DIMS = 8
INPUT_DTYPES = ("int64", "float32")  # token ids, images


@dataclass(frozen=True)
class ModelSpec(WireRecord):
    """How to build the model every peer of a job runs a part of."""

    KIND: ClassVar[str] = "model_spec"
    MAX_BYTES: ClassVar[int] = 16 << 10

    family: Annotated[str, Limit(128)]  # in the peer's ModelRegistry: "gpt2", "digits-cnn", "pkg.mod:factory"
    config: Annotated[dict[str, Any], Limit(256)] = field(default_factory=dict)  # the family's keys
    input_shape: Annotated[tuple[int, ...], Limit(_MAX_INPUT_DIMS)] = (1, 16)  # one micro-batch's input
    input_dtype: str = "int64"  # one of INPUT_DTYPES
    seed: int = 0  # initial weights are drawn from this seed, identically on every peer

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not 0 < len(self.family) <= 128:
            raise ConfigError(
                f"ModelSpec.family must be a family name of 1-128 chars, got {self.family!r:.80}"
            )
        if self.input_dtype not in INPUT_DTYPES:
            raise ConfigError(f"ModelSpec.input_dtype must be one of {INPUT_DTYPES}")
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
