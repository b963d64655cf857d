"""Stage-local initialization: any peer makes any tensor of a model without building the model.

A family's initialization (transformers' ``_init_weights``, ``reset_parameters``, a
custom loop) is a sequence of in-place calls on each parameter: ``normal_``,
``kaiming_uniform_``, ``zero_``, ``fill_`` and the like. ``init_plan`` builds the model
once with every parameter on the ``meta`` device (nothing allocated; buffers stay real,
they are small and computed, not drawn) and records, under a ``TorchFunctionMode``, the
calls made on each parameter or on a view of it. ``InitPlan.tensors(names)`` then makes
just those tensors: an empty tensor per name, the RNG seeded from (the spec's seed, the
parameter's name), the recorded calls replayed. So a tensor's value depends on nothing
but the seed, its name and the family's own rules: every peer makes the same one, in
any split, and ``opdag.spec.build_model`` (the one-process reference) makes the whole
model the same way. A family whose init cannot be replayed per parameter (one tensor
copied from another, values computed from a parameter) is refused with
``InitReplayError``, naming the parameter.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fusionp2p.errors import ConfigError

__all__ = ["InitPlan", "InitReplayError", "init_plan", "seed_for"]

# calls that return a view of their first argument: a later in-place call writes through it
_VIEWS = frozenset(
    {"__getitem__", "select", "narrow", "view", "view_as", "t", "transpose", "detach", "unsqueeze", "squeeze"}
)
_HARMLESS = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


class InitReplayError(ConfigError):
    """A family's initialization cannot be replayed one parameter at a time."""


def seed_for(seed: int, name: str) -> int:
    """The RNG seed of tensor ``name`` of a model seeded ``seed``: the same on every peer."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class _Call:
    """One recorded call: ``func(*args, **kwargs)`` with the tensor at ``at`` (an index or a
    keyword), reached from the parameter through ``views``."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    at: int | str
    views: tuple[_Call, ...] = ()

    def apply(self, tensor: torch.Tensor) -> Any:
        for view in self.views:
            tensor = view.apply(tensor)
        args, kwargs = list(self.args), dict(self.kwargs)
        if isinstance(self.at, int):
            args[self.at] = tensor
        else:
            kwargs[self.at] = tensor
        return self.func(*args, **kwargs)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of Tensor: ``.data`` is a view, ``.shape`` and the like are reads
        owner = getattr(func, "__self__", None)
        return "data" if getattr(owner, "__name__", "") == "data" else "__get__"
    return name


