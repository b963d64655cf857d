"""Data-parallel replicas on real peer processes: two pipelines of one job, their stages'
gradients averaged by hivemind's averager, train as one process trains on the whole
global batch (issue 35)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import torch
from exec_helpers import user_model_swarm

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ProtocolError, SwarmError
from fusionp2p.launch import LocalSwarm
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.averaging import CODEC_RTOL, FINGERPRINT_RTOL, fingerprint_distance
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.swarm import Swarm

N_MB = 4  # the global batch: 2 micro-batches per replica
STEPS = 5  # the coordinated test (test_replicas_train.py) trains 10
OPT = OptimizerConfig(lr=1e-2, eps=1e-6)
GPT2 = ModelSpec(
    "gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 32}, input_shape=(2, 8)
)
LOCAL = ModelRegistry(allow=["user_models:SkipNet"])

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with user_model_swarm(4, swarm="replicas", workdir=str(tmp_path_factory.mktemp("replicas"))) as peers:
        yield peers


@pytest.fixture(scope="module")
def swarm(local: LocalSwarm) -> Iterator[Swarm]:
    with Swarm(local.initial_peers, swarm=local.swarm) as client:
        deadline = time.monotonic() + 60
        while len(client.peers()) < len(local.peers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(client.peers()) == len(local.peers), "the peers did not show up"
        yield client


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + step)
    return [(x, x) for x in (torch.randint(0, 97, GPT2.input_shape, generator=g) for _ in range(N_MB))]


class _OneProcess:
    """The reference: the whole model in this process, one AdamW step per batch list."""

    def __init__(self) -> None:
        self.model = build_model(GPT2, LOCAL)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
        )

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Trains on ``batches`` (their mean loss); the loss of each."""
        self.opt.zero_grad()
        out = []
        for x, y in batches:
            value = LOSSES["lm"]([self.model(x)], y)
            out.append(value.item())
            (value / len(batches)).backward()
        self.opt.step()
        return out


def test_two_replicas_train_as_one_process_on_the_global_batch(swarm: Swarm) -> None:
    """R = 2 replicas of 3 stages (this process and 2 peers each) on 4 peers: each step's
    4 micro-batches split 2 and 2; the losses and parameters after 5 steps are those of
    one process that trains on all 4 micro-batches per step, and the replicas' parameters
    are equal stage by stage."""
    one = _OneProcess()
    options = JobOptions(n_micro_batches=N_MB, optimizer=OPT, timeout=120)
    with swarm.data_owner().pipeline(GPT2, n_stages=3, replicas=2, options=options, registry=LOCAL) as pipe:
        assert len({p.peer_id for p in pipe.peers}) == 4  # each replica on its own two peers
        for step in range(STEPS):
            want = one.step(_batches(step))
            got = pipe.run_iteration(_batches(step))
            pipe.step()
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), step
            averaged = pipe.stage_averaging()  # every stage averaged over both replicas
            assert [group for _, group in averaged] == [2, 2, 2] and all(s >= 0 for s, _ in averaged)
        digests = pipe.check_replicas(timeout=120)
        assert len(digests) == 3
        reference = dict(one.model.named_parameters(remove_duplicate=False))
        for name, value in pipe.fetch("params").items():
            torch.testing.assert_close(value, reference[name].detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_replicas_that_average_in_fp16_stay_within_its_rounding_of_one_process(swarm: Swarm) -> None:
    """The peers' stages average through hivemind's fp16 codec (half the bytes): the losses
    stay within fp16's rounding of one process's, and the replicas' parameters, which
    hivemind's all-reduce leaves apart by that rounding, agree within ``CODEC_RTOL["fp16"]``
    though not within fp32's tolerance."""
    one = _OneProcess()
    options = JobOptions(
        n_micro_batches=N_MB, optimizer=OPT, timeout=120, averaging_codecs=("none", "fp16", "fp16")
    )
    with swarm.data_owner().pipeline(GPT2, n_stages=3, replicas=2, options=options, registry=LOCAL) as pipe:
        assert [s.averaging_codec for s in pipe.driver.setups] == ["none", "fp16", "fp16"]
        for step in range(STEPS):
            want = one.step(_batches(step))
            got = pipe.run_iteration(_batches(step))
            pipe.step()
            assert got == pytest.approx(want, rel=2e-2, abs=1e-3), step
            assert [group for _, group in pipe.stage_averaging()] == [2, 2, 2]
        pipe.check_replicas(timeout=120)  # within fp16's tolerance
        first, second = (swarm.call(replica.fingerprints()) for replica in pipe.driver.replicas)
        apart = [fingerprint_distance(first[s], second[s]) for s in (1, 2)]
        assert max(apart) > FINGERPRINT_RTOL and max(apart) <= CODEC_RTOL["fp16"], apart
        assert fingerprint_distance(first[0], second[0]) == 0.0  # this process's copies: averaged exactly


def test_replicas_need_their_own_peers(swarm: Swarm) -> None:
    with pytest.raises(SwarmError, match="3 replicas of 3 stages need 6 live peers, the swarm has 4"):
        swarm.data_owner().pipeline(
            GPT2, n_stages=3, replicas=3, options=JobOptions(n_micro_batches=3), registry=LOCAL
        )


def test_a_replica_that_comes_after_the_deadline_is_left_out_and_the_check_says_so(swarm: Swarm) -> None:
    """Each step, replica 0 steps first and replica 1 only once replica 0 is done: each
    stage of replica 0 waits out its 1 s deadline alone, replica 1's then finds nobody, and
    both step on their own replica's gradients. Training goes on (losses finite and near
    the reference's), and the replicas' check fails loudly."""
    one = _OneProcess()
    options = JobOptions(n_micro_batches=N_MB, optimizer=OPT, timeout=120, averaging_s=1.0)
    with swarm.data_owner().pipeline(GPT2, n_stages=3, replicas=2, options=options, registry=LOCAL) as pipe:
        replicas = pipe.driver.replicas
        for step in range(3):
            want = one.step(_batches(step))
            got = pipe.run_iteration(_batches(step))
            for replica in replicas:  # one after the other: the second comes after the deadline
                swarm.call(replica.step())
                assert [group for _, group in replica.stage_averaging[1:]] == [1, 1]  # left out
            assert all(math.isfinite(v) for v in got)
            assert sum(got) / N_MB == pytest.approx(sum(want) / N_MB, rel=0.05)
        with pytest.raises(ProtocolError, match=r"replicas \[1\] hold other parameters .* diverged"):
            pipe.check_replicas(timeout=120)
