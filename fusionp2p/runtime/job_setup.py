"""What a data owner tells each stage: ``JobOptions`` and a layout become one ``JobSetup`` per stage.

A job is set up from two values: a ``planning.RuntimeLayout`` (who runs which stage, which
positions, which ratios, how many micro-batches each holds) and ``JobOptions`` (everything
else every stage must agree on). ``stage_setups`` turns them into the ``records.JobSetup``
each stage receives.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fusionp2p.config import DEFAULT_TIMEOUTS, NO_WARMUP, ExecLimits, OptimizerConfig, RatioWarmup
from fusionp2p.errors import ConfigError
from fusionp2p.opdag.split import Partition
from fusionp2p.planning import RuntimeLayout
from fusionp2p.planning.cost import in_flight
from fusionp2p.records import (
    AVERAGING_CODECS,
    MAX_MICRO_BATCHES,
    JobSetup,
    ModelSpec,
    ShardSource,
    node_ranges,
)
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.shard_store import namespace_of

__all__ = ["JobOptions", "default_in_flight", "stage_setups"]


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """How a data owner runs a job, besides its layout."""

    job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # the job's wire id
    n_micro_batches: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: str = "lm"  # the data owner's loss, one of runtime.losses.LOSSES
    plan_version: int = 1  # every OpData of the job names it (a plan's: its version); others are dropped
    epoch: int = 0  # the coordinator epoch of the published plan it follows (stages check it); 0: none
    expect_dag: str | None = None  # the OP-DAG fingerprint the plan was made for
    ratio_warmup: RatioWarmup = NO_WARMUP  # Top-K ratios grow from 1 (dense) to the layout's
    timeout: float = DEFAULT_TIMEOUTS.request  # one request to a stage
    max_memory: int | None = None  # the data owner's own stage may need this much; None: 80% of free
    run: str = ""  # the run this job is a plan of ("": none, no shard checkpoints)
    shard_secret: bytes = b""  # the run's shard secret (records.shards); b"": no shard checkpoints
    shard_dir: str | None = None  # where this data owner keeps its own stage's shards
    limits: ExecLimits = field(default_factory=ExecLimits)  # what this process accepts from stages
    # replica ``replica`` of ``replicas`` of the job ``group`` (runtime.replicated sets these)
    replicas: int = 1
    replica: int = 0
    group: str = ""
    averaging_s: float = 30.0  # how long a stage waits for the other replicas to average
    replica_peers: tuple[tuple[str, ...], ...] = ()  # every replica's layout peers, by replica
    # per layout stage, how its replicas send the gradients they average (AVERAGING_CODECS;
    # a stage past the end: "none")
    averaging_codecs: tuple[str, ...] = ()

    def averaging_codec(self, stage: int) -> str:
        """How layout stage ``stage`` sends the gradients it averages."""
        return self.averaging_codecs[stage] if stage < len(self.averaging_codecs) else "none"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {sorted(LOSSES)}, got {self.loss!r}")
        if not 1 <= self.n_micro_batches <= MAX_MICRO_BATCHES:
            raise ConfigError(
                f"n_micro_batches must be in [1, {MAX_MICRO_BATCHES}], got {self.n_micro_batches}"
            )
        wrong = [c for c in self.averaging_codecs if c not in AVERAGING_CODECS]
        if wrong:
            raise ConfigError(f"averaging codecs must be of {sorted(AVERAGING_CODECS)}, got {wrong[0]!r:.40}")


def default_in_flight(n_micro_batches: int, part: Partition) -> list[int]:
    """Per stage of ``part``, the micro-batches it holds at once without a plan to say:
    the data stage the whole window, the others in order as 1F1B stages of a pipeline
    of ``S - 1`` (the data owner's stage only adds the source and the loss)."""
    others = [s for s in range(part.n_stages) if s != part.data_stage]
    held = {s: in_flight(n_micro_batches, len(others), k) for k, s in enumerate(others)}
    held[part.data_stage] = in_flight(n_micro_batches, part.n_stages)
    return [held[s] for s in range(part.n_stages)]


def stage_setups(
    spec: ModelSpec,
    fingerprint: str,
    assignment: Sequence[int],
    part: Partition,
    layout: RuntimeLayout,
    options: JobOptions,
    addresses: Mapping[str, Sequence[str]],
    *,
    weights: str = "seed",
    restore: Mapping[int, tuple[ShardSource, ...]] | None = None,
) -> list[JobSetup]:
    """One setup per stage of ``layout``. ``assignment`` (a stage per OP-DAG position) is
    what the layout gave, before the split normalized it into ``part``: every stage
    normalizes it the same way, and a planned one is what the stage compares with the
    published plan. ``addresses[peer]`` are the multiaddrs other stages dial it at.
    ``weights``: where every stage's initial tensors come from (``JobSetup.weights``);
    ``restore[stage]``: the shards a stage reads them from, with ``weights="shards"``.

    Raises:
        ConfigError: ``layout.in_flight`` is not one value in [1, n_micro_batches] per stage.
    """
    n_b = options.n_micro_batches
    held = list(layout.in_flight) if layout.in_flight is not None else default_in_flight(n_b, part)
    if len(held) != part.n_stages or not all(1 <= h <= n_b for h in held):
        raise ConfigError(f"in_flight needs one value in [1, {n_b}] per stage, got {held}")
    ranges = tuple(
        node_ranges(i for i, s in enumerate(assignment) if s == stage) for stage in range(part.n_stages)
    )
    peers = tuple((p, tuple(addresses.get(p, ()))[:8]) for p in layout.peers)
    return [
        JobSetup(
            job=options.job,
            spec=spec,
            peers=peers,
            node_ranges=ranges,
            stage=stage,
            data_stage=part.data_stage,
            n_micro_batches=n_b,
            optimizer=options.optimizer,
            fingerprint=fingerprint,
            ratios=tuple(sorted((b, r) for (a, b), r in layout.ratios.items() if a == stage and r > 1)),
            in_flight=held[stage],
            plan_version=options.plan_version,
            epoch=options.epoch,
            ratio_warmup=options.ratio_warmup,
            weights=weights,
            run=options.run,
            shard_ns=namespace_of(options.shard_secret) if options.shard_secret else "",
            restore=(restore or {}).get(stage, ()),
            replicas=options.replicas,
            replica=options.replica,
            group=options.group,
            averaging_s=options.averaging_s,
            averaging_peers=tuple(peers[stage] for peers in options.replica_peers),
            averaging_codec=options.averaging_codec(stage),
        )
        for stage in range(part.n_stages)
    ]
