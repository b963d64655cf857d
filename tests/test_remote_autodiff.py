"""Exact remote autodiff: a model split over real `fusionp2p peer` processes on loopback.

The data owner (this test process, stage 0: raw inputs, labels, loss) drives three
micro-batches per iteration through stages run by other OS processes over libp2p
streams. Losses, every parameter's gradient and the parameters after two AdamW steps
must equal the monolithic model's (float32).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from exec_helpers import Identities, first_forward, user_model_swarm
from masked_reference import masked_reference

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import PeerUnreachableError
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.opdag.split import op_node_names
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import EXEC_PROTOCOL, ModelSpec, pack_message
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES

N_MB, BATCH, SEQ = 3, 2, 8
# Some gradients are exactly zero in theory (GPT-2's key bias: softmax ignores a per-row
# shift) and ~1e-10 of rounding noise in practice; AdamW divides by sqrt(v) + eps, so with
# eps=1e-8 that noise becomes a step of any size up to lr. eps=1e-6 keeps it below lr/1000.
OPT = OptimizerConfig(lr=1e-2, eps=1e-6, weight_decay=0.01)
GPT2 = ModelSpec(
    "gpt2",
    {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 32},
    input_shape=(BATCH, SEQ),
    seed=3,
)
LLAMA = ModelSpec(
    "llama",
    {
        "num_hidden_layers": 4,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 97,
        "max_position_embeddings": 64,
    },
    input_shape=(BATCH, SEQ),
    seed=4,
)
LOCAL = ModelRegistry(allow=["user_models:SkipNet"])  # what this test process builds itself
SKIPNET = ModelSpec(
    "user_models:SkipNet", {"features": 12}, input_shape=(4, 12), input_dtype="float32", seed=5
)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("exec"))
    with user_model_swarm(3, swarm="exec", workdir=workdir) as s:
        yield s


@pytest.fixture(scope="module")
def owner(swarm: LocalSwarm) -> Iterator[tuple[asyncio.AbstractEventLoop, P2PTransport]]:
    clients = Identities(swarm.initial_peers, 1)
    yield clients.loop, clients.transports[0]
    clients.close()


def _assignment(spec: ModelSpec, n_stages: int, layout: str) -> list[int]:
    """A stage per operator node: contiguous thirds, cuts inside blocks, or blocks round-robin."""
    traced = trace_spec(spec, LOCAL)
    ops = op_node_names(traced.program.graph)
    n = len(ops)
    if layout == "contiguous":
        return [i * n_stages // n for i in range(n)]
    if layout == "mid-block":  # cuts at 40% and 70%: inside blocks, so the residual stream crosses too
        return [0 if i < 0.4 * n else 1 if i < 0.7 * n else 2 for i in range(n)]
    return [(i * 2 * n_stages // n) % n_stages for i in range(n)]  # each stage owns two distant pieces


def _batches(spec: ModelSpec, iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + iteration)
    if spec.input_dtype == "int64":
        ids = [torch.randint(0, 97, spec.input_shape, generator=g) for _ in range(N_MB)]
        return [(x, x) for x in ids]
    return [
        (torch.randn(spec.input_shape, generator=g), torch.randint(0, 5, spec.input_shape[:1], generator=g))
        for _ in range(N_MB)
    ]


def _reference(spec: ModelSpec, loss: str, iterations: int):
    """Losses, gradients and final parameters of the monolithic model, same data, same AdamW."""
    model = build_model(spec, LOCAL)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    names = dict(model.named_parameters(remove_duplicate=False))
    losses, grads = [], []
    for it in range(iterations):
        opt.zero_grad()
        step_losses = []
        for x, y in _batches(spec, it):
            value = LOSSES[loss]([model(x)], y)
            step_losses.append(value.item())
            (value / N_MB).backward()
        losses.append(step_losses)
        grads.append({k: p.grad.clone() for k, p in names.items()})
        opt.step()
    n_params = sum(p.numel() for p in model.parameters())  # a tied parameter once
    return losses, grads, {k: p.detach().clone() for k, p in names.items()}, n_params


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-7, rtol: float = 1e-5) -> None:
    scale = want.abs().max().item() + 1e-8
    err = (got - want).abs().max().item()
    assert err <= rtol * scale + atol, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def _run(owner, swarm: LocalSwarm, spec: ModelSpec, n_stages: int, layout: str, loss: str) -> PipelineDriver:
    loop, transport = owner
    stages = swarm.peers[: n_stages - 1]
    runtime = RuntimeLayout(
        (transport.peer_id, *(p.peer_id for p in stages)), _assignment(spec, n_stages, layout)
    )
    ref_losses, ref_grads, ref_params, n_params = _reference(spec, loss, iterations=2)

    async def main() -> PipelineDriver:
        driver = await PipelineDriver.create(
            transport,
            spec,
            runtime,
            JobOptions(n_micro_batches=N_MB, optimizer=OPT, loss=loss, timeout=60),
            addresses={p.peer_id: p.multiaddrs for p in stages},
        )
        try:
            for it in range(2):
                losses = await driver.run_iteration(_batches(spec, it))
                assert losses == pytest.approx(ref_losses[it], rel=1e-5, abs=1e-6)
                grads = await driver.fetch("grads")
                assert set(grads) <= set(ref_grads[it])
                assert sum(t.numel() for t in grads.values()) == n_params
                for name, grad in grads.items():  # after a step: the parameters' Adam tolerance, below
                    rtol = 1e-5 if it == 0 else 1e-4
                    _close(grad, ref_grads[it][name], f"iteration {it} grad of {name}", rtol=rtol)
                await driver.step()
            params = await driver.fetch("params")
            for name, value in params.items():  # Adam divides by sqrt(v): where a gradient is near 0,
                # float-order differences of ~1e-7 move the update by up to ~1e-3 of a step
                _close(value, ref_params[name], f"parameter {name} after 2 steps", atol=1e-2 * OPT.lr)
        finally:
            await driver.aclose()
        return driver

    return loop.run_until_complete(main())


@pytest.mark.parametrize(
    ("spec", "n_stages", "layout"),
    [
        (GPT2, 2, "contiguous"),
        (GPT2, 3, "mid-block"),
        (GPT2, 4, "interleaved"),
        (LLAMA, 2, "contiguous"),
        (LLAMA, 3, "mid-block"),
        (LLAMA, 4, "interleaved"),
    ],
    ids=lambda v: v.family if isinstance(v, ModelSpec) else str(v),
)
def test_split_causal_lm_is_exact(
    owner, swarm: LocalSwarm, spec: ModelSpec, n_stages: int, layout: str
) -> None:
    driver = _run(owner, swarm, spec, n_stages, layout, "lm")
    part = driver.partition
    stages = {s.stage for s in part.segments if s.kind == "ops"}
    assert stages == set(range(n_stages)), f"every stage must run nodes, got {stages}"
    if layout == "mid-block":  # some segment reads two tensors from one other stage: a residual crosses
        assert any(
            sum(part.stage_of[v] == other for v in seg.inputs) >= 2
            for seg in part.segments
            for other in range(n_stages)
            if other != seg.stage
        )
    if layout == "interleaved":  # a stage runs two segments with another stage's work in between
        assert any(
            len({s.wave for s in part.stage_segments(st) if s.kind == "ops"}) >= 2
            for st in range(1, n_stages)
        )
    if spec.family == "gpt2":  # tied embedding / LM head: both users run on one stage
        assert any("lm_head" in note for note in part.moved) or n_stages == 1


def test_user_model_with_skip_connection_is_exact(owner, swarm: LocalSwarm) -> None:
    driver = _run(owner, swarm, SKIPNET, 3, "contiguous", "classification")
    crossing = {v for seg in driver.partition.segments for v in seg.inputs}
    assert len(crossing) >= 3  # the long skip h0 crosses beside the main path


async def _two_stage_classifier(transport, spec: ModelSpec, peer, ratios=None) -> PipelineDriver:
    """Stage 0 here, stage 1 on ``peer``, split in the middle."""
    return await PipelineDriver.create(
        transport,
        spec,
        RuntimeLayout((transport.peer_id, peer.peer_id), _assignment(spec, 2, "contiguous"), ratios or {}),
        JobOptions(n_micro_batches=N_MB, optimizer=OPT, loss="classification"),
        addresses={peer.peer_id: peer.multiaddrs},
    )


def test_garbage_opdata_is_rejected_and_the_stage_keeps_serving(owner, swarm: LocalSwarm) -> None:
    loop, transport = owner
    spec = SKIPNET
    peer = swarm.peers[0]

    async def main() -> None:
        driver = await _two_stage_classifier(transport, spec, peer)
        try:
            good = first_forward(driver.partition, driver.job)
            info = driver.partition.values[good.producer]
            body = bytes(good.body_bytes)

            bad = {
                "wrong shape": dataclasses.replace(good, shape=(info.shape[0] + 1, *info.shape[1:])),
                "wrong dtype": dataclasses.replace(good, dtype="float16", body_bytes=good.body_bytes // 2),
                "wrong iteration": dataclasses.replace(good, iteration=7),
                "wrong micro-batch": dataclasses.replace(good, micro_batch=N_MB),
                "unknown producer": dataclasses.replace(good, producer="no_such_node"),
                "wrong job": dataclasses.replace(good, job="another-job"),
            }

            async def ask(stream, payload: bytes) -> FrameKind:
                await stream.send(FrameKind.DATA, payload, timeout=10)
                kind, reply = await stream.recv(max_payload=1 << 20, timeout=10)
                assert kind is FrameKind.ACK or reply
                return kind

            stream = await transport.open(peer.peer_id, EXEC_PROTOCOL, timeout=10)
            try:  # refused but well-framed: an ERROR each, and the stream lives on
                for what, header in bad.items():
                    assert (
                        await ask(stream, pack_message(header, bytes(header.body_bytes))) is FrameKind.ERROR
                    ), what
                header = dataclasses.replace(good, micro_batch=1)
                assert await ask(stream, pack_message(header, body)) is FrameKind.ACK
            finally:
                await stream.close()
            broken = {
                "not a record": b"\x00\x05not-a-record",
                "body shorter than its header says": pack_message(good, body)[:-4],
            }
            for what, payload in broken.items():  # an ERROR, then the stream is closed
                stream = await transport.open(peer.peer_id, EXEC_PROTOCOL, timeout=10)
                try:
                    assert await ask(stream, payload) is FrameKind.ERROR, what
                    with pytest.raises(PeerUnreachableError):
                        await stream.recv(max_payload=1 << 20, timeout=10)
                finally:
                    await stream.close()
        finally:
            await driver.aclose()

    loop.run_until_complete(main())
    assert "protocol error: rejected" in peer.log()
    # the stage still serves a whole exact job afterwards
    _run(owner, swarm, SKIPNET, 2, "contiguous", "classification")


def test_topk_between_peer_processes_is_the_exact_gradient_of_the_compressed_model(owner, swarm) -> None:
    """Top-K (ratio 8) on both directions of the link to a peer process: the losses and
    gradients of the compressed model whose cut tensors are Top-K-masked."""
    loop, transport = owner
    spec = ModelSpec(
        "user_models:SkipNet", {"hidden": 64}, input_shape=(8, 12), input_dtype="float32", seed=6
    )
    peer = swarm.peers[1]
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(N_MB)]

    async def main():
        driver = await _two_stage_classifier(transport, spec, peer, ratios={(1, 0): 8.0, (0, 1): 8.0})
        try:
            losses = await driver.run_iteration(batches)
            return driver, losses, await driver.fetch("grads")
        finally:
            await driver.aclose()

    driver, losses, grads = loop.run_until_complete(main())
    real = trace_spec(spec, LOCAL)  # the driver traced fake: the reference runs the real model
    assert real.dag.fingerprint == driver.traced.dag.fingerprint
    ref_losses, ref_grads = masked_reference(real.program, driver.partition, batches, 8.0, "classification")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        _close(grad, ref_grads[name], f"grad of {name} with Top-K on the link")
