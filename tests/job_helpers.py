"""Helpers of the training and coordination tests: the single-process reference a swarm
run must match, and a peer's record."""

from __future__ import annotations

import time

import pytest
import torch

from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.records import PeerRecord
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec


def peer_record(peer_id: str, state: str = "training") -> PeerRecord:
    """A small CPU peer's record (10 GFLOP/s, 1 GiB free)."""
    return PeerRecord(
        peer_id=peer_id,
        maddrs=(),
        device="cpu",
        device_name="cpu",
        flops={"float32": 1e10},
        memory_bytes=1 << 30,
        total_memory_bytes=1 << 31,
        state=state,
        started_at=0.0,
        updated_at=0.0,
    )


def reference_losses(job: JobSpec, model: torch.nn.Module | None = None) -> list[float]:
    """The same job trained in this one process (from ``model``'s weights if given)."""
    spec = job.model_spec()
    model = model if model is not None else build_model(spec, ModelRegistry())
    opt_cfg = job.optimizer_config
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=opt_cfg.lr,
        betas=opt_cfg.betas,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
    )
    data = job.load_data()
    batches = data.batches(job.micro_batch_size, job.n_micro_batches, seed=job.data_seed)
    loss_fn = LOSSES[job.loss]
    losses = []
    for _ in range(job.steps):
        opt.zero_grad()
        values = []
        for x, y in next(batches):
            loss = loss_fn([model(x)], y)
            values.append(loss.item())
            (loss / job.n_micro_batches).backward()
        opt.step()
        losses.append(sum(values) / len(values))
    return losses


def wait_idle(swarm: Swarm, n: int, timeout: float = 60.0) -> None:
    """Waits until ``swarm`` has ``n`` idle peers and a coordinator; fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([p for p in swarm.peers() if p.state == "idle"]) >= n and swarm.coordinator() is not None:
            return
        time.sleep(0.5)
    pytest.fail(f"fewer than {n} idle peers and a coordinator after {timeout:.0f} s")