class _Recorder(TorchFunctionMode):
    """Records, per parameter, the in-place calls made on it or on a view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[torch.nn.Parameter] = []
        self.calls: dict[int, list[_Call]] = {}  # id(parameter) -> its calls, in order
        self._tracked: dict[int, tuple[int, tuple[_Call, ...]]] = {}  # id(tensor) -> (parameter, views)
        self._alive: list[torch.Tensor] = []  # views stay referenced, so their ids stay theirs
        self.failure: str | None = None

    def track(self, param: torch.nn.Parameter) -> None:
        self.params.append(param)
        self.calls[id(param)] = []
        self._tracked[id(param)] = (id(param), ())

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hits: list[int | str] = [i for i, a in enumerate(args) if id(a) in self._tracked]
        hits += [k for k, a in kwargs.items() if id(a) in self._tracked]
        if not hits or not isinstance(out, torch.Tensor):
            return out  # untouched, or a read (a shape, a norm)
        name = _name(func)
        at = hits[0]
        target = args[at] if isinstance(at, int) else kwargs[at]
        owner, views = self._tracked[id(target)]
        others = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a is not target]
        if isinstance(at, int):
            call = _Call(
                func, tuple(None if i == at else a for i, a in enumerate(args)), dict(kwargs), at, views
            )
        else:
            call = _Call(func, tuple(args), {k: v for k, v in kwargs.items() if k != at}, at, views)
        if out is target:
            if name in _HARMLESS:
                return out
            if len(hits) > 1 or any(t.is_meta for t in others):
                self.failure = self.failure or f"{name} writes one parameter from another"
                return out
            self.calls[owner].append(call)
        elif name in _VIEWS or name == "data":
            self._tracked[id(out)] = (owner, (*views, call))
            self._alive.append(out)
        return out


@dataclass
class InitPlan:
    """How to make each tensor of one model: recorded calls for parameters, values for buffers.

    ``names`` are the model's own tensor names (every alias of a tied parameter), as
    ``torch.export`` lifts them.
    """

    seed: int
    module: torch.nn.Module  # the model, its parameters on ``meta``
    canonical: dict[str, str]  # every parameter name -> the name of its first occurrence
    calls: dict[str, list[_Call]]  # canonical parameter name -> its recorded calls
    buffers: dict[str, torch.Tensor]  # buffer name -> its value

    def names(self) -> list[str]:
        """Every tensor name this plan makes."""
        return [*self.canonical, *self.buffers]

    def _param(self, name: str) -> torch.nn.Parameter:
        return self.module.get_parameter(self.canonical[name])

    def make(self, name: str) -> torch.Tensor:
        """Tensor ``name``, made from its recorded calls (a parameter) or its value (a buffer).

        Raises:
            KeyError: the model has no tensor of that name.
        """
        if name in self.buffers:
            return self.buffers[name].detach().clone()
        meta = self._param(name)
        canonical = self.canonical[name]
        tensor = torch.empty(meta.shape, dtype=meta.dtype)
        with torch.no_grad():
            torch.manual_seed(seed_for(self.seed, canonical))
            for call in self.calls[canonical]:
                call.apply(tensor)
        return tensor

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names``, one at a time (the caller's RNG state is left as it was).

        Raises:
            KeyError: a name the model does not have.
        """
        with torch.random.fork_rng(devices=[]):
            return {name: self.make(name) for name in names}

    def materialize(self) -> torch.nn.Module:
        """The whole model with every parameter made (a tied parameter stays one tensor);
        the plan's own module becomes it."""
        made: dict[int, torch.nn.Parameter] = {}
        with torch.random.fork_rng(devices=[]):
            for name, param in self.module.named_parameters():
                made[id(param)] = torch.nn.Parameter(self.make(name), requires_grad=param.requires_grad)
        for module in self.module.modules():
            for key, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                setattr(module, key, made[id(param)])
        return self.module


_PATCHING = threading.Lock()  # one recording at a time: it patches a method of nn.Module
_REGISTER = torch.nn.Module.register_parameter  # the method itself, put back after each recording


@contextmanager
def _meta_parameters(recorder: _Recorder) -> Iterator[None]:
    """Every parameter registered meanwhile (by this or another thread: a recording runs
    while nothing else builds a model) moves to ``meta`` and is recorded; buffers stay."""

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            recorder.track(param)
        _REGISTER(module, name, param)

    with _PATCHING:
        torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
        try:
            with recorder:
                yield
        finally:
            torch.nn.Module.register_parameter = _REGISTER  # type: ignore[method-assign]


def init_plan(build: Any, seed: int) -> InitPlan:
    """Records how ``build()`` (a family's factory bound to its config) initializes each
    parameter; buffers are built for real, under the RNG seeded ``seed``.

    Raises:
        InitReplayError: the family's init writes a parameter from another tensor.
    """
    recorder = _Recorder()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with _meta_parameters(recorder):
            module = build()
    if recorder.failure is not None:
        raise InitReplayError(
            f"{type(module).__name__}: its init {recorder.failure}; it cannot run stage-locally"
        )
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.is_meta:
            raise InitReplayError(f"{type(module).__name__}: parameter {name} was not registered as one")
        canonical[name] = first.setdefault(id(param), name)
    calls = {name: recorder.calls.get(id(module.get_parameter(name)), []) for name in set(canonical.values())}
    buffers = {name: b for name, b in module.named_buffers(remove_duplicate=False) if b is not None}
    return InitPlan(seed, module, canonical, calls, buffers)
