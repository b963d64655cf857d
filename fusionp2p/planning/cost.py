"""The cost model: compute time, link time after compression, memory (FusionLLM §3.5, §5).

- compute time of a node on a peer = FLOPs / the peer's measured FLOP/s;
- link time = alpha + wire bytes / bandwidth (alpha = one-way latency; links may be asymmetric),
  of which only wire bytes / bandwidth occupies the link: transfers overlap in flight;
- wire bytes of a Top-K message at ratio r = numel / r * (value bytes + index bytes) + header,
  or the dense bytes where compression would not pay;
- Top-K coding time of a compressed link, on each side, = numel * (seconds per element) +
  numel / r * (seconds per kept entry), as each peer measured them (``codec_seconds``);
- memory of a stage = parameters * (1 + grads + optimizer states) + saved activations of
  every micro-batch in flight (1F1B: stage k of S holds min(n_b, S - k)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fusionp2p.errors import ConfigError
from fusionp2p.records import AVERAGING_CHOICES, COMPRESSIONS, MAX_TOPK_RATIO

__all__ = [
    "NO_COMPRESSION",
    "PAPER_WIRE",
    "PLANNED_MAX_RATIO",
    "WIRE",
    "CompressionPolicy",
    "CostConfig",
    "WireFormat",
    "adaptive_ratios",
    "codec_seconds",
    "compression_policy",
    "in_flight",
    "planned_budgets",
    "planned_ratios",
    "stage_in_flight",
]

_HEADER_BYTES = 32


def in_flight(n_micro_batches: int, n_stages: int, stage: int | None = None) -> int:
    """Micro-batches whose activations are held at once under 1F1B: the one definition
    that the planner's DP, the estimate and the runtime all use.

    Stage ``k`` of ``S`` holds ``min(n_b, S - k)``: the runtime starts a forward there only
    once the backward of the micro-batch that many before it finished there
    (``runtime.compute``). ``stage=None``: the data owner's window, ``min(n_b, S)``
    micro-batches unfinished in the whole pipeline.
    """
    if stage is None:
        return max(1, min(n_micro_batches, n_stages))
    return max(1, min(n_micro_batches, n_stages - stage))


def stage_in_flight(n_micro_batches: int, stage_peers: Sequence[object]) -> list[int]:
    """Per stage of a plan (``stage_peers[k]`` runs stage k), the micro-batches it holds:
    ``in_flight`` of the stage, except that a peer running several stages runs them as one
    runtime stage, gated as its first one, so each of them holds that many."""
    first: dict[object, int] = {}
    for k, peer in enumerate(stage_peers):
        first.setdefault(peer, k)
    return [in_flight(n_micro_batches, len(stage_peers), first[peer]) for peer in stage_peers]


@dataclass(frozen=True, kw_only=True)
class WireFormat:
    """Bytes per kept entry of a Top-K message."""

    value_bytes: int = 4  # fp32 values (2 for fp16/bf16)
    index_bytes: int = 2  # delta16: 2-byte gaps (row-wise Top-K keeps every gap < 65536); int32: 4
    dense_value_bytes: int = 4  # bytes per element of the uncompressed tensor

    def wire_bytes(self, dense_bytes: float | np.ndarray, ratio: float | np.ndarray) -> np.ndarray:
        """Bytes on the wire for ``dense_bytes`` of tensor at Top-K ratio ``ratio``."""
        dense = np.asarray(dense_bytes, dtype=float)
        r = np.maximum(np.asarray(ratio, dtype=float), 1.0)
        numel = dense / self.dense_value_bytes
        sparse = np.ceil(numel / r) * (self.value_bytes + self.index_bytes) + _HEADER_BYTES
        return np.where(r > 1.0, np.minimum(dense, sparse), dense)


WIRE = WireFormat()  # fusionp2p's format: fp32 values, 2-byte index gaps (compression/wire.py)
PAPER_WIRE = WireFormat(index_bytes=8)  # FusionLLM's: fp32 values, int64 indices (its coefficient 3)

CompressionKind = Literal["none", "uniform", "adaptive", "planned"]  # records.COMPRESSIONS, for types
PLANNED_MAX_RATIO = 20.0  # the planned policy's default cap (benchmarks/convergence.py: +3% loss at 20)


@dataclass(frozen=True, kw_only=True)
class CompressionPolicy:
    """How each link's Top-K ratio is chosen."""

    kind: CompressionKind = "adaptive"
    ratio: float = 100.0  # the user's ratio: uniform uses it everywhere, adaptive on average
    max_ratio: float = MAX_TOPK_RATIO  # no link is compressed harder than this
    slack: float = 0.05  # planned: the share of iteration time its links may add over latency alone

    def __post_init__(self) -> None:
        if self.kind not in COMPRESSIONS:
            raise ConfigError(f"CompressionPolicy.kind must be one of {COMPRESSIONS}, got {self.kind!r}")
        if not (1 <= self.ratio <= self.max_ratio <= MAX_TOPK_RATIO and math.isfinite(self.ratio)):
            raise ConfigError(
                f"need 1 <= ratio <= max_ratio <= {MAX_TOPK_RATIO:g}, got {self.ratio} / {self.max_ratio}"
            )
        if not 0 <= self.slack < 1:
            raise ConfigError(f"CompressionPolicy.slack must be in [0, 1), got {self.slack}")


