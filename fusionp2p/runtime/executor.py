"""The framework-neutral executor interface: OpData in, OpData out, ``step()``, state.

An executor owns one stage's sub-DAG of a job. The service that feeds it (``service.py``)
knows only this interface, so another engine (JAX, a compiled runtime) can implement it
without touching the scheduler or the transport. Tensors cross this boundary as bytes
(the OpData body) and state as safetensors bytes, a format every framework reads.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusionp2p.errors import ConfigError
from fusionp2p.records import OpData

if TYPE_CHECKING:  # replicas average torch tensors (hivemind's averager); other engines refuse
    import torch

__all__ = ["Body", "Executor", "Message"]

Body = bytes | bytearray | memoryview  # a tensor's bytes: received (bytearray) or a view of one to send


@dataclass(frozen=True)
class Message:
    """One OpData header and its tensor bytes, addressed by ``header.dst_stage``."""

    header: OpData
    body: Body


class Executor(abc.ABC):
    """Runs one stage of a job: forward and backward per (iteration, micro-batch), then steps."""

    stage: int
    job: str
    iteration: int

    @abc.abstractmethod
    def check(self, header: OpData) -> None:
        """Cheap validation before the body is read, against the job's fixed plan only (it
        may run while the compute thread works; the iteration is checked by the caller).

        Raises:
            ProtocolError: wrong job, micro-batch, stage, producer, consumers, shape,
                dtype or body size.
        """

    @abc.abstractmethod
    def accept(self, header: OpData, body: Body) -> list[Message]:
        """Takes one OpData, runs what became ready, returns the OpData to send on.

        Raises:
            ProtocolError: the message is invalid or a duplicate; the executor's state is
                unchanged.
        """

    @abc.abstractmethod
    def micro_batches_done(self, iteration: int) -> int:
        """How many micro-batches of ``iteration`` finished backward here (0 for another iteration)."""

    def ready_to_step(self, iteration: int, n_micro_batches: int) -> bool:
        """Whether backward finished here for every micro-batch of ``iteration``."""
        return self.micro_batches_done(iteration) >= n_micro_batches

    @abc.abstractmethod
    def step(self, iteration: int) -> None:
        """Applies the optimizer to this stage's parameters and moves to the next iteration."""

    @abc.abstractmethod
    def state_dict(self) -> bytes:
        """This stage's parameters as safetensors bytes."""

    @abc.abstractmethod
    def full_state(self) -> bytes:
        """Everything a checkpoint needs as safetensors bytes: every tensor of this stage and
        the optimizer's state of each parameter (``<param>#<key>``, e.g. ``w#exp_avg``);
        ``load_state`` takes it back."""

    def full_state_parts(self, limit: int) -> Iterator[bytes]:
        """``full_state`` in parts of about ``limit`` bytes (a checkpoint shard's parts),
        made one at a time (on the compute thread: it reads the stage's tensors)."""
        yield self.full_state()

    def largest_tensor_bytes(self) -> int:
        """The largest tensor of any stage of the job (what one shard part may carry alone)."""
        return max(self.state_sizes().values(), default=0)

    @abc.abstractmethod
    def grads(self) -> bytes:
        """The gradients accumulated in this iteration, as safetensors bytes."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """This iteration's gradients as tensors in a fixed order, writable in place (what
        replicas average before the optimizer step).

        Raises:
            ConfigError: this engine cannot be replicated.
        """
        raise ConfigError(f"the {type(self).__name__} engine cannot average gradients across replicas")

    def param_tensors(self) -> list[torch.Tensor]:
        """This stage's parameters in the order of ``grad_tensors`` (replicas compare them).

        Raises:
            ConfigError: this engine cannot be replicated.
        """
        raise ConfigError(f"the {type(self).__name__} engine cannot compare parameters across replicas")

    @abc.abstractmethod
    def load_state(self, data: bytes | bytearray) -> int:
        """Loads some of this stage's tensors (parameters, buffers, constants) and optimizer
        state (as ``full_state`` names it) from safetensors bytes (a state comes in chunks);
        returns how many tensors are still missing.

        Raises:
            ProtocolError: not safetensors, a name this stage does not hold, or a wrong shape
                or dtype; nothing is loaded then.
        """

    @abc.abstractmethod
    def missing_state(self) -> int:
        """How many of this stage's tensors have not been loaded yet (it cannot run before)."""

    @abc.abstractmethod
    def max_message_bytes(self) -> int:
        """The largest OpData body any stage of this job may send (the inbound size limit)."""

    @abc.abstractmethod
    def state_sizes(self) -> dict[str, int]:
        """Bytes of each of this stage's tensors, by name (what ``load_state`` accepts)."""
