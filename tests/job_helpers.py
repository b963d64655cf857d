"""Helpers of the training tests: the single-process reference a swarm run must match."""

from __future__ import annotations

import torch

from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.runtime.losses import lm_loss
from fusionp2p.training.corpus import TextCorpus
from fusionp2p.training.job_spec import JobSpec


def reference_losses(job: JobSpec) -> list[float]:
    """The same job trained in this one process."""
    spec = job.model_spec()
    model = spec.build(ModelRegistry())
    opt_cfg = job.optimizer_config
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=opt_cfg.lr,
        betas=opt_cfg.betas,
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
    )
    corpus = TextCorpus.load(job.data_path, seq_len=job.seq_len, max_bytes=job.max_bytes)
    batches = corpus.batches(job.micro_batch_size, job.n_micro_batches, seed=job.data_seed)
    losses = []
    for _ in range(job.steps):
        opt.zero_grad()
        values = []
        for x, y in next(batches):
            loss = lm_loss([model(x)], y)
            values.append(loss.item())
            (loss / job.n_micro_batches).backward()
        opt.step()
        losses.append(sum(values) / len(values))
    return losses
