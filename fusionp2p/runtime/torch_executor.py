"""The PyTorch executor: runs one stage's segments of an exported program with real autograd.

Forward: when all inputs of a segment arrived (from other stages as OpData, or from this
stage's earlier segments), its aten nodes run under autograd with the inputs as fresh
leaves; outputs that other stages read leave as OpData, one per destination stage.
Backward: when the gradients of all of a segment's outputs arrived (summed over the
segments that read them), ``torch.autograd.backward`` fills the parameters' ``.grad`` and
the input leaves' gradients go back to their producers. What backward needs is kept per
(iteration, micro-batch) and freed after it. ``step`` applies the optimizer.

The data owner's executor also holds the source (user inputs) and the loss segments: its
``start`` injects a micro-batch's inputs and labels, and the loss never leaves it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.config import NO_WARMUP, OptimizerConfig, RatioWarmup
from fusionp2p.errors import ProtocolError
from fusionp2p.opdag.split import Partition, Segment
from fusionp2p.records import OpData
from fusionp2p.runtime.executor import Body, Executor, Message
from fusionp2p.runtime.losses import LossFn
from fusionp2p.runtime.opdata_check import check_opdata, reader_segment
from fusionp2p.runtime.stage_state import StageState
from fusionp2p.runtime.tensor_wire import (
    decode_body,
    dtype_name,
    encode_body,
    encode_grad_at,
    max_body_bytes,
)

__all__ = ["TorchExecutor"]

logger = logging.getLogger(__name__)


@dataclass
class _MicroBatch:
    """What one (iteration, micro-batch) keeps between its forward and its backward."""

    received: dict[str, torch.Tensor] = field(default_factory=dict)  # from other stages
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # detached, from this stage's segments
    requires_grad: dict[str, bool] = field(default_factory=dict)  # per value this stage saw
    fwd_done: set[int] = field(default_factory=set)
    bwd_done: set[int] = field(default_factory=set)
    outputs: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # attached, until backward
    leaves: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    grad_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_count: dict[str, int] = field(default_factory=dict)
    grad_seen: set[tuple[str, int]] = field(default_factory=set)  # (value, reader segment)
    forward_seen: set[str] = field(default_factory=set)  # producers whose forward OpData arrived
    sent_kept: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # (value, dst): sparse
    received_kept: dict[str, torch.Tensor] = field(default_factory=dict)  # value: positions it came with
    labels: torch.Tensor | None = None


class TorchExecutor(Executor):
    """Executes stage ``stage`` of ``partition`` over ``program`` (a ``torch.export`` program)."""

    def __init__(
        self,
        program: Any,
        partition: Partition,
        stage: int,
        *,
        job: str,
        n_micro_batches: int,
        optimizer: OptimizerConfig | None = None,
        loss_fn: LossFn | None = None,
        ratios: Mapping[int, float] | None = None,
        materialize: bool = True,
        initial: Mapping[str, torch.Tensor] | None = None,
        plan_version: int = 1,
        device: torch.device | str = "cpu",
        ratio_warmup: RatioWarmup = NO_WARMUP,
    ) -> None:
        """``materialize=False``: ``program`` may be a fake trace; this stage's tensors are
        ``initial``'s (made here: ``opdag.init``) or start empty, for ``load_state`` to fill
        (``missing_state`` says what is still to come).
        ``ratios[stage]``: Top-K ratio of what this stage sends there, from iteration
        the end of ``ratio_warmup`` on; before it, dense at first, then geometrically harder."""
        if not 0 <= stage < partition.n_stages:
            raise ValueError(f"stage {stage} not in [0, {partition.n_stages})")
        if n_micro_batches < 1:
            raise ValueError("n_micro_batches must be >= 1")
        self.stage = stage
        self.job = job
        self.iteration = 0
        self.n_micro_batches = n_micro_batches
        self.partition = partition
        self.loss_fn = loss_fn if stage == partition.data_stage else None
        self.ratios = dict(ratios or {})
        self.ratio_warmup = ratio_warmup
        self.plan_version = plan_version
        self.device = torch.device(device)
        self.losses: dict[int, float] = {}
        self._nodes = {n.name: n for n in program.graph.nodes}
        self._segments = partition.stage_segments(stage)
        self._work_segments = [s.id for s in self._segments if s.kind != "source"]
        signature = program.graph_signature
        placeholders = {
            **signature.inputs_to_parameters,
            **signature.inputs_to_buffers,
            **getattr(signature, "inputs_to_lifted_tensor_constants", {}),
        }
        mine = set(partition.params[stage])
        self.state = StageState(
            program,
            sorted(mine),
            optimizer=optimizer or OptimizerConfig(),
            materialize=materialize,
            initial=initial,
            device=self.device,
        )
        self._placeholder_state = {p: t for p, t in placeholders.items() if t in mine}
        every = {**getattr(program, "constants", {}), **program.state_dict}.values()
        self._largest = max((t.numel() * t.element_size() for t in every), default=0)
        self._mbs: dict[int, _MicroBatch] = {}

    # ----------------------------------------------------------------- validation
    def check(self, header: OpData) -> None:
        check_opdata(
            header, self.partition, stage=self.stage, job=self.job, n_micro_batches=self.n_micro_batches
        )

    def max_message_bytes(self) -> int:
        return max((max_body_bytes(v.shape, v.dtype) for v in self.partition.values.values()), default=0)

    # ----------------------------------------------------------------- data flow
    def accept(self, header: OpData, body: Body) -> list[Message]:
        if header.iteration != self.iteration:
            raise ProtocolError(f"OpData for iteration {header.iteration}, executor is at {self.iteration}")
        self.check(header)
        mb = self._mbs.setdefault(header.micro_batch, _MicroBatch())
        tensor, kept = decode_body(header, body, mb.sent_kept.get((header.producer, header.src_stage)))
        tensor = tensor.to(self.device, non_blocking=True)
        if header.direction == "forward":
            if header.producer in mb.forward_seen:
                raise ProtocolError(
                    f"duplicate forward OpData for {header.producer!r}, micro-batch {header.micro_batch}"
                )
            mb.forward_seen.add(header.producer)
            mb.received[header.producer] = tensor
            if kept is not None:
                mb.received_kept[header.producer] = kept
            mb.requires_grad[header.producer] = header.requires_grad
        else:
            reader = reader_segment(self.partition, header.producer, header.src_stage, header.consumers)
            assert reader is not None  # check() found it
            if not mb.requires_grad.get(header.producer, False):
                raise ProtocolError(
                    f"gradient of {header.producer!r}, which required none (or is not computed yet)"
                )
            if (header.producer, reader.id) in mb.grad_seen:
                raise ProtocolError(f"duplicate gradient of {header.producer!r} from segment {reader.id}")
            mb.grad_seen.add((header.producer, reader.id))
            self._add_grad(mb, header.producer, tensor)
        return self._advance(header.micro_batch)

    def start(
        self, iteration: int, micro_batch: int, inputs: Mapping[str, torch.Tensor], labels: torch.Tensor
    ) -> list[Message]:
        """The data owner injects one micro-batch (only on ``data_stage``)."""
        if self.stage != self.partition.data_stage or self.loss_fn is None:
            raise RuntimeError("only the data owner's executor (with a loss) takes inputs")
        if iteration != self.iteration or not 0 <= micro_batch < self.n_micro_batches:
            raise ValueError(f"cannot start ({iteration}, {micro_batch}) at iteration {self.iteration}")
        source = next(s for s in self._segments if s.kind == "source")
        if set(inputs) != set(source.nodes):
            raise ValueError(f"inputs must be exactly {list(source.nodes)}, got {sorted(inputs)}")
        mb = self._mbs.setdefault(micro_batch, _MicroBatch())
        if source.id in mb.fwd_done:
            raise ValueError(f"micro-batch {micro_batch} already started")
        mb.labels = labels.to(self.device)
        inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
        out: list[Message] = []
        for name, tensor in inputs.items():
            mb.local[name] = tensor
            mb.requires_grad[name] = False
        mb.fwd_done.add(source.id)
        out += self._send_forward(mb, micro_batch, source, {n: inputs[n] for n in source.outputs})
        return out + self._advance(micro_batch)

    def _available(self, mb: _MicroBatch, value: str) -> torch.Tensor | None:
        if self.partition.stage_of[value] == self.stage:
            return mb.local.get(value)
        return mb.received.get(value)

    def _advance(self, micro_batch: int) -> list[Message]:
        """Runs every segment that became ready, forward and backward, until none is."""
        mb = self._mbs[micro_batch]
        out: list[Message] = []
        progress = True
        while progress:
            progress = False
            for seg in self._segments:
                if seg.kind == "source":
                    continue
                if seg.id not in mb.fwd_done and all(self._available(mb, v) is not None for v in seg.inputs):
                    out += self._forward(mb, micro_batch, seg)
                    progress = True
                if seg.id in mb.fwd_done and seg.id not in mb.bwd_done and self._grads_complete(mb, seg):
                    out += self._backward(mb, micro_batch, seg)
                    progress = True
        if all(s in mb.bwd_done for s in self._work_segments):
            # backward is done here: keep only the bookkeeping, free every tensor
            mb.received.clear()
            mb.received_kept.clear()
            mb.sent_kept.clear()
            mb.local.clear()
            mb.grad_sum.clear()
            mb.labels = None
        return out

    def _forward(self, mb: _MicroBatch, micro_batch: int, seg: Segment) -> list[Message]:
        env: dict[str, Any] = {}
        leaves: dict[str, torch.Tensor] = {}
        for value in seg.inputs:
            base = self._available(mb, value)
            assert base is not None
            leaf = base.detach()
            if mb.requires_grad.get(value, False):
                leaf.requires_grad_(True)
            leaves[value] = env[value] = leaf
        mb.fwd_done.add(seg.id)
        if seg.kind == "loss":
            return self._loss(mb, micro_batch, seg, leaves)
        with torch.enable_grad():
            for name in seg.nodes:
                node = self._nodes[name]
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self._lookup(env, a))
                if "device" in kwargs and self.device.type != "cpu":  # traced on the CPU: make it here
                    kwargs = {**kwargs, "device": self.device}
                env[name] = node.target(*args, **kwargs)
        outputs = {v: env[v] for v in seg.outputs}
        mb.leaves[seg.id] = leaves
        mb.outputs[seg.id] = outputs
        for value, tensor in outputs.items():
            mb.local[value] = tensor.detach()
            mb.requires_grad[value] = bool(tensor.requires_grad)
        return self._send_forward(mb, micro_batch, seg, outputs)

    def _lookup(self, env: dict[str, Any], node: torch.fx.Node) -> Any:
        if node.name in env:
            return env[node.name]
        return self.state.tensors[self._placeholder_state[node.name]]

    def _ratio(self, stage: int) -> float:
        return self.ratio_warmup.ratio(self.ratios.get(stage, 1.0), self.iteration)

    def _send_forward(
        self, mb: _MicroBatch, micro_batch: int, seg: Segment, outputs: Mapping[str, torch.Tensor]
    ) -> list[Message]:
        out = []
        for value, tensor in outputs.items():
            stages = dict.fromkeys(
                self.partition.segments[r].stage
                for r in self.partition.readers.get(value, ())
                if self.partition.segments[r].stage != self.stage
            )
            for dst in stages:
                compression, body, kept = encode_body(tensor, self._ratio(dst))
                if kept is not None and tensor.requires_grad:
                    mb.sent_kept[value, dst] = kept
                consumers = self.partition.reader_nodes(value, dst)
                header = self._opdata(
                    "forward", value, consumers, tensor, micro_batch, dst, compression, body
                )
                out.append(Message(header, body))
        return out

    def _opdata(
        self,
        direction: str,
        value: str,
        consumers: Sequence[str],
        like: torch.Tensor,
        micro_batch: int,
        dst: int,
        compression: bytes,
        body: Body,
        *,
        zero: bool = False,
    ) -> OpData:
        return OpData(
            job=self.job,
            direction=direction,
            producer=value,
            consumers=tuple(consumers),
            requires_grad=direction == "forward" and bool(like.requires_grad),
            iteration=self.iteration,
            micro_batch=micro_batch,
            shape=tuple(like.shape),
            dtype=dtype_name(like.dtype),
            body_bytes=len(body),
            compression=compression,
            zero=zero,
            src_stage=self.stage,
            dst_stage=dst,
            plan_version=self.plan_version,
        )

    def _loss(
        self, mb: _MicroBatch, micro_batch: int, seg: Segment, leaves: dict[str, torch.Tensor]
    ) -> list[Message]:
        assert self.loss_fn is not None and mb.labels is not None
        output_node = self._nodes[seg.nodes[0]]
        outputs = [self._lookup(leaves, a) for a in output_node.all_input_nodes]
        with torch.enable_grad():
            loss = self.loss_fn(outputs, mb.labels)
            self.losses[micro_batch] = float(loss.detach())
            if loss.requires_grad:
                (loss / self.n_micro_batches).backward()
        mb.bwd_done.add(seg.id)
        return self._send_input_grads(mb, micro_batch, seg, leaves)

    def _grads_complete(self, mb: _MicroBatch, seg: Segment) -> bool:
        return all(
            mb.grad_count.get(v, 0) == len(self.partition.readers[v])
            for v in seg.outputs
            if mb.requires_grad.get(v, False)
        )

    def _add_grad(self, mb: _MicroBatch, value: str, grad: torch.Tensor) -> None:
        if value in mb.grad_sum:
            mb.grad_sum[value] = mb.grad_sum[value] + grad
        else:
            mb.grad_sum[value] = grad
        mb.grad_count[value] = mb.grad_count.get(value, 0) + 1

    def _backward(self, mb: _MicroBatch, micro_batch: int, seg: Segment) -> list[Message]:
        outputs = mb.outputs.pop(seg.id)
        pairs = [
            (t, mb.grad_sum.pop(v)) for v, t in outputs.items() if mb.requires_grad.get(v) and t.requires_grad
        ]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs])
        mb.bwd_done.add(seg.id)
        return self._send_input_grads(mb, micro_batch, seg, mb.leaves.pop(seg.id))

    def _send_input_grads(
        self, mb: _MicroBatch, micro_batch: int, seg: Segment, leaves: Mapping[str, torch.Tensor]
    ) -> list[Message]:
        out = []
        for value, leaf in leaves.items():
            if not leaf.requires_grad:
                continue
            grad = leaf.grad
            src = self.partition.stage_of[value]
            if src == self.stage:
                self._add_grad(mb, value, grad if grad is not None else torch.zeros_like(leaf))
                continue
            kept = mb.received_kept.get(value)
            body: Body
            if grad is None:
                compression, body = b"", b""
            elif kept is not None:  # it came sparse: its exact gradient lives on the kept positions
                compression, body = encode_grad_at(grad, kept)
            else:
                compression, body, _ = encode_body(grad, self._ratio(src))
            consumers = self.partition.reader_names[value, seg.id]
            header = self._opdata(
                "backward", value, consumers, leaf, micro_batch, src, compression, body, zero=grad is None
            )
            out.append(Message(header, body))
        return out

    # ----------------------------------------------------------------- optimizer and state
    def micro_batches_done(self, iteration: int) -> int:
        if iteration != self.iteration:
            return 0
        done = 0
        for i in range(self.n_micro_batches):
            mb = self._mbs.get(i)
            finished = mb.bwd_done if mb is not None else set()
            done += all(s in finished for s in self._work_segments)
        return done

    def step(self, iteration: int) -> None:
        if iteration != self.iteration:
            raise ProtocolError(f"step for iteration {iteration}, executor is at {self.iteration}")
        self.state.step()
        self.iteration += 1
        self._mbs.clear()
        self.losses.clear()

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """This stage's trainable parameters, by state name."""
        return self.state.params

    def state_dict(self) -> bytes:
        return self.state.save()

    def full_state(self) -> bytes:
        return self.state.save_full()

    def full_state_parts(self, limit: int) -> Iterator[bytes]:
        return self.state.save_full_parts(limit)

    def largest_tensor_bytes(self) -> int:
        return self._largest

    def grads(self) -> bytes:
        return self.state.grads()

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.state.grad_tensors()

    def param_tensors(self) -> list[torch.Tensor]:
        return self.state.param_tensors()

    def load_state(self, data: bytes | bytearray) -> int:
        return self.state.load(data)

    def missing_state(self) -> int:
        return len(self.state.missing)

    def state_sizes(self) -> dict[str, int]:
        return self.state.sizes()
