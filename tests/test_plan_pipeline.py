"""One Plan drives the runtime: OP-Fence and baseline plans train exactly over peer processes.

``owner.plan(spec)`` (``owner = swarm.data_owner()``) measures this process (the data owner)
and its links, runs the planner on the live records, and ``owner.pipeline(spec, plan=plan)``
runs what it planned: the
losses, gradients and parameters after two AdamW steps equal the monolithic model's. The
runtime's OpData carry the plan's version; another version is refused.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Iterator

import pytest
import torch
from exec_helpers import first_forward, user_model_swarm

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ConfigError, ProtocolError
from fusionp2p.launch import LocalSwarm
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.planning import Plan
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.codec import ExecClient
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.swarm import Swarm

N_MB = 3
OPT = OptimizerConfig(lr=1e-2, eps=1e-6)
GPT2 = ModelSpec(
    "gpt2", {"n_layer": 3, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 32}, input_shape=(2, 8)
)
SKIPNET = ModelSpec("user_models:SkipNet", {"hidden": 32}, input_shape=(4, 12), input_dtype="float32", seed=1)
LOCAL = ModelRegistry(allow=["user_models:SkipNet"])


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    with (
        user_model_swarm(3, swarm="plans", workdir=str(tmp_path_factory.mktemp("plans"))) as local,
        Swarm(local.initial_peers, swarm=local.swarm) as client,
    ):
        _wait_for_peers(client, local)
        yield client


def _options(plan: Plan) -> JobOptions:
    return JobOptions(n_micro_batches=plan.n_micro_batches, optimizer=OPT)


def _wait_for_peers(client: Swarm, local: LocalSwarm) -> None:
    for _ in range(60):
        if len(client.peers()) == len(local.peers):
            return
        time.sleep(0.5)
    pytest.fail("the peers did not show up")


def _batches(spec: ModelSpec, iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(300 + iteration)
    if spec.input_dtype == "int64":
        return [(x, x) for x in (torch.randint(0, 97, spec.input_shape, generator=g) for _ in range(N_MB))]
    return [
        (torch.randn(spec.input_shape, generator=g), torch.randint(0, 5, spec.input_shape[:1], generator=g))
        for _ in range(N_MB)
    ]


def _exact(client: Swarm, spec: ModelSpec, plan: Plan, loss: str) -> None:
    model = build_model(spec, LOCAL)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    options = JobOptions(n_micro_batches=plan.n_micro_batches, optimizer=OPT, loss=loss)
    with client.data_owner().pipeline(spec, plan=plan, options=options, registry=LOCAL) as pipe:
        assert pipe.plan is plan and pipe.partition.n_stages == len(set(plan.peer_ids))  # its own too
        for it in range(2):
            opt.zero_grad()
            want = []
            for x, y in _batches(spec, it):
                value = LOSSES[loss]([model(x)], y)
                want.append(value.item())
                (value / N_MB).backward()
            assert pipe.run_iteration(_batches(spec, it)) == pytest.approx(want, rel=1e-5, abs=1e-6)
            grads = dict(model.named_parameters(remove_duplicate=False))
            for name, grad in pipe.fetch("grads").items():
                torch.testing.assert_close(grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
            pipe.step()
            opt.step()
        reference = dict(model.named_parameters(remove_duplicate=False))
        for name, value in pipe.fetch("params").items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("method", ["op-fence", "equal-number/none", "equal-computation/none"])
def test_a_plan_trains_exactly(swarm: Swarm, method: str) -> None:
    plan = swarm.data_owner().plan(GPT2, method=method, n_micro_batches=N_MB)
    assert plan.dag.startswith("gpt2@") and plan.n_micro_batches == N_MB
    assert math.isfinite(plan.iteration_s) and plan.method.startswith(method.split("/")[0])
    (me,) = set(plan.peer_ids) - {p.peer_id for p in swarm.peers()}  # this process, the data owner ...
    assert plan.peer_ids[0] == plan.peer_ids[-1] == me and me not in plan.peer_ids[1:-1]  # ... at both ends
    if method == "equal-number/none":
        assert len(set(plan.peer_ids[1:-1])) == 3  # every peer gets a share of the rest
    _exact(swarm, GPT2, plan, "lm")


def test_a_user_model_trains_exactly_on_the_default_plan(swarm: Swarm) -> None:
    plan = swarm.data_owner().plan(SKIPNET, n_micro_batches=N_MB, registry=LOCAL)
    _exact(swarm, SKIPNET, plan, "classification")


def test_a_resnet_trains_exactly_on_the_default_plan(swarm: Swarm) -> None:
    spec = ModelSpec(
        "resnet",
        {"depth": 18, "num_classes": 5, "width": 8},
        input_shape=(4, 3, 32, 32),
        input_dtype="float32",
    )
    plan = swarm.data_owner().plan(spec, n_micro_batches=N_MB)
    _exact(swarm, spec, plan, "classification")


def test_the_pipeline_estimate_counts_what_runs(swarm: Swarm) -> None:
    owner = swarm.data_owner()
    topology = owner.topology()
    plan = owner.plan(GPT2, method="equal-number/none", n_micro_batches=N_MB, topology=topology)
    with owner.pipeline(GPT2, plan=plan, options=_options(plan)) as pipe:
        est = pipe.estimate(topology)
        ops = sum(1 for seg in pipe.partition.segments if seg.kind != "source")
        assert len(est.compute_s) == ops  # one estimated stage per segment, the data owner's and its loss too
        assert 0 < est.critical_path_s <= est.pipelined_s < math.inf


def test_a_plan_of_another_model_or_size_is_refused(swarm: Swarm) -> None:
    owner = swarm.data_owner()
    plan = owner.plan(GPT2, method="equal-number/none", n_micro_batches=N_MB)
    other = dataclasses.replace(GPT2, config={**GPT2.config, "n_layer": 2})
    with pytest.raises(ConfigError, match="the plan splits OP-DAG"):
        owner.pipeline(other, plan=plan)
    with pytest.raises(ConfigError, match="micro-batches"):
        owner.pipeline(GPT2, plan=plan, options=JobOptions(n_micro_batches=N_MB + 1))
    with pytest.raises(ConfigError, match="plan method"):
        owner.plan(GPT2, method="random")


def test_opdata_of_another_plan_version_is_dropped(swarm: Swarm) -> None:
    owner = swarm.data_owner()
    plan = dataclasses.replace(owner.plan(GPT2, method="equal-number/none", n_micro_batches=N_MB), version=7)
    with owner.pipeline(GPT2, plan=plan, options=_options(plan)) as pipe:
        assert all(setup.plan_version == 7 for setup in pipe.driver.setups)
        stale = dataclasses.replace(first_forward(pipe.partition, pipe.driver.job), plan_version=6)
        peer = pipe.driver.setups[0].peers[1][0]

        async def send() -> str:
            client = ExecClient(pipe.driver.service.transport, peer, timeout=10)
            try:
                with pytest.raises(ProtocolError) as refused:
                    await client.request(stale, bytes(stale.body_bytes))
                return str(refused.value)
            finally:
                await client.aclose()

        assert "plan version 6" in swarm.call(send())
        assert len(pipe.run_iteration(_batches(GPT2, 0))) == N_MB  # the job itself goes on
        pipe.step()
        wrong = [(x[:, :-1], y[:, :-1]) for x, y in _batches(GPT2, 1)]  # one token short
        expected = re.escape(str(list(GPT2.input_shape)))
        with pytest.raises(ConfigError, match=rf"micro-batch 0: inputs of shape .* traced for {expected}"):
            pipe.run_iteration(wrong)
        assert len(pipe.run_iteration(_batches(GPT2, 1))) == N_MB  # refused before anything was sent


def test_each_stage_holds_the_micro_batches_its_plan_counted(swarm: Swarm) -> None:
    n_b = 6  # more than the stages, so 1F1B's per-stage depths differ from the window
    owner = swarm.data_owner()
    plan = owner.plan(GPT2, method="equal-number/none", n_micro_batches=n_b)
    assert len(plan.stages) == 5 and len(set(plan.peer_ids[1:-1])) == 3  # the data owner's at both ends
    with owner.pipeline(GPT2, plan=plan, options=_options(plan)) as pipe:
        held = [setup.in_flight for setup in pipe.driver.setups]
        assert held == [5, 4, 3, 2]  # min(n_b, S - k) per plan stage, the data owner's as its first one
        peaks = []
        for it in range(3):
            batches = [b for b in _batches(GPT2, it) for _ in range(2)]
            assert len(pipe.run_iteration(batches)) == n_b
            pipe.step()
            peaks.append(list(pipe.driver.stage_held))
        for peak in peaks:
            assert all(1 <= p <= h for p, h in zip(peak, held, strict=True)), (peaks, held)
        # the first stage is sent 4 micro-batches at once and keeps 3: its gate was what bound
        assert max(peak[1] for peak in peaks) == held[1], peaks
