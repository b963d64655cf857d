"""Sub-DAG extraction: which stage runs each node of an exported program, and in what pieces.

An assignment maps every operator node to a stage; it need not be contiguous (a stage may
own blocks 0 and 2 while another owns block 1). ``partition`` normalizes it so that it
can run exactly:

- raw inputs stay with the data owner: the nodes that read a user input, and the integer
  nodes computed from it, run on ``data_stage`` (token ids never leave it);
- a parameter used by several nodes (GPT-2 ties the input embedding and the LM head)
  keeps all its users on one stage, the stage of its first user, so its gradient is
  complete on one peer;
- only single tensors cross stages: a node that reads an element of a tuple-valued node
  (``getitem``) runs with that node.

Each stage's nodes are then cut into *segments*, the units of forward and backward: a
node's wave is the number of stage changes on the longest path to it, and a segment is
one stage's nodes of one wave. Every edge between segments goes to a higher wave, so the
segments form a DAG even when the stages do not (A -> B -> A). A segment runs forward
when all its inputs arrived and backward when the gradients of all its outputs did.
The data owner adds two segments: the source (user inputs) and the loss (the graph's
outputs, which only it sees).
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.ir import LOSS_ID as LOSS
from fusionp2p.records import FLOAT_DTYPES, WIRE_DTYPES

__all__ = [
    "LOSS",
    "Partition",
    "Segment",
    "ValueInfo",
    "balanced_assignment",
    "data_owner_nodes",
    "graph_fingerprint",
    "op_node_names",
    "partition",
]


@dataclass(frozen=True)
class ValueInfo:
    """The tensor a node produces, as the graph's metadata describes it."""

    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", "int64"

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def numel_bytes(self) -> int:
        """Bytes of the dense tensor."""
        return math.prod(self.shape) * WIRE_DTYPES[self.dtype]


@dataclass(frozen=True)
class Segment:
    """One stage's nodes of one wave: run forward together, backward together."""

    id: int
    stage: int
    wave: int
    nodes: tuple[str, ...]  # graph nodes in graph order (user inputs for the source, LOSS for the loss)
    inputs: tuple[str, ...]  # values it reads from other segments
    outputs: tuple[str, ...]  # values it produces that other segments read
    kind: str = "ops"  # "ops", "source" or "loss"


@dataclass(frozen=True)
class Partition:
    """A normalized assignment of an exported program to ``n_stages`` stages, in segments."""

    n_stages: int
    data_stage: int
    stage_of: Mapping[str, int]  # every operator node, user input and LOSS
    segments: tuple[Segment, ...]
    segment_of: Mapping[str, int]  # node -> segment id
    readers: Mapping[str, tuple[int, ...]]  # value -> ids of the other segments that read it
    reader_names: Mapping[tuple[str, int], tuple[str, ...]]  # (value, reader segment) -> its nodes reading it
    values: Mapping[str, ValueInfo]  # every value that crosses segments
    params: Mapping[int, tuple[str, ...]]  # stage -> state names (parameters, buffers, constants) it uses
    moved: tuple[str, ...]  # what normalization changed, for logs
    fingerprint: str  # of the traced graph: equal on every peer that traced the same model

    def stage_segments(self, stage: int) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.stage == stage)

    def reader_nodes(self, value: str, stage: int) -> tuple[str, ...]:
        """Nodes of ``stage`` (outside the producing segment) that read ``value``."""
        return tuple(
            name
            for seg_id in self.readers.get(value, ())
            if self.segments[seg_id].stage == stage
            for name in self.reader_names[value, seg_id]
        )


def op_node_names(graph: torch.fx.Graph) -> list[str]:
    """The operator nodes of an exported graph in order: what an assignment indexes."""
    return [n.name for n in graph.nodes if n.op == "call_function"]