NO_COMPRESSION = CompressionPolicy(kind="none")  # every link dense


def compression_policy(name: str, max_ratio: float = PLANNED_MAX_RATIO) -> CompressionPolicy:
    """The policy a job's ``compression`` names: "none", "adaptive" (the paper's, §5.2),
    "planned" (per link the least Top-K that hides it, no link harder than ``max_ratio``)
    or "uniform" (``max_ratio`` on every link).

    Raises:
        ConfigError: another name.
    """
    if name == "none":
        return NO_COMPRESSION
    if name == "adaptive":
        return CompressionPolicy(kind="adaptive")
    if name == "uniform":
        return CompressionPolicy(kind="uniform", ratio=max_ratio, max_ratio=max_ratio)
    if name == "planned":
        return CompressionPolicy(kind="planned", ratio=1.0, max_ratio=max_ratio)
    raise ConfigError(f"[train] compression: must be one of {list(COMPRESSIONS)}, got {name!r:.40}")


def adaptive_ratios(dense_times: np.ndarray, policy: CompressionPolicy) -> np.ndarray:
    """Per-link ratios (paper §5.2): slower links get stronger compression.

    ``r_l = clip(r * t_l / mean(t), 1, max_ratio)`` where ``t_l`` is link l's uncompressed
    communication time, so the compressed times even out and the mean ratio stays near r.
    Works on the last axis (one plan per row), so the exact solver can batch plans.
    """
    t = np.asarray(dense_times, dtype=float)
    if policy.kind == "none" or t.shape[-1] == 0:
        return np.ones_like(t)
    if policy.kind == "uniform":
        return np.full_like(t, policy.ratio)
    mean = np.mean(t, axis=-1, keepdims=True)
    safe = np.where(mean > 0, mean, 1.0)
    return np.clip(policy.ratio * t / safe, 1.0, policy.max_ratio)


def codec_seconds(
    numel: np.ndarray | float,
    ratio: np.ndarray | float,
    per_element_s: np.ndarray | float,
    per_entry_s: np.ndarray | float,
) -> np.ndarray:
    """Seconds of Top-K coding for ``numel`` elements sent at ``ratio``: scanning every
    element (the selection) plus handling each of the ``numel / ratio`` kept entries
    (packing, unpacking, gathering); 0 where the link is dense (ratio 1)."""
    n = np.asarray(numel, dtype=float)
    r = np.maximum(np.asarray(ratio, dtype=float), 1.0)
    return np.where(r > 1.0, n * per_element_s + np.ceil(n / r) * per_entry_s, 0.0)


