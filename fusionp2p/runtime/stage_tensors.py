"""A stage's tensors as they travel between the data owner and the stage: initial weights in
bounded chunks, a checkpoint's part for each stage, and what a stage may send back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.split import Partition
from fusionp2p.opdag.trace import TracedModel
from fusionp2p.runtime.stage_state import OPTIMIZER_KEYS, OPTIMIZER_SEPARATOR, chunks

__all__ = ["belongs_to_stage", "check_checkpoint", "chunks", "restore_tensors"]


def check_checkpoint(traced: TracedModel, part: Partition, state: Mapping[str, torch.Tensor]) -> None:
    """Raises ConfigError unless ``state`` holds every tensor the stages use, in its shape
    (a tied weight is one tensor under the one name the traced graph uses)."""
    program = traced.program
    every = {**getattr(program, "constants", {}), **program.state_dict}
    model = {name: every[name] for names in part.params.values() for name in names}
    plain = {k: v for k, v in state.items() if OPTIMIZER_SEPARATOR not in k}
    missing = sorted(set(model) - set(plain))
    foreign = sorted(set(plain) - set(model))
    wrong = sorted(n for n in set(model) & set(plain) if tuple(model[n].shape) != tuple(plain[n].shape))
    if missing or foreign or wrong:
        raise ConfigError(
            f"the checkpoint does not match the model: missing {missing[:3]}, unknown {foreign[:3]}, "
            f"other shape {wrong[:3]}"
        )


def restore_tensors(names: Iterable[str], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``names``, and their optimizer state."""
    wanted = set(names)
    return {k: v.contiguous() for k, v in state.items() if k.partition(OPTIMIZER_SEPARATOR)[0] in wanted}


def belongs_to_stage(
    name: str,
    tensor: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    trainable: Mapping[str, torch.Tensor],
) -> bool:
    """Whether a fetched ``name`` is one of a stage's own tensors (``weights``) in its shape,
    or optimizer state (``param#key``) of one of its own trainable parameters: a stage can
    never put another stage's tensors or optimizer state into a checkpoint."""
    param, separator, key = name.rpartition(OPTIMIZER_SEPARATOR)
    if not separator:
        return name in weights and tensor.shape == weights[name].shape
    return (
        param in trainable
        and key in OPTIMIZER_KEYS
        and tensor.is_floating_point()
        and tensor.shape in (trainable[param].shape, torch.Size([]))
    )
