"""Building a ``ModelSpec``'s model (``records.ModelSpec``: what peers exchange instead of
code): its family comes from a ``ModelRegistry``, so a spec never imports anything, and its
config is validated against the family's schema before anything is built.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fusionp2p.opdag.families import ModelFamily, ModelRegistry
from fusionp2p.opdag.init import InitPlan, init_plan
from fusionp2p.records import ModelSpec

__all__ = ["build_model", "example_input", "model_init", "resolve_spec", "skeleton_model"]


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


def model_init(spec: ModelSpec, registry: ModelRegistry | None = None) -> InitPlan:
    """How to make each of ``spec``'s tensors on its own (``opdag.init``): what a stage
    builds its part of the model from, without building the rest.

    Raises:
        UnknownModelError / ConfigError: see ``resolve_spec``.
        InitReplayError: the family's init cannot be replayed one tensor at a time.
    """
    family, config = resolve_spec(spec, registry)
    return init_plan(functools.partial(family.build, config), spec.seed)


def build_model(spec: ModelSpec, registry: ModelRegistry | None = None) -> torch.nn.Module:
    """``spec``'s whole model with its initial weights: every tensor exactly as a stage
    makes it with ``model_init`` (the one-process reference of a distributed run).

    Raises:
        UnknownModelError / ConfigError / InitReplayError: see ``model_init``.
    """
    return model_init(spec, registry).materialize()


def skeleton_model(spec: ModelSpec, registry: ModelRegistry | None = None) -> torch.nn.Module:
    """``spec``'s model as its family builds it, for a trace under a fake tensor mode: its
    graph and sizes are the model's, its values are not ``build_model``'s.

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
