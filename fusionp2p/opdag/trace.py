"""OP-DAGs of real models: ``torch.export`` a module, annotate each aten op with FLOPs and bytes.

Parameters reach the graph as placeholders; each is counted once, at its first user, and
every other user lists it in ``tied`` (GPT-2's embedding = LM head). The nodes that run
with the data owner whatever the plan are ``pinned`` (``split.data_owner_nodes``), and a
last node, the loss (``LOSS_ID``), reads the graph's outputs: so a planner sees the data
owner's part of the model and the links to and from it. Module paths come
from ``nn_module_stack``. ``coarsen`` groups consecutive ops of one submodule (at a given
depth of the module path) into one node with exact FLOP and byte sums, so the planner
works on tens to hundreds of nodes. Framework types stay in this file: the result is a
plain ``OpDag``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.ir import LOSS_ID, OpDag, OpNode
from fusionp2p.opdag.spec import build_model, example_input, resolve_spec, skeleton_model
from fusionp2p.opdag.split import data_owner_nodes, graph_fingerprint
from fusionp2p.records import ModelSpec

__all__ = ["TracedModel", "coarsen", "trace_module", "trace_spec"]

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "t",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "flatten",
    "split",
    "split_with_sizes",
    "_assert_tensor_metadata",
    "alias",
    "detach",
    "getitem",
}


@dataclass(frozen=True)
class TracedModel:
    """The exported program and its OP-DAG (node ids are the graph's node names)."""

    program: Any  # torch.export.ExportedProgram
    dag: OpDag


def _vals(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _vals(item)]
    return []


def _arg_val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _flops(name: str, node: torch.fx.Node, outputs: list[torch.Tensor]) -> tuple[float, float]:
    out_numel = sum(t.numel() for t in outputs)
    if name in _MATMULS:
        first = _arg_val(node.args[1] if name in ("addmm", "baddbmm") else node.args[0])
        inner = first.shape[-1] if isinstance(first, torch.Tensor) and first.dim() else 1
        fwd = 2.0 * out_numel * inner
        return fwd, 2 * fwd
    if "scaled_dot_product" in name:
        q, k = _arg_val(node.args[0]), _arg_val(node.args[1])
        fwd = (
            4.0 * q.numel() * k.shape[-2]
            if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            else 0.0
        )
        return fwd, 2.5 * fwd
    if name in ("convolution", "conv1d", "conv2d", "conv3d"):
        weight = _arg_val(node.args[1])
        per_out = math.prod(weight.shape[1:]) if isinstance(weight, torch.Tensor) else 1
        fwd = 2.0 * outputs[0].numel() * per_out if outputs else 0.0
        return fwd, 2 * fwd
    if name in _VIEWS:
        return 0.0, 0.0
    return float(out_numel), float(out_numel)


def _module_path(node: torch.fx.Node, strip: str) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if strip and path == strip.rstrip("."):
        return ""
    return path[len(strip) :] if strip and path.startswith(strip) else path


def _loss_node(graph: torch.fx.Graph) -> OpNode:
    """The data owner's loss over the graph's outputs: a softmax and its gradient, about
    4 and 2 operations per output element, keeping the probabilities for backward."""
    (out,) = (n for n in graph.nodes if n.op == "output")
    reads = [a for a in out.all_input_nodes if a.op == "call_function"]
    numel = sum(t.numel() for a in reads for t in _vals(a.meta.get("val")))
    nbytes = sum(t.numel() * t.element_size() for a in reads for t in _vals(a.meta.get("val")))
    return OpNode(
        LOSS_ID,
        "loss",
        tuple(dict.fromkeys(a.name for a in reads)),
        fwd_flops=4.0 * numel,
        bwd_flops=2.0 * numel,
        saved_bytes=nbytes,
        pinned=True,
    )


def trace_module(
    module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *, name: str = "", strip_prefix: str = ""
) -> TracedModel:
    """Exports ``module`` on ``example_inputs`` and builds its op-level OP-DAG.

    ``strip_prefix`` drops a wrapper's attribute from module paths (``"model."`` for
    ``CausalLMWrapper``).
    """
    program = torch.export.export(module, tuple(example_inputs))
    params: dict[str, tuple[str, int]] = {}
    for spec in program.graph_signature.input_specs:
        if spec.target is not None and spec.kind.name in ("PARAMETER", "BUFFER"):
            tensor = program.state_dict.get(spec.target)
            if tensor is None:
                tensor = program.constants.get(spec.target)
            if isinstance(tensor, torch.Tensor):
                params[spec.arg.name] = (spec.target, tensor.numel() * tensor.element_size())
    seen_params: set[str] = set()
    pinned = data_owner_nodes(program)
    nodes: list[OpNode] = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        outputs = _vals(node.meta.get("val"))
        op = _op_name(node.target)
        fwd, bwd = _flops(op, node, outputs)
        inputs = tuple(a.name for a in node.all_input_nodes if a.op == "call_function")
        owned, tied = 0, []
        for arg in node.all_input_nodes:
            if arg.name in params:
                target, nbytes = params[arg.name]
                users = [u for u in arg.users if u.op == "call_function"]
                if len(users) > 1:
                    tied.append(target)
                if target not in seen_params:
                    seen_params.add(target)
                    owned += nbytes
        nodes.append(
            OpNode(
                node.name,
                op,
                tuple(dict.fromkeys(inputs)),
                fwd_flops=fwd,
                bwd_flops=bwd,
                param_bytes=owned,
                output_bytes=sum(t.numel() * t.element_size() for t in outputs),
                saved_bytes=sum(t.numel() * t.element_size() for t in outputs) if fwd else 0,
                module_path=_module_path(node, strip_prefix),
                output_shapes=tuple(tuple(int(d) for d in t.shape) for t in outputs),
                output_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in outputs),
                tied=tuple(dict.fromkeys(tied)),
                pinned=node.name in pinned,
            )
        )
    nodes.append(_loss_node(program.graph))
    # the name carries the graph's own fingerprint, so OpDag.fingerprint tells graphs apart
    label = f"{name or type(module).__name__}@{graph_fingerprint(program.graph)}"
    return TracedModel(program, OpDag(tuple(nodes), name=label))