def balanced_assignment(flops: Sequence[float], n_stages: int) -> list[int]:
    """Contiguous stages of about equal forward FLOPs, one stage per operator node in order.

    A simple default when no plan is given; OP-Fence (``fusionp2p.planning``) is the
    scheduler that also weighs links and devices.
    """
    if n_stages < 1:
        raise ConfigError(f"n_stages must be >= 1, got {n_stages}")
    total = sum(flops) or 1.0
    out, acc = [], 0.0
    for f in flops:
        out.append(min(n_stages - 1, int(n_stages * (acc + f / 2) / total)))
        acc += f
    return out


def graph_fingerprint(graph: torch.fx.Graph) -> str:
    """Short hash of every node's op, name, target and inputs: equal where the same model
    traced to the same graph."""
    digest = hashlib.sha256()
    for node in graph.nodes:
        digest.update(
            f"{node.op}|{node.name}|{node.target}|{[a.name for a in node.all_input_nodes]};".encode()
        )
    return digest.hexdigest()[:16]


def _waves(
    graph: torch.fx.Graph,
    reads: Mapping[str, tuple[str, ...]],
    stage_of: Mapping[str, int],
    user_inputs: list[str],
) -> dict[str, int]:
    """Stage changes on the longest path to each node (the loss one wave after its inputs)."""
    wave: dict[str, int] = dict.fromkeys(user_inputs, 0)
    for node in graph.nodes:
        if node.op == "call_function":
            wave[node.name] = max(
                (wave[s] + (stage_of[s] != stage_of[node.name]) for s in reads[node.name]), default=0
            )
    wave[LOSS] = 1 + max((wave[s] for s in reads[LOSS]), default=0)
    return wave


def _value_info(node: torch.fx.Node) -> ValueInfo | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return ValueInfo(tuple(int(d) for d in val.shape), str(val.dtype).removeprefix("torch."))
    return None


def _initial_stages(
    ops: list[str], assignment: Mapping[str, int] | Sequence[int], n_stages: int, data_stage: int
) -> dict[str, int]:
    """The stage of every operator node as ``assignment`` gives it, checked. An assignment
    may also place the loss (``LOSS`` by name, or one entry past the operator nodes, as an
    OP-DAG's last node): on the data owner's stage, where it runs.
    """
    if isinstance(assignment, Mapping):
        loss = assignment.get(LOSS)
        unknown = set(assignment) - set(ops) - {LOSS}
        if unknown:
            raise ConfigError(f"assignment names nodes the graph does not have: {sorted(unknown)[:5]}")
        missing = [n for n in ops if n not in assignment]
        if missing:
            raise ConfigError(f"assignment misses {len(missing)} nodes, e.g. {missing[:5]}")
        stage_of = {n: int(assignment[n]) for n in ops}
    else:
        loss = assignment[len(ops)] if len(assignment) == len(ops) + 1 else None
        if len(assignment) not in (len(ops), len(ops) + 1):
            raise ConfigError(f"assignment has {len(assignment)} stages for {len(ops)} operator nodes")
        stage_of = {n: int(s) for n, s in zip(ops, assignment, strict=False)}
    if loss is not None and int(loss) != data_stage:
        raise ConfigError(
            f"the assignment puts the loss on stage {loss}: it runs on the data owner's, {data_stage}"
        )
    bad = {s for s in stage_of.values() if not 0 <= s < n_stages}
    if bad:
        raise ConfigError(f"assignment uses stages {sorted(bad)} outside [0, {n_stages})")
    return stage_of


