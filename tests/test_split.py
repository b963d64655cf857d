"""Sub-DAG extraction and the PyTorch executor, in one process (messages routed by hand).

The multi-process, libp2p version of the exactness checks is test_remote_autodiff.py;
here many more assignments (random ones included) run in seconds.
"""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest
import torch
from masked_reference import masked_reference
from user_models import SkipNet

from fusionp2p.config import OptimizerConfig, RatioWarmup
from fusionp2p.errors import ConfigError, ProtocolError, RecordError
from fusionp2p.opdag.families import ModelRegistry, UnknownModelError
from fusionp2p.opdag.spec import build_model, example_input
from fusionp2p.opdag.split import LOSS, op_node_names, partition
from fusionp2p.opdag.trace import trace_module
from fusionp2p.records import ModelSpec, OpData, TopKHeader
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.tensor_wire import decode_body, encode_body
from fusionp2p.runtime.torch_executor import TorchExecutor

GPT2 = ModelSpec(
    "gpt2", {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 53, "n_positions": 16}, input_shape=(2, 6)
)
N_MB = 2
LOCAL = ModelRegistry(allow=["user_models:SkipNet"])  # this test process's own model


@pytest.fixture(scope="module")
def gpt2():
    return trace_module(build_model(GPT2), [example_input(GPT2)], strip_prefix="model.")


def _run_inprocess(
    spec: ModelSpec, traced, assignment, n_stages: int, loss: str, batches, ratios=None, sent=None, exes=None
):
    part = partition(traced.program, assignment, n_stages)
    opt = OptimizerConfig(lr=1e-2, eps=1e-6)
    exes = exes or [
        TorchExecutor(
            traced.program,
            part,
            s,
            job="j",
            n_micro_batches=len(batches),
            optimizer=opt,
            loss_fn=LOSSES[loss],
            ratios=ratios,
        )
        for s in range(n_stages)
    ]
    it = exes[0].iteration
    queue = []
    for m, (x, y) in enumerate(batches):
        queue += exes[0].start(it, m, {part.segments[0].nodes[0]: x}, y)
        while queue:
            msg = queue.pop(0)
            if sent is not None:
                sent.append(msg)
            queue += exes[msg.header.dst_stage].accept(msg.header, msg.body)
    assert all(e.ready_to_step(it, len(batches)) for e in exes)
    grads = {k: p.grad for e in exes for k, p in e.params.items()}
    return part, exes, [exes[0].losses[m] for m in range(len(batches))], grads


def _reference(spec: ModelSpec, loss: str, batches):
    model = build_model(spec, LOCAL)
    losses = []
    for x, y in batches:
        value = LOSSES[loss]([model(x)], y)
        losses.append(value.item())
        (value / len(batches)).backward()
    return losses, {k: p.grad for k, p in model.named_parameters(remove_duplicate=False)}


def _lm_batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 53, GPT2.input_shape, generator=g) for _ in range(N_MB)]
    return [(x, x) for x in ids]


@pytest.mark.parametrize("seed", range(6))
def test_random_assignments_are_exact(gpt2, seed: int) -> None:
    """Any stage for any node, even scattered op by op: same loss and gradients."""
    rng = random.Random(seed)
    n_stages = rng.choice([2, 3, 4])
    ops = op_node_names(gpt2.program.graph)
    assignment = [rng.randrange(n_stages) for _ in ops]
    batches = _lm_batches(seed)
    part, exes, losses, grads = _run_inprocess(GPT2, gpt2, assignment, n_stages, "lm", batches)
    ref_losses, ref_grads = _reference(GPT2, "lm", batches)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for executor in exes:  # after backward nothing of the micro-batches is kept
        for mb in executor._mbs.values():
            assert not (mb.received or mb.local or mb.outputs or mb.leaves or mb.grad_sum)
    waves = [s.wave for s in part.segments]
    assert waves == sorted(waves)
    for seg in part.segments:  # every edge between segments goes to a later segment
        for value in seg.inputs:
            assert part.segment_of[value] < seg.id


def test_raw_inputs_and_loss_stay_with_the_data_owner(gpt2) -> None:
    ops = op_node_names(gpt2.program.graph)
    part = partition(gpt2.program, [1] * len(ops), 2, data_stage=0)
    assert part.stage_of["input_ids"] == 0 and part.stage_of[LOSS] == 0
    # the token ids are read (and reshaped) on the data owner: what leaves it is not them,
    # nor any integer tensor computed from them
    nodes = {n.name: n for n in gpt2.program.graph.nodes}

    def from_input(name: str) -> bool:
        return name == "input_ids" or any(from_input(a.name) for a in nodes[name].all_input_nodes)

    crossing = [v for v in part.values if part.stage_of[v] == 0 and part.reader_nodes(v, 1)]
    assert crossing
    assert all(part.values[v].is_float for v in crossing if from_input(v))