_gc_lock = threading.Lock()
_gc_pauses = 0


@contextlib.contextmanager
def _no_finalizers() -> Iterator[None]:
    """Collects garbage, then keeps the cyclic collector off while a trace runs. torch's
    export traces under a fake mode of the tracing thread; an object finalized meanwhile in
    that thread runs its ``__del__`` under it, and hivemind's ``MPFuture.__del__`` reads a
    shared torch tensor (``.item()``): the trace then fails on a data-dependent symbol
    (seen on a peer whose replicated stage's averager had just been closed)."""
    global _gc_pauses
    gc.collect()
    with _gc_lock:
        _gc_pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0:
                gc.enable()


def trace_spec(spec: ModelSpec, registry: ModelRegistry | None = None, *, fake: bool = False) -> TracedModel:
    """Builds ``spec``'s model from ``registry`` and traces it.

    ``fake=True`` builds and traces under a ``FakeTensorMode``: no parameter or
    activation is allocated, yet the graph, its fingerprint and every size are those of
    the real model, so a peer can learn what a stage needs before it allocates anything.

    Raises:
        UnknownModelError / ConfigError: see ``opdag.spec.resolve_spec``.
    """
    family, _ = resolve_spec(spec, registry)
    if not fake:
        model = build_model(spec, registry)
        with _no_finalizers():
            return trace_module(
                model, [example_input(spec)], name=spec.family, strip_prefix=family.strip_prefix
            )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _no_finalizers():
        with FakeTensorMode():
            module = skeleton_model(spec, registry)
            example = example_input(spec)
        return trace_module(module, [example], name=spec.family, strip_prefix=family.strip_prefix)


def coarsen(dag: OpDag, depth: int) -> OpDag:
    """Groups consecutive nodes whose module paths agree on their first ``depth`` parts.

    Groups are runs of the topological order, so the result is a DAG; FLOPs and parameter
    and saved bytes are summed exactly; a group's output bytes are the bytes of its nodes'
    outputs used outside it (each tensor once).
    """

    def key(node: OpNode) -> str:
        if node.id == LOSS_ID:
            return LOSS_ID  # the loss stays a node of its own, with its id
        return ".".join(node.module_path.split(".")[:depth]) if node.module_path else ""

    runs: list[list[OpNode]] = []
    for node in dag.nodes:
        if runs and key(runs[-1][-1]) == key(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    group_of = {n.id: i for i, run in enumerate(runs) for n in run}
    names: list[str] = []
    for i, run in enumerate(runs):
        base = key(run[0]) or "top"
        names.append(base if sum(key(r[0]) == key(run[0]) for r in runs) == 1 else f"{base}#{i}")
    coarse = []
    for i, run in enumerate(runs):
        members = {n.id for n in run}
        inputs = tuple(
            dict.fromkeys(names[group_of[src]] for n in run for src in n.inputs if src not in members)
        )
        leaving = [n for n in run if any(group_of[c] != i for c in dag.consumers[n.id])]
        coarse.append(
            OpNode(
                names[i],
                "group",
                inputs,
                fwd_flops=sum(n.fwd_flops for n in run),
                bwd_flops=sum(n.bwd_flops for n in run),
                param_bytes=sum(n.param_bytes for n in run),
                output_bytes=sum(n.output_bytes for n in leaving),
                saved_bytes=sum(n.saved_bytes for n in run),
                module_path=key(run[0]),
                tied=tuple(dict.fromkeys(t for n in run for t in n.tied)),
                pinned=any(n.pinned for n in run),
            )
        )
    return OpDag(tuple(coarse), name=f"{dag.name}@depth{depth}")
