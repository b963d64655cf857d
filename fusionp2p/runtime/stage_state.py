"""One stage's state: its parameters, buffers and constants, their optimizer, as safetensors.

A test's stage takes its tensors from a real traced program. A peer's stage, the data
owner's included, is built from a *fake* trace and holds only its own tensors: made where
it runs (``opdag.init``, passed as ``initial``), or empty until its owner's safetensors
chunks fill them (a checkpoint): no peer builds the whole model. Until every tensor
arrived, ``missing`` names what is still to come.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import safetensors.torch
import torch

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ProtocolError

__all__ = ["OPTIMIZER_KEYS", "OPTIMIZER_SEPARATOR", "StageState", "chunks"]

OPTIMIZER_SEPARATOR = "#"  # "<param>#<key>" names a parameter's optimizer tensor in a checkpoint
OPTIMIZER_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})


def chunks(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Groups tensors (a mapping, or named tensors read one at a time) into chunks of at
    most ``limit`` bytes (a larger tensor goes alone)."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items() if isinstance(tensors, Mapping) else tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > limit:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk


def _optimizer(config: OptimizerConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    if not params:
        return None
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


class StageState:
    """The tensors of ``names`` (state names of ``program``), trainable ones as Parameters."""

    def __init__(
        self,
        program: Any,
        names: Iterable[str],
        *,
        optimizer: OptimizerConfig,
        materialize: bool = True,
        initial: Mapping[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``materialize``: copy each tensor from ``program`` (a real trace). Otherwise a
        tensor of ``initial`` (of the traced shape and dtype) is taken as it is, and the
        others start empty, ``missing`` until ``load`` fills them.

        Raises:
            ValueError: a tensor of ``initial`` is not of its traced shape and dtype.
        """
        initial = initial or {}
        trainable = set(program.graph_signature.inputs_to_parameters.values())
        sources: Mapping[str, Any] = {**getattr(program, "constants", {}), **program.state_dict}
        self.tensors: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in names:
            source = sources[name]
            given = initial.get(name)
            if materialize:
                tensor = source.detach().clone().to(device)
            elif given is not None:
                if tuple(given.shape) != tuple(source.shape) or given.dtype != source.dtype:
                    raise ValueError(
                        f"initial {name}: {tuple(given.shape)}/{given.dtype}, traced "
                        f"{tuple(source.shape)}/{source.dtype}"
                    )
                tensor = given.detach().to(device)
            else:  # shape and dtype from the fake trace; the values come from the data owner
                tensor = torch.empty(tuple(source.shape), dtype=source.dtype, device=device)
            if name in trainable:
                self.params[name] = torch.nn.Parameter(tensor)
                self.tensors[name] = self.params[name]
            else:
                self.tensors[name] = tensor
        self.missing: set[str] = set() if materialize else set(self.tensors) - set(initial)
        self._optimizer = _optimizer(optimizer, list(self.params.values()))

    def sizes(self) -> dict[str, int]:
        """Bytes of every tensor, by name (what ``load`` accepts)."""
        return {k: t.numel() * t.element_size() for k, t in self.tensors.items()}

    def load(self, data: bytes | bytearray) -> int:
        """Copies tensors, and optimizer state named ``<param>#<key>`` (what ``save_full``
        writes), from safetensors bytes (all or some of them); how many tensors are still missing.

        Raises:
            ProtocolError: not safetensors, a name this stage does not hold, or a wrong shape
                or dtype; nothing is loaded then.
        """
        try:
            tensors = safetensors.torch.load(bytes(data))
        except Exception as e:
            raise ProtocolError(f"weights are not valid safetensors: {str(e)[:200]}") from e
        plain = {k: v for k, v in tensors.items() if OPTIMIZER_SEPARATOR not in k}
        unknown = set(plain) - set(self.tensors)
        if unknown:
            raise ProtocolError(f"this stage holds no {sorted(unknown)[:3]}")
        for name, tensor in plain.items():
            mine = self.tensors[name]
            if tensor.shape != mine.shape or tensor.dtype != mine.dtype:
                raise ProtocolError(
                    f"weight {name}: {tuple(tensor.shape)}/{tensor.dtype}, expected "
                    f"{tuple(mine.shape)}/{mine.dtype}"
                )
        optimizer_state = self._check_optimizer_state(
            {k: v for k, v in tensors.items() if OPTIMIZER_SEPARATOR in k}
        )
        with torch.no_grad():
            for name, tensor in plain.items():
                self.tensors[name].copy_(tensor)
        if self._optimizer is not None:
            for param, values in optimizer_state.items():
                self._optimizer.state[param].update(values)
        self.missing -= set(plain)
        return len(self.missing)

    def _check_optimizer_state(
        self, tensors: dict[str, torch.Tensor]
    ) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        out: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for full, tensor in tensors.items():
            name, _, key = full.rpartition(OPTIMIZER_SEPARATOR)
            param = self.params.get(name)
            if param is None or key not in OPTIMIZER_KEYS or self._optimizer is None:
                raise ProtocolError(f"this stage holds no optimizer state {full[:80]!r}")
            if tensor.shape not in (param.shape, torch.Size([])) or not tensor.is_floating_point():
                raise ProtocolError(
                    f"optimizer state {full[:80]}: {tuple(tensor.shape)}/{tensor.dtype} does not fit "
                    f"its parameter {tuple(param.shape)}"
                )
            value = tensor.to(param.device) if key != "step" else tensor.clone()
            out.setdefault(param, {})[key] = value
        return out

    def save(self, names: Iterable[str] | None = None) -> bytes:
        """The parameters (or the tensors ``names``) as safetensors bytes."""
        chosen = self.params if names is None else {n: self.tensors[n] for n in names}
        return safetensors.torch.save({k: v.detach().cpu().contiguous() for k, v in chosen.items()})

    def _full(self) -> dict[str, torch.Tensor]:
        out = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        if self._optimizer is not None:
            for name, param in self.params.items():
                for key, value in self._optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and key in OPTIMIZER_KEYS:
                        out[f"{name}{OPTIMIZER_SEPARATOR}{key}"] = value.detach().cpu().contiguous()
        return out

    def save_full(self) -> bytes:
        """Every tensor and each parameter's optimizer state (``<param>#<key>``) as safetensors."""
        return safetensors.torch.save(self._full())

    def save_full_parts(self, limit: int) -> Iterator[bytes]:
        """``save_full`` in parts of about ``limit`` bytes each (a larger tensor alone),
        made one at a time."""
        for part in chunks(self._full(), limit):
            yield safetensors.torch.save(part)

    def grads(self) -> bytes:
        """The parameters' accumulated gradients (zeros where none) as safetensors bytes."""
        return safetensors.torch.save(
            {
                k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().contiguous()
                for k, p in self.params.items()
            }
        )

    def grad_tensors(self) -> list[torch.Tensor]:
        """The parameters' gradient tensors in name order, made (zeros) where none yet, so
        that writing into them changes what the optimizer applies."""
        for p in self.params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [self.params[k].grad for k in sorted(self.params)]  # type: ignore[misc]

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameters in name order."""
        return [self.params[k].detach() for k in sorted(self.params)]

    def step(self) -> None:
        """Applies the optimizer and clears the gradients."""
        if self._optimizer is not None:
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