class _Normalizer:
    """Moves nodes until the assignment runs exactly (``partition``'s rules), noting each move."""

    def __init__(self, program: Any, stage_of: dict[str, int], data_stage: int) -> None:
        graph: torch.fx.Graph = program.graph
        signature = program.graph_signature
        self.graph = graph
        self.stage_of = stage_of
        self.data_stage = data_stage
        self.ops = op_node_names(graph)
        self.nodes = {n.name: n for n in graph.nodes}
        self.user_inputs = [
            n.name for n in graph.nodes if n.op == "placeholder" and n.name in signature.user_inputs
        ]
        self.state_of_placeholder: dict[str, str] = {
            **signature.inputs_to_parameters,
            **signature.inputs_to_buffers,
            **getattr(signature, "inputs_to_lifted_tensor_constants", {}),
        }
        self.moved: list[str] = []
        # what each node (and the loss) reads from other nodes: parameters are not values
        self.reads = {
            node.name: tuple(
                dict.fromkeys(a.name for a in node.all_input_nodes if a.name not in self.state_of_placeholder)
            )
            for node in graph.nodes
            if node.op in ("call_function", "output")
        }

    def move(self, name: str, stage: int, why: str) -> None:
        if self.stage_of[name] != stage:
            self.moved.append(f"{name}: stage {self.stage_of[name]} -> {stage} ({why})")
            self.stage_of[name] = stage

    def keep_raw_inputs(self) -> None:
        """Raw inputs, and integer tensors computed from them, stay with the data owner."""
        raw = set(self.user_inputs)
        for name in self.ops:
            node = self.nodes[name]
            if any(a.name in raw for a in node.all_input_nodes):
                self.move(name, self.data_stage, "reads raw input")
                info = _value_info(node)
                if info is not None and not info.is_float:
                    raw.add(name)
        for name in self.user_inputs:
            self.stage_of[name] = self.data_stage
        self.stage_of[LOSS] = self.data_stage

    def glue_tuples(self) -> None:
        for name in self.ops:
            node = self.nodes[name]
            if node.target is operator.getitem:
                self.move(name, self.stage_of[node.args[0].name], "element of a tuple")

    def one_stage_per_parameter(self) -> None:
        """All users of a parameter run on one stage (the data owner's if it is one of theirs)."""
        for placeholder, target in self.state_of_placeholder.items():
            users = [u.name for u in self.nodes[placeholder].users if u.op == "call_function"]
            stages = {self.stage_of[u] for u in users}
            if len(stages) > 1:
                home = self.data_stage if self.data_stage in stages else self.stage_of[users[0]]
                for u in users:
                    self.move(u, home, f"shares {target}")

    def triggers_on_the_data_owner(self, wave: Mapping[str, int]) -> None:
        """A segment that reads nothing from other segments would wait for a trigger that
        never comes on another stage: such nodes (positions, masks) run on the data owner."""
        first_wave: dict[tuple[int, int], list[str]] = {}
        for name in self.ops:
            if self.stage_of[name] != self.data_stage:
                first_wave.setdefault((self.stage_of[name], wave[name]), []).append(name)
        for group in first_wave.values():
            members = set(group)
            if all(src in members for n in group for src in self.reads[n]):
                for n in group:
                    self.move(n, self.data_stage, "reads nothing from other stages")

    def run(self) -> dict[str, int]:
        """Applies every rule until none moves a node; the waves of the result."""
        self.keep_raw_inputs()
        while True:
            before = len(self.moved)
            self.glue_tuples()
            self.one_stage_per_parameter()
            self.glue_tuples()
            wave = _waves(self.graph, self.reads, self.stage_of, self.user_inputs)
            self.triggers_on_the_data_owner(wave)
            if len(self.moved) == before:
                return wave


def data_owner_nodes(program: Any) -> frozenset[str]:
    """The operator nodes that run with the data owner whatever the assignment: what
    ``partition``'s rules move there when every other node is on another stage (nodes
    that read the raw inputs, what shares a parameter with them, what reads nothing from
    other stages). A plan pins them to the data owner before it places the rest."""
    ops = op_node_names(program.graph)
    norm = _Normalizer(program, dict.fromkeys(ops, 1), data_stage=0)
    norm.run()
    return frozenset(n for n in ops if norm.stage_of[n] == 0)