def planned_ratios(
    dense_bytes: np.ndarray | float,
    bandwidth: np.ndarray | float,
    latency: np.ndarray | float,
    budget_s: np.ndarray | float,
    policy: CompressionPolicy,
    wire: WireFormat,
    codec: tuple[np.ndarray | float, np.ndarray | float] = (0.0, 0.0),
) -> np.ndarray:
    """Per link, the *smallest* Top-K ratio whose transfer fits in ``budget_s`` (the
    bottleneck peer's compute per micro-batch, which a pipelined link must not exceed):
    1 where the dense tensor already fits, ``policy.max_ratio`` at most (and where even
    the latency does not fit). Compressing no harder than needed is what keeps training
    close to uncompressed (benchmarks/convergence.py); the paper's §5.2 formula compresses
    slow links hardest whether or not they are the bottleneck.

    ``codec`` is the link's Top-K coding time, both sides together, as (seconds per dense
    element, seconds per kept entry): a link counts it as part of its transfer, and stays
    dense where compressing would take longer than sending it dense (a fast link)."""
    dense = np.asarray(dense_bytes, dtype=float)
    bw, lat = np.asarray(bandwidth, dtype=float), np.asarray(latency, dtype=float)
    numel = dense / wire.dense_value_bytes
    per_element, per_entry = (np.asarray(c, dtype=float) for c in codec)
    entry_bytes = wire.value_bytes + wire.index_bytes
    room = (np.asarray(budget_s, dtype=float) - lat) * bw
    # k entries take lat + numel * per_element + k * per_entry + (k * entry_bytes + header) / bw
    fit = np.floor(((room - numel * per_element * bw) - _HEADER_BYTES) / (entry_bytes + per_entry * bw))
    entries = np.maximum(fit, 1e-12)
    needed = numel / entries * (1 + 1e-9)  # so ceil() keeps to ``entries``
    ratio = np.where(dense <= room, 1.0, np.where(fit >= 1, needed, policy.max_ratio))
    ratio = np.clip(ratio, 1.0, policy.max_ratio)
    compressed_s = codec_seconds(numel, ratio, per_element, per_entry) + wire.wire_bytes(dense, ratio) / bw
    return np.where(compressed_s < dense / bw, ratio, 1.0)


def planned_budgets(
    latency: np.ndarray | float,
    bottleneck_s: np.ndarray | float,
    iteration_s: np.ndarray | float,
    n_links: int,
    policy: CompressionPolicy,
) -> np.ndarray:
    """Seconds each link of a ``planned`` plan may take per micro-batch and direction.

    A link's latency is in flight, not occupancy (``planning.schedule``), so the budget is
    its latency plus what the transfer may occupy the link for: at most the bottleneck
    peer's compute ``bottleneck_s`` (so it is never the busiest resource), and at most its
    share of ``policy.slack`` of the iteration on the critical path: ``iteration_s`` is the
    iteration with every link at its latency alone, ``L + (n_b - 1) B``, and each of the
    ``2 * n_links`` directions gets an equal share. Without that second bound a link at
    exactly the bottleneck time would still lengthen the critical path by that much, per
    hop and per direction."""
    share = policy.slack * np.asarray(iteration_s, dtype=float) / max(1, 2 * n_links)
    return np.asarray(latency, dtype=float) + np.minimum(np.asarray(bottleneck_s, dtype=float), share)


@dataclass(frozen=True, kw_only=True)
class CostConfig:
    """Everything besides the swarm and the model that an estimate depends on."""

    n_micro_batches: int = 8  # n_b: micro-batches per iteration
    compression: CompressionPolicy = CompressionPolicy()
    wire: WireFormat = WIRE
    optimizer_states: int = 2  # AdamW keeps two moments per parameter
    memory_headroom: float = 0.9  # plan at most this share of a peer's free memory
    averaging: str = "none"  # replicas' gradients on the wire: records.AVERAGING_CODECS, or "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.n_micro_batches, int) or self.n_micro_batches < 1:
            raise ConfigError(f"CostConfig.n_micro_batches must be >= 1, got {self.n_micro_batches!r}")
        if not 0 < self.memory_headroom <= 1:
            raise ConfigError(f"CostConfig.memory_headroom must be in (0, 1], got {self.memory_headroom}")
        if self.averaging not in AVERAGING_CHOICES:
            raise ConfigError(
                f"CostConfig.averaging must be one of {AVERAGING_CHOICES}, got {self.averaging!r:.40}"
            )

    @property
    def param_multiplier(self) -> int:
        """Bytes of memory per byte of parameters: weights, grads, optimizer states."""
        return 2 + self.optimizer_states
