"""Building a ``ModelSpec``'s model (``records.ModelSpec``: what peers exchange instead of
code): its family comes from a ``ModelRegistry``, so a spec never imports anything, and its
config is validated against the family's schema before anything is built.
"""

from __future__ import annotations

from typing import Any

import torch

from fusionp2p.opdag.families import ModelFamily, ModelRegistry
from fusionp2p.records import ModelSpec

__all__ = ["build_model", "example_input", "resolve_spec"]


def resolve_spec(
    spec: ModelSpec, registry: ModelRegistry | None = None
) -> tuple[ModelFamily, dict[str, Any]]:
    """``spec``'s family (from ``registry``; default: built-ins and installed entry points)
    and its config validated against it.

    Raises:
        UnknownModelError: the family is not in the registry.
        ConfigError: the config breaks the family's schema.
    """
    family = (registry or ModelRegistry()).resolve(spec.family)
    return family, family.validate(spec.config)


def build_model(spec: ModelSpec, registry: ModelRegistry | None = None) -> torch.nn.Module:
    """``spec``'s model with its initial weights (seeded, so identical on every peer).

    Raises:
        UnknownModelError / ConfigError: see ``resolve_spec``.
    """
    family, config = resolve_spec(spec, registry)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return family.build(config)


def example_input(spec: ModelSpec) -> torch.Tensor:
    """One micro-batch's input of the spec's shape and dtype (zeros)."""
    return torch.zeros(spec.input_shape, dtype=getattr(torch, spec.input_dtype))
