"""Model families: the only code a peer runs for a job is code its operator installed.

A ``ModelSpec`` names a *family* and carries a config (JSON). A peer builds it only if
the family is in its ``ModelRegistry``: the built-in families (the transformers causal
LMs of ``lm_families.py``: ``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``gpt_neox``;
``resnet`` of ``vision_families.py``; ``digits-cnn``), factories its operator enabled
with ``fusionp2p peer --allow-model package.module:factory``, and installed
``fusionp2p.models`` entry points. Nothing a peer receives is ever imported: an unknown
family is refused with the flag that would enable it. Every config is validated against
its family's schema: known keys only, each with a type and bounds, so a config cannot ask
for what the family never offered.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.lm_families import LM_FAMILIES
from fusionp2p.opdag.schema import ConfigField, ModelFamily, UnknownModelError, int_field
from fusionp2p.opdag.vision_families import RESNET_FAMILY

__all__ = [
    "BUILTIN_FAMILIES",
    "ENTRY_POINT_GROUP",
    "ConfigField",
    "DigitsCNN",
    "ModelFamily",
    "ModelRegistry",
    "UnknownModelError",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fusionp2p.models"


# -- built-in families --------------------------------------------------------------------


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


DIGITS_FAMILY = ModelFamily(
    "digits-cnn",
    DigitsCNN,
    {"channels": int_field(1, 1024), "classes": int_field(1, 1 << 16)},
    doc="a two-layer CNN for scikit-learn's 8x8 digits",
)

BUILTIN_FAMILIES: tuple[ModelFamily, ...] = (*LM_FAMILIES, DIGITS_FAMILY, RESNET_FAMILY)


# -- the registry ---------------------------------------------------------------------------


def _load_target(target: str) -> ModelFamily:
    """Imports an operator-named ``module:attr``: a ModelFamily, or a factory (named by the target)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--allow-model wants 'package.module:factory', got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import model factory {target!r}: {e}") from e
    return obj if isinstance(obj, ModelFamily) else ModelFamily.from_factory(target, obj)


@dataclass
class ModelRegistry:
    """The model families this process builds.

    ``ModelRegistry()`` holds the built-in families and installed ``fusionp2p.models``
    entry points; ``allow`` adds factories by import path (``"mypkg.models:factory"``,
    which is then the family's name) or ``ModelFamily`` objects. Only the operator of a
    peer, or a data owner for its own spec, decides what goes in here.

    Raises:
        ConfigError: an ``allow`` target that cannot be imported or is not a factory.
    """

    allow: Iterable[str | ModelFamily] = ()
    entry_points: bool = True
    families: dict[str, ModelFamily] = field(init=False)

    def __post_init__(self) -> None:
        self.families = {f.name: f for f in BUILTIN_FAMILIES}
        if self.entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    self.add(_load_target(ep.value), name=ep.name)
                except ConfigError as e:
                    logger.warning("skipped model entry point %r: %s", ep.name, e)
        for item in self.allow:
            self.add(item if isinstance(item, ModelFamily) else _load_target(item))

    def add(self, family: ModelFamily, *, name: str | None = None) -> None:
        """Serves ``family`` (under ``name`` if given)."""
        if name is not None and name != family.name:
            family = ModelFamily(name, family.factory, family.fields, family.rules, family.strip_prefix)
        self.families[family.name] = family

    @classmethod
    def for_data_owner(cls, family: str) -> ModelRegistry:
        """The registry of a data owner building its own spec: an import path it names
        itself is its own code, so it is allowed here (never on a peer)."""
        return cls(allow=[family] if ":" in family else [])

    def resolve(self, name: str) -> ModelFamily:
        """The family called ``name``.

        Raises:
            UnknownModelError: not served here; the message names the flag that enables it.
        """
        family = self.families.get(name)
        if family is None:
            flag = f"--allow-model {name}" if ":" in name else "--allow-model package.module:factory"
            raise UnknownModelError(
                f"model family {name[:80]!r} is not served by this peer (it serves "
                f"{sorted(self.families)}); its operator can enable it with `fusionp2p peer {flag}` "
                f"or an installed {ENTRY_POINT_GROUP!r} entry point"
            )
        return family

    def names(self) -> list[str]:
        """The families served, sorted."""
        return sorted(self.families)
