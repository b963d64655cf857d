"""Averaging one stage's gradients across the job's replicas, with hivemind's all-reduce.

The R peers that hold stage s of a job's R replicas (``planning/replicas.py``) average that
stage's gradients after each backward, before the optimizer step, through hivemind's
``DecentralizedAverager``: matchmaking over the DHT under a group key of the job, the plan
version and the stage, then a butterfly all-reduce in which each peer owns ``1/R`` of the
vector. Each peer weighs its gradients by the micro-batches it computed, so the result is
the gradient of the whole global batch, renormalized over the replicas that took part. A
replica that misses the deadline is left out of that step's average: the others average
among themselves, and it keeps its own gradients (and says so). A fingerprint of the
parameters lets the replicas check, every few steps, that they still hold the same ones.

A serving peer makes one per replicated stage it runs (``Peer``'s ``averagers`` factory,
given to ``ExecutorService``), and the stage's step (``ComputeQueue.step``) averages before
the optimizer runs. The group key names the job's owner, so only stages one data owner set
up average together; hivemind's all-reduce itself trusts every member of a group (a DHT
peer that joins the group under that key can skew the average: see docs/security.md).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression

from fusionp2p.errors import ConfigError
from fusionp2p.net.validation import MAX_DECLARATION_LIFETIME
from fusionp2p.records import AVERAGING_CODECS

__all__ = [
    "CODEC_RTOL",
    "FINGERPRINT_RTOL",
    "AveragingResult",
    "Fingerprint",
    "GradientAverager",
    "StageAverager",
    "fingerprint_distance",
    "fingerprints_agree",
    "group_key",
    "matchmaking_seconds",
    "parameter_fingerprint",
]

logger = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[\w-]{1,64}$")
_READY_S = 60.0  # how long the averager's process may take to join the DHT


def matchmaking_seconds(deadline_s: float) -> float:
    """How long a group waits for late replicas (a full group starts at once): half the
    deadline (hivemind refuses a step whose matching outlasts it), and at most half the
    lifetime a peer's DHT gives a matchmaking declaration, which lives that long: a longer
    one is refused by every validator and nobody finds the group (a job with a one-hour
    deadline never averaged)."""
    return min(deadline_s / 2, MAX_DECLARATION_LIFETIME / 2)


def group_key(job: str, plan_version: int, stage: int, owner: str = "", generation: int = 0) -> str:
    """The averaging group of one stage of one plan of ``owner``'s job, in its
    ``generation`` (a new one after a replica is lost; hivemind's prefix: no dots).

    Raises:
        ConfigError: a job name or owner that cannot be part of a DHT key.
    """
    if not _KEY_RE.match(job) or (owner and not _KEY_RE.match(owner)):
        raise ConfigError(f"job name {job!r:.80} cannot name an averaging group (letters, digits, _ and -)")
    key = f"fusionp2p_avg_{owner + '_' if owner else ''}{job}_v{plan_version}_s{stage}"
    return f"{key}_g{generation}" if generation else key


@dataclass(frozen=True)
class AveragingResult:
    """What one averaging step did."""

    group_size: int  # replicas averaged together, this one included (1: left out)
    seconds: float

    @property
    def left_out(self) -> bool:
        return self.group_size < 2


Fingerprint = tuple[float, float, float, float]
FINGERPRINT_RTOL = 1e-4  # replicas' parameters agree within this, relative to their norm
# hivemind's all-reduce adds the (compressed) average minus each replica's own part to it:
# with fp16 the replicas' gradients then differ by fp16 rounding, and their parameters drift
# apart (5.7e-4 after one AdamW step, 1.0e-3 after 300, on a 2-layer GPT: docs/training.md)
CODEC_RTOL = {"none": FINGERPRINT_RTOL, "fp16": 1e-2}
_CODECS: dict[str, type[CompressionBase]] = {"none": NoCompression, "fp16": Float16Compression}
assert _CODECS.keys() == AVERAGING_CODECS.keys() == CODEC_RTOL.keys()


def parameter_fingerprint(tensors: Sequence[torch.Tensor]) -> Fingerprint:
    """Four float64 statistics of the tensors: the sum of squares and three fixed
    pseudo-random projections. Replicas that average their gradients hold the same
    parameters up to rounding (hivemind's all-reduce adds ``average - own`` to each
    replica's own values, which is not bit-exact), so they compare these within
    ``FINGERPRINT_RTOL`` (``fingerprints_agree``) rather than a hash of the bytes."""
    out = [0.0, 0.0, 0.0, 0.0]
    for k, tensor in enumerate(tensors):
        x = tensor.detach().reshape(-1).to("cpu", torch.float64)
        g = torch.Generator().manual_seed(k)
        out[0] += float(x.dot(x))
        for j in (1, 2, 3):
            out[j] += float(x.dot(torch.randn(x.numel(), generator=g, dtype=torch.float64)))
    return out[0], out[1], out[2], out[3]


def fingerprint_distance(a: Fingerprint, b: Fingerprint) -> float:
    """How far apart two fingerprints are, relative to what each statistic can move by (the
    norm, twice its square for the sum of squares): ``fingerprints_agree`` compares it."""
    norm = max(a[0], b[0], 1e-30) ** 0.5
    bounds = (2 * norm * norm, norm, norm, norm)
    return max(abs(x - y) / bound for x, y, bound in zip(a, b, bounds, strict=True))


def fingerprints_agree(a: Fingerprint, b: Fingerprint, rtol: float = FINGERPRINT_RTOL) -> bool:
    """Whether two replicas' fingerprints describe the same parameters up to rounding."""
    return fingerprint_distance(a, b) <= rtol


class GradientAverager(Protocol):
    """What a replicated stage's step calls: ``StageAverager``, or a fake in unit tests."""

    def average(self, grads: Sequence[torch.Tensor], weight: float) -> AveragingResult: ...

    def close(self) -> None: ...


class StageAverager:
    """Averages the gradients of one stage with the same stage of the other replicas.

    ``like``: tensors of the gradients' shapes and dtypes (copied into shared memory, where
    hivemind's averager process reads and writes them). ``replicas``: the group size to
    wait for; ``deadline_s``: how long a step may take before this replica goes on alone.
    ``members``: the PeerIDs that may be in the group (the other replicas' owners of this
    stage); an average with anyone else in it is thrown away (hivemind matches by key only,
    and its libp2p streams say who each member is). Empty: anyone with the key. ``codec``:
    how this peer sends its gradient parts and the averaged parts (``records.AVERAGING_CODECS``).
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
        owner: str = "",
        members: Collection[str] = (),
        generation: int = 0,
        codec: str = "none",
    ) -> None:
        if replicas < 2:
            raise ConfigError(f"averaging needs at least 2 replicas, got {replicas}")
        if codec not in _CODECS:
            raise ConfigError(f"averaging codec must be one of {sorted(_CODECS)}, got {codec!r:.40}")
        self.deadline_s = deadline_s
        self.members = frozenset(members)
        self.key = group_key(job, plan_version, stage, owner, generation)
        matchmaking = matchmaking_seconds(deadline_s)
        self._averager = DecentralizedAverager(
            [torch.zeros_like(t, device="cpu") for t in like],
            dht,
            start=False,
            prefix=self.key,
            target_group_size=replicas,
            min_group_size=replicas // 2 + 1,  # a majority: replicas never split into two groups
            allow_state_sharing=False,  # no state downloads: a replica's state comes from its checkpoint
            min_matchmaking_time=matchmaking,
            request_timeout=min(5.0, matchmaking / 2),
            compression=_CODECS[codec](),
        )
        # not run_in_background(): it sets SIGINT to SIG_IGN in this process for good (and
        # works only on the main thread), so a peer with a replicated stage would ignore Ctrl-C
        self._averager.start()
        self._averager.wait_until_ready(_READY_S)

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
        except Exception as e:  # AllreduceException: no group in time; anything else hivemind raises
            logger.warning(
                "%s: left out of this step's average (%s: %s); going on with own gradients",
                self.key,
                type(e).__name__,
                e,
            )
            return AveragingResult(1, time.perf_counter() - began)
        size = len(gathered) if gathered else 1
        strangers = sorted(p.to_base58() for p in gathered or ()) if self.members else []
        strangers = [p for p in strangers if p not in self.members]
        if strangers:
            logger.warning(
                "protocol error: %s: peers %s that run no replica of this stage joined the average; "
                "it is thrown away, going on with own gradients",
                self.key,
                [p[-8:] for p in strangers],
            )
            return AveragingResult(1, time.perf_counter() - began)
        if size > 1:
            with self._averager.get_tensors() as shared:
                for dst, src in zip(grads, shared, strict=True):
                    dst.copy_(src.to(dst.device))
        return AveragingResult(size, time.perf_counter() - began)

    def close(self) -> None:
        """Stops the averager's process."""
        self._averager.shutdown()