def _segments(
    norm: _Normalizer, wave: Mapping[str, int]
) -> tuple[tuple[Segment, ...], dict[str, int], dict[str, list[int]], dict[str, ValueInfo]]:
    """The normalized assignment cut into segments (a stage's nodes of one wave), each
    segment's crossing inputs and outputs, who reads each value, and every crossing value.

    Raises:
        ConfigError: a value crossing stages is not one tensor.
    """
    stage_of, reads, nodes = norm.stage_of, norm.reads, norm.nodes
    for name, srcs in reads.items():
        for src in srcs:
            if stage_of[src] != stage_of[name] and _value_info(nodes[src]) is None:
                raise ConfigError(f"{src!r} -> {name!r} crosses stages but is not one tensor")
    keys: dict[tuple[str, int, int], list[str]] = {("source", norm.data_stage, -1): list(norm.user_inputs)}
    for name in norm.ops:
        keys.setdefault(("ops", stage_of[name], wave[name]), []).append(name)
    ordered = sorted(keys, key=lambda k: (k[2], k[1]))
    ordered.append(("loss", norm.data_stage, wave[LOSS]))
    keys[ordered[-1]] = [LOSS]
    segment_of = {n: i for i, key in enumerate(ordered) for n in keys[key]}
    seg_inputs: list[list[str]] = [[] for _ in ordered]
    seg_outputs: list[list[str]] = [[] for _ in ordered]
    readers: dict[str, list[int]] = {}
    values: dict[str, ValueInfo] = {}
    for name, srcs in reads.items():
        for src in srcs:
            a, b = segment_of[src], segment_of[name]
            if a == b:
                continue
            if src not in seg_inputs[b]:
                seg_inputs[b].append(src)
            if src not in seg_outputs[a]:
                seg_outputs[a].append(src)
            if b not in readers.setdefault(src, []):
                readers[src].append(b)
            info = _value_info(nodes[src])
            if info is not None:  # else both sides are one stage (checked above)
                values[src] = info
    segments = tuple(
        Segment(
            i, key[1], max(key[2], 0), tuple(keys[key]), tuple(seg_inputs[i]), tuple(seg_outputs[i]), key[0]
        )
        for i, key in enumerate(ordered)
    )
    return segments, segment_of, readers, values


def partition(
    program: Any,
    assignment: Mapping[str, int] | Sequence[int],
    n_stages: int,
    *,
    data_stage: int = 0,
) -> Partition:
    """Normalizes ``assignment`` (node name -> stage, or one stage per operator node in
    graph order) and cuts it into segments.

    Raises:
        ConfigError: a stage out of range, an assignment of the wrong length or naming
            unknown nodes, or a graph this runtime cannot split (buffer mutation).
    """
    graph: torch.fx.Graph = program.graph
    mutated = program.graph_signature.buffers_to_mutate
    if mutated:
        raise ConfigError(f"models that mutate buffers cannot be split yet: {sorted(mutated)}")
    if not 0 <= data_stage < n_stages:
        raise ConfigError(f"data_stage {data_stage} not in [0, {n_stages})")
    stage_of = _initial_stages(op_node_names(graph), assignment, n_stages, data_stage)
    norm = _Normalizer(program, stage_of, data_stage)
    wave = norm.run()
    segments, segment_of, readers, values = _segments(norm, wave)
    params: dict[int, list[str]] = {s: [] for s in range(n_stages)}
    for placeholder, target in norm.state_of_placeholder.items():
        users = norm.nodes[placeholder].users
        for stage in dict.fromkeys(stage_of[u.name] for u in users if u.op == "call_function"):
            params[stage].append(target)
    return Partition(
        n_stages=n_stages,
        data_stage=data_stage,
        stage_of=stage_of,
        segments=segments,
        segment_of=segment_of,
        readers={k: tuple(v) for k, v in readers.items()},
        reader_names={
            (value, seg_id): tuple(n for n in segments[seg_id].nodes if value in norm.reads[n])
            for value, seg_ids in readers.items()
            for seg_id in seg_ids
        },
        values=values,
        params={k: tuple(v) for k, v in params.items()},
        moved=tuple(norm.moved),
        fingerprint=graph_fingerprint(graph),
    )
