"""Averaging one stage's gradients across the job's replicas, with hivemind's all-reduce.

The R peers that hold stage s of a job's R replicas (``planning/replicas.py``) average that
stage's gradients after each backward, before the optimizer step, through hivemind's
``DecentralizedAverager``: matchmaking over the DHT under a group key of the job, the plan
version and the stage, then a butterfly all-reduce in which each peer owns ``1/R`` of the
vector. Each peer weighs its gradients by the micro-batches it computed, so the result is
the gradient of the whole global batch, renormalized over the replicas that took part. A
replica that misses the deadline is left out of that step's average: the others average
among themselves, and it keeps its own gradients (and says so). A digest of the
parameters lets the replicas check, every few steps, that they still hold the same ones.

Not wired into the runtime yet: the stage step does not call it (issue 35).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException

from fusionp2p.errors import ConfigError

__all__ = ["AveragingResult", "StageAverager", "group_key", "parameter_digest"]

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[\w-]{1,64}$")


def group_key(job: str, plan_version: int, stage: int) -> str:
    """The averaging group of one stage of one plan of a job (hivemind's prefix: no dots).

    Raises:
        ConfigError: a job name that cannot be part of a DHT key.
    """
    if not _KEY_RE.match(job):
        raise ConfigError(f"job name {job!r:.80} cannot name an averaging group (letters, digits, _ and -)")
    return f"fusionp2p_avg_{job}_v{plan_version}_s{stage}"


@dataclass(frozen=True)
class AveragingResult:
    """What one averaging step did."""

    group_size: int  # replicas averaged together, this one included (1: left out)
    seconds: float

    @property
    def left_out(self) -> bool:
        return self.group_size < 2


def parameter_digest(tensors: Sequence[torch.Tensor]) -> str:
    """The sha256 of the tensors' bytes, in order: equal on replicas that hold the same ones."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


class StageAverager:
    """Averages the gradients of one stage with the same stage of the other replicas.

    ``like``: tensors of the gradients' shapes and dtypes (copied into shared memory, where
    hivemind's averager process reads and writes them). ``replicas``: the group size to
    wait for; ``deadline_s``: how long a step may take before this replica goes on alone.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        like: Sequence[torch.Tensor],
        *,
        job: str,
        plan_version: int,
        stage: int,
        replicas: int,
        deadline_s: float,
    ) -> None:
        if replicas < 2:
            raise ConfigError(f"averaging needs at least 2 replicas, got {replicas}")
        self.deadline_s = deadline_s
        self.key = group_key(job, plan_version, stage)
        matchmaking = max(0.5, min(5.0, deadline_s / 4))
        self._averager = DecentralizedAverager(
            [torch.zeros_like(t, device="cpu") for t in like],
            dht,
            start=True,
            prefix=self.key,
            target_group_size=replicas,
            min_group_size=2,
            min_matchmaking_time=matchmaking,
            request_timeout=matchmaking / 2,
        )

    def average(self, grads: Sequence[torch.Tensor], weight: float) -> AveragingResult:
        """Replaces ``grads`` in place by their weighted average over the replicas that
        step within the deadline; ``weight``: the micro-batches this replica computed.
        Left out (too late, or alone), ``grads`` stay as they were."""
        began = time.perf_counter()
        with self._averager.get_tensors() as shared:
            for dst, src in zip(shared, grads, strict=True):
                dst.copy_(src.detach().cpu())
        try:
            gathered = self._averager.step(weight=weight, timeout=self.deadline_s)
        except AllreduceException as e:
            logger.warning(
                "%s: left out of this step's average (%s); going on with own gradients", self.key, e
            )
            return AveragingResult(1, time.perf_counter() - began)
        size = len(gathered) if gathered else 1
        if size > 1:
            with self._averager.get_tensors() as shared:
                for dst, src in zip(grads, shared, strict=True):
                    dst.copy_(src.to(dst.device))
        return AveragingResult(size, time.perf_counter() - began)

    def close(self) -> None:
        """Stops the averager's process."""
        self._averager.shutdown()
