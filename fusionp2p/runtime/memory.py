"""What one stage of a job will hold in memory, computed before anything is allocated.

From a traced model (a fake trace allocates nothing) and a partition: this stage's own
tensors, gradients and optimizer slots for its trainable parameters, the activations its
nodes keep for backward times the micro-batches in flight. A peer refuses a stage whose
total exceeds its ``--max-memory``, before it builds anything (and a model it cannot trace
fake: ``engines.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.opdag.split import Partition
from fusionp2p.opdag.trace import TracedModel

__all__ = ["StageMemory", "optimizer_slots", "stage_memory"]


def optimizer_slots(config: OptimizerConfig) -> int:
    """Tensors of state the optimizer keeps per trainable parameter."""
    if config.name == "adamw":
        return 2  # exp_avg, exp_avg_sq
    return 1 if config.momentum else 0


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage needs, by what holds them."""

    state: int  # this stage's own copy of its parameters, buffers and constants
    grads: int  # .grad of its trainable parameters
    optimizer: int  # optimizer slots of its trainable parameters
    activations: int  # kept from forward for backward, all micro-batches in flight
    in_flight: int  # micro-batches whose activations are held at once

    @property
    def total(self) -> int:
        return self.state + self.grads + self.optimizer + self.activations

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total)} (stage state {format_bytes(self.state)}, "
            f"gradients {format_bytes(self.grads)}, "
            f"optimizer {format_bytes(self.optimizer)}, activations {format_bytes(self.activations)} "
            f"for {self.in_flight} micro-batch(es) in flight)"
        )


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def stage_memory(
    traced: TracedModel,
    part: Partition,
    stage: int,
    *,
    in_flight: int,
    optimizer: OptimizerConfig,
) -> StageMemory:
    """The memory ``stage`` of ``part`` needs, from ``traced`` (fake or real)."""
    program = traced.program
    tensors: Mapping[str, Any] = {**program.state_dict, **getattr(program, "constants", {})}
    trainable = set(program.graph_signature.inputs_to_parameters.values())
    mine = [name for name in part.params[stage] if name in tensors]
    state = sum(_nbytes(tensors[name]) for name in mine)
    trained = sum(_nbytes(tensors[name]) for name in mine if name in trainable)
    saved = sum(node.saved_bytes for node in traced.dag.nodes if part.stage_of.get(node.id) == stage)
    received = sum(
        part.values[v].numel_bytes()
        for seg in part.stage_segments(stage)
        for v in seg.inputs
        if v in part.values and part.stage_of[v] != stage
    )
    return StageMemory(
        state=state,
        grads=trained,
        optimizer=trained * optimizer_slots(optimizer),
        activations=(saved + received) * in_flight,
        in_flight=in_flight,
    )