def test_tied_parameter_users_share_a_stage(gpt2) -> None:
    ops = op_node_names(gpt2.program.graph)
    part = partition(gpt2.program, [0] * (len(ops) // 2) + [1] * (len(ops) - len(ops) // 2), 2)
    tied = [t for stage in part.params.values() for t in stage if "lm_head" in t or "wte" in t]
    assert len(tied) == 1, part.params  # one owner of the tied weight
    assert any("lm_head" in note for note in part.moved)


def test_bad_assignments_are_rejected(gpt2) -> None:
    ops = op_node_names(gpt2.program.graph)
    with pytest.raises(ConfigError, match="operator nodes"):
        partition(gpt2.program, [0] * (len(ops) - 1), 2)
    with pytest.raises(ConfigError, match="outside"):
        partition(gpt2.program, [5] * len(ops), 2)
    with pytest.raises(ConfigError, match="does not have"):
        partition(gpt2.program, {**dict.fromkeys(ops, 0), "nope": 1}, 2)


def test_user_model_with_skip_connection_splits_exactly() -> None:
    spec = ModelSpec("user_models:SkipNet", {}, input_shape=(4, 12), input_dtype="float32")
    assert isinstance(build_model(spec, LOCAL), SkipNet)
    traced = trace_module(build_model(spec, LOCAL), [example_input(spec)])
    ops = op_node_names(traced.program.graph)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 12, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(3)]
    for assignment in ([i * 3 // len(ops) for i in range(len(ops))], [i % 2 for i in range(len(ops))]):
        _, _, losses, grads = _run_inprocess(
            spec, traced, assignment, max(assignment) + 1, "classification", batches
        )
        ref_losses, ref_grads = _reference(spec, "classification", batches)
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7)


def test_executor_rejects_bad_opdata_and_keeps_its_state(gpt2) -> None:
    ops = op_node_names(gpt2.program.graph)
    part, exes, _, _ = _run_inprocess(
        GPT2, gpt2, [i * 2 // len(ops) for i in range(len(ops))], 2, "lm", _lm_batches(1)
    )
    stage1 = exes[1]
    value = next(v for v in part.values if part.stage_of[v] == 0 and part.reader_nodes(v, 1))
    info = part.values[value]
    tensor = torch.randn(info.shape)
    _, body, _ = encode_body(tensor)
    good = OpData(
        job="j",
        direction="forward",
        producer=value,
        consumers=part.reader_nodes(value, 1),
        requires_grad=True,
        iteration=0,
        micro_batch=0,
        shape=info.shape,
        dtype=info.dtype,
        body_bytes=len(body),
        src_stage=0,
        dst_stage=1,
    )
    bad = [
        dataclasses.replace(good, iteration=3),
        dataclasses.replace(good, micro_batch=N_MB),
        dataclasses.replace(good, producer="ghost"),
        dataclasses.replace(good, consumers=("ghost",)),
        dataclasses.replace(good, shape=(1, *info.shape)),
        dataclasses.replace(good, dtype="float16", body_bytes=len(body) // 2),
        dataclasses.replace(good, body_bytes=len(body) + 4),
        dataclasses.replace(good, job="other"),
        dataclasses.replace(good, dst_stage=0, src_stage=1),
        dataclasses.replace(good, direction="backward"),  # stage 1 does not produce it
    ]
    for header in bad:
        with pytest.raises(ProtocolError):
            stage1.accept(header, body[: header.body_bytes])
    with pytest.raises(ProtocolError, match="body"):
        stage1.accept(good, body[:-4])
    with pytest.raises(ProtocolError, match="duplicate"):  # micro-batch 0 already ran forward
        stage1.accept(good, body)


def test_opdata_record_round_trip_and_limits() -> None:
    header = OpData(
        job="j1",
        direction="backward",
        producer="add_3",
        consumers=("linear_4", "layer_norm_2"),
        requires_grad=False,
        iteration=2,
        micro_batch=1,
        shape=(2, 6, 16),
        dtype="float32",
        body_bytes=0,
        zero=True,
        src_stage=1,
        dst_stage=0,
    )
    assert OpData.from_wire(header.to_wire()) == header
    with pytest.raises(RecordError):
        OpData(**{**dataclasses.asdict(header), "direction": "sideways"})
    with pytest.raises(RecordError):
        OpData(**{**dataclasses.asdict(header), "consumers": ()})
    wire = header.to_wire().replace(b"float32", b"float99")
    with pytest.raises(RecordError):
        OpData.from_wire(wire)


def test_tensor_bodies_round_trip_dense_and_topk() -> None:
    x = torch.randn(4, 50)
    for ratio in (1.0, 10.0):
        compression, body, kept = encode_body(x, ratio)
        header = OpData(
            job="j",
            direction="forward",
            producer="p",
            consumers=("c",),
            requires_grad=True,
            iteration=0,
            micro_batch=0,
            shape=(4, 50),
            dtype="float32",
            body_bytes=len(body),
            compression=compression,
        )
        y, got_kept = decode_body(header, body)
        assert (kept is None) == (ratio == 1.0) and (got_kept is None) == (ratio == 1.0)
        if ratio == 1.0:
            assert torch.equal(x, y)
        else:
            assert int((y != 0).sum()) == 20 and len(body) < x.numel() * 4 / 3
            with pytest.raises(ProtocolError):
                decode_body(dataclasses.replace(header, shape=(200,)), body)
            assert kept is not None and got_kept is not None and torch.equal(kept, got_kept)


def test_model_spec_json_is_validated() -> None:
    assert ModelSpec.from_wire(GPT2.to_wire()) == GPT2
    base = {"kind": "model_spec", "v": 1, "family": "gpt2"}
    for body in ([], {**base, "family": 3}, {**base, "input_shape": [0]}, {**base, "input_dtype": "complex"}):
        with pytest.raises(RecordError):
            ModelSpec.from_wire(msgpack.packb(body))
    with pytest.raises(RecordError):
        ModelSpec.from_wire(b"{")
    with pytest.raises(UnknownModelError, match="no-such-model"):
        build_model(ModelSpec("no-such-model"))
    with pytest.raises(UnknownModelError, match="--allow-model no_such_module:Thing"):
        build_model(ModelSpec("no_such_module:Thing"))  # an import path is never imported unless allowed
    with pytest.raises(ConfigError, match="cannot import"):
        ModelRegistry(allow=["no_such_module:Thing"])
    a, b = build_model(GPT2), build_model(GPT2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_topk_on_the_wire_gives_the_exact_gradient_of_the_compressed_forward() -> None:
    """With Top-K between stages, the split model computes exactly the gradient of the model
    whose cut tensors are Top-K-masked; gradients go back at the forward's positions."""
    spec = ModelSpec("user_models:SkipNet", {"hidden": 64}, input_shape=(8, 12), input_dtype="float32")
    traced = trace_module(build_model(spec, LOCAL), [example_input(spec)])
    ops = op_node_names(traced.program.graph)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
    sent: list = []
    assignment = [i * 2 // len(ops) for i in range(len(ops))]
    part, _, losses, grads = _run_inprocess(
        spec, traced, assignment, 2, "classification", batches, ratios={0: 8.0, 1: 8.0}, sent=sent
    )
    ref_losses, ref_grads = masked_reference(traced.program, part, batches, 8.0, "classification")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    forward = [m for m in sent if m.header.direction == "forward" and m.header.compression]
    backward = [m for m in sent if m.header.direction == "backward" and m.header.compression]
    assert forward and backward
    for m in backward:  # values only, at the positions the forward kept
        header = TopKHeader.from_wire(m.header.compression)
        assert header.index_format == "shared" and len(m.body) == 4 * header.k
        assert header.k * 8 <= header.numel + 8


def test_ratio_warmup_starts_dense_and_grows_to_the_plan_s_ratios() -> None:
    spec = ModelSpec("user_models:SkipNet", {"hidden": 64}, input_shape=(8, 12), input_dtype="float32")
    traced = trace_module(build_model(spec, LOCAL), [example_input(spec)])
    ops = op_node_names(traced.program.graph)
    assignment = [i * 2 // len(ops) for i in range(len(ops))]
    part = partition(traced.program, assignment, 2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(2)]
    exes = [
        TorchExecutor(
            traced.program,
            part,
            s,
            job="j",
            n_micro_batches=len(batches),
            loss_fn=LOSSES["classification"],
            ratios={0: 8.0, 1: 8.0},
            ratio_warmup=RatioWarmup(2),
        )
        for s in range(2)
    ]
    for it, want in enumerate([None, 8.0**0.5, 8.0]):  # dense, then geometrically to the ratio
        sent: list = []
        _run_inprocess(spec, traced, assignment, 2, "classification", batches, sent=sent, exes=exes)
        compressed = [m for m in sent if m.header.compression and m.header.direction == "forward"]
        assert sent and bool(compressed) == (want is not None), it
        for m in compressed:
            assert TopKHeader.from_wire(m.header.compression).ratio == pytest.approx(want)
        for e in exes:
            e.step(it)
