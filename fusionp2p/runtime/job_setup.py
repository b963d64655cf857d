"""``JobSetup``: what a data owner sends a peer to make it run one stage of a job.

JSON (the body of a ``setup`` control message), not a msgpack record: the assignment has
one entry per operator node, so it travels run-length encoded (``[[stage, count], ...]``:
a contiguous plan is a few pairs). It carries its own schema version ``v``. Everything
in it comes from another peer, so ``from_json`` checks every size and range before
anything is built from it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fusionp2p.compression import NO_WARMUP, RatioWarmup
from fusionp2p.config import NAME_RE, PEER_ID_RE, ExecLimits, OptimizerConfig, load_json_object
from fusionp2p.errors import ConfigError
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.opdag.split import Partition, op_node_names
from fusionp2p.opdag.trace import TracedModel
from fusionp2p.planning.cost import in_flight

__all__ = ["JobSetup", "default_in_flight"]

_FINGERPRINT_RE = re.compile(r"^[\w.@:\-]{1,80}$")
_ENGINE_RE = re.compile(r"^[a-z0-9_\-]{1,32}$")
_MAX_NODES = 1 << 20
_MAX_MADDRS = 8
_MAX_MADDR = 256
_MAX_MICRO_BATCHES = 4096
_MAX_RATIO = 1e6


def _runs(assignment: tuple[int, ...]) -> list[list[int]]:
    runs: list[list[int]] = []
    for stage in assignment:
        if runs and runs[-1][0] == stage:
            runs[-1][1] += 1
        else:
            runs.append([stage, 1])
    return runs


def _expand(runs: Any, n_stages: int) -> tuple[int, ...]:
    if not isinstance(runs, list):
        raise ConfigError("setup assignment must be a list of [stage, count] pairs")
    out: list[int] = []
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
        ):
            raise ConfigError(f"setup assignment holds {run!r:.40}, not a [stage, count] pair")
        stage, count = run
        if not 0 <= stage < n_stages or count < 1 or len(out) + count > _MAX_NODES:
            raise ConfigError(f"setup assignment run {run!r:.40} is out of range ({n_stages} stages)")
        out.extend([stage] * count)
    if not out:
        raise ConfigError("setup assignment is empty")
    return tuple(out)


def _int(body: dict[str, Any], key: str, low: int, high: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"setup {key} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def _warmup(value: Any) -> RatioWarmup:
    if not isinstance(value, list) or len(value) != 2:
        raise ConfigError(f"setup ratio_warmup must be [steps, done], got {value!r:.40}")
    try:
        return RatioWarmup(*value)
    except ConfigError as e:
        raise ConfigError(f"setup ratio_warmup: {e}") from e


def _str(body: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not pattern.match(value):
        raise ConfigError(f"setup {key} is malformed: {value!r:.80}")
    return value


def _peers(value: Any, n_stages: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if not isinstance(value, list) or len(value) != n_stages:
        raise ConfigError(f"setup peers must list {n_stages} [peer id, multiaddrs] pairs")
    peers = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], list):
            raise ConfigError(f"setup peers holds {item!r:.80}, not a [peer id, multiaddrs] pair")
        peer_id, maddrs = item
        if not isinstance(peer_id, str) or not PEER_ID_RE.match(peer_id):
            raise ConfigError(f"setup peer id {peer_id!r:.80} is not a base58 PeerID")
        if len(maddrs) > _MAX_MADDRS or any(
            not isinstance(m, str) or not m.startswith("/") or len(m) > _MAX_MADDR for m in maddrs
        ):
            raise ConfigError(f"setup multiaddrs of {peer_id[:12]}: <= {_MAX_MADDRS} '/...' strings")
        peers.append((peer_id, tuple(maddrs)))
    return tuple(peers)


def _ratios(value: Any, n_stages: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, list) or len(value) > n_stages:
        raise ConfigError(f"setup ratios must be at most {n_stages} [stage, ratio] pairs")
    out = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ConfigError(f"setup ratios holds {item!r:.40}, not a [stage, ratio] pair")
        stage, ratio = item
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < n_stages:
            raise ConfigError(f"setup ratio for stage {stage!r:.20} of {n_stages}")
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isfinite(ratio):
            raise ConfigError(f"setup ratio {ratio!r:.20} is not a finite number")
        if not 1 <= ratio <= _MAX_RATIO:
            raise ConfigError(f"setup ratio {ratio} not in [1, {_MAX_RATIO:g}]")
        out.append((stage, float(ratio)))
    return tuple(out)


def default_in_flight(n_micro_batches: int, part: Partition) -> list[int]:
    """Per stage of ``part``, the micro-batches it holds at once without a plan to say:
    the data stage the whole window, the others in order as 1F1B stages of a pipeline
    of ``S - 1`` (the data owner's stage only adds the source and the loss)."""
    others = [s for s in range(part.n_stages) if s != part.data_stage]
    held = {s: in_flight(n_micro_batches, len(others), k) for k, s in enumerate(others)}
    held[part.data_stage] = in_flight(n_micro_batches, part.n_stages)
    return [held[s] for s in range(part.n_stages)]


@dataclass(frozen=True)
class JobSetup:
    """Everything a stage needs to build its executor."""

    VERSION: ClassVar[int] = 4  # 3: the coordinator's epoch; 4: per-stage in_flight, ratio_warmup

    job: str  # 1-64 letters, digits, '-' or '_'
    spec: ModelSpec
    assignment: tuple[int, ...]  # a stage per operator node, in graph order
    n_stages: int
    stage: int  # the stage the receiving peer runs
    data_stage: int  # the data owner's stage: raw inputs and the loss
    peers: tuple[tuple[str, tuple[str, ...]], ...]  # per stage: (peer id, multiaddrs)
    n_micro_batches: int
    optimizer: OptimizerConfig
    fingerprint: str  # OpDag.fingerprint of the data owner's traced model
    ratios: tuple[tuple[int, float], ...] = ()  # Top-K ratio of what this stage sends each stage
    in_flight: int = 1  # micro-batches unfinished at once (1F1B window); memory is checked for this many
    engine: str = "torch"  # the execution engine that runs the stage (a PeerRecord lists its engines)
    plan_version: int = 1  # every OpData of the job names it; another version's is dropped
    epoch: int = 0  # the coordinator epoch whose published plan this follows; 0: the owner's own split
    ratio_warmup: RatioWarmup = NO_WARMUP  # Top-K ratios grow from 1 (dense) to the plan's

    def peer_of(self, stage: int) -> str:
        return self.peers[stage][0]

    @classmethod
    def for_stages(
        cls,
        job: str,
        spec: ModelSpec,
        traced: TracedModel,
        part: Partition,
        peers: Sequence[tuple[str, Sequence[str]]],
        *,
        n_micro_batches: int,
        optimizer: OptimizerConfig,
        link_ratios: Mapping[tuple[int, int], float] | None = None,
        plan_version: int = 1,
        epoch: int = 0,
        planned: Sequence[int] | None = None,
        in_flight: Sequence[int] | None = None,
        ratio_warmup: RatioWarmup = NO_WARMUP,
    ) -> list[JobSetup]:
        """One setup per stage of ``part`` (a split of ``traced``, the traced ``spec``);
        ``link_ratios[(a, b)]`` is the Top-K ratio of what stage ``a`` sends stage ``b``.
        ``planned`` is a published plan's assignment as it was planned: it travels instead
        of ``part``'s normalized one, so each stage can compare it with the plan in the DHT
        (the split normalizes it the same way everywhere). ``in_flight[s]``: the
        micro-batches stage ``s`` holds at once; by default the data stage's window
        ``min(n_b, S)`` and, for the others in order, 1F1B's ``min(n_b, S - 1 - k)``
        (``planning.cost.in_flight``).

        Raises:
            ConfigError: ``in_flight`` is not one value in [1, n_micro_batches] per stage."""
        if planned is not None:
            assignment = tuple(planned)
        else:
            assignment = tuple(part.stage_of[n] for n in op_node_names(traced.program.graph))
        ratios = link_ratios or {}
        held = list(in_flight) if in_flight is not None else default_in_flight(n_micro_batches, part)
        if len(held) != part.n_stages or not all(1 <= h <= n_micro_batches for h in held):
            raise ConfigError(f"in_flight needs one value in [1, {n_micro_batches}] per stage, got {held}")
        return [
            cls(
                job=job,
                spec=spec,
                assignment=assignment,
                n_stages=part.n_stages,
                stage=stage,
                data_stage=part.data_stage,
                peers=tuple((p, tuple(m)) for p, m in peers),
                n_micro_batches=n_micro_batches,
                optimizer=optimizer,
                fingerprint=traced.dag.fingerprint,
                ratios=tuple(sorted((b, r) for (a, b), r in ratios.items() if a == stage and r > 1)),
                in_flight=held[stage],
                plan_version=plan_version,
                epoch=epoch,
                ratio_warmup=ratio_warmup,
            )
            for stage in range(part.n_stages)
        ]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "v": self.VERSION,
                "job": self.job,
                "spec": self.spec.to_dict(),
                "assignment": _runs(self.assignment),
                "n_stages": self.n_stages,
                "stage": self.stage,
                "data_stage": self.data_stage,
                "peers": [[p, list(m)] for p, m in self.peers],
                "n_micro_batches": self.n_micro_batches,
                "optimizer": self.optimizer.to_dict(),
                "fingerprint": self.fingerprint,
                "ratios": [[s, r] for s, r in self.ratios],
                "in_flight": self.in_flight,
                "engine": self.engine,
                "plan_version": self.plan_version,
                "epoch": self.epoch,
                "ratio_warmup": [self.ratio_warmup.steps, self.ratio_warmup.done],
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | bytearray, limits: ExecLimits | None = None) -> JobSetup:
        """Parses and bounds-checks a setup another peer sent.

        Raises:
            ConfigError: malformed, too large or deep, a newer schema, or any field out of range.
        """
        limits = limits or ExecLimits()
        body = load_json_object(data, "setup", limits.control_bytes, max_depth=limits.json_depth)
        version = body.get("v")
        if version != cls.VERSION:
            raise ConfigError(f"setup schema version {version!r:.20}; this peer reads {cls.VERSION}")
        n_stages = _int(body, "n_stages", 1, limits.max_stages)
        n_micro_batches = _int(body, "n_micro_batches", 1, _MAX_MICRO_BATCHES)
        return cls(
            job=_str(body, "job", NAME_RE),
            spec=ModelSpec.from_dict(body.get("spec")),
            assignment=_expand(body.get("assignment"), n_stages),
            n_stages=n_stages,
            stage=_int(body, "stage", 0, n_stages - 1),
            data_stage=_int(body, "data_stage", 0, n_stages - 1),
            peers=_peers(body.get("peers"), n_stages),
            n_micro_batches=n_micro_batches,
            optimizer=OptimizerConfig.from_dict(body.get("optimizer")),
            fingerprint=_str(body, "fingerprint", _FINGERPRINT_RE),
            ratios=_ratios(body.get("ratios", []), n_stages),
            in_flight=_int(body, "in_flight", 1, n_micro_batches),
            engine=_str(body, "engine", _ENGINE_RE),
            plan_version=_int(body, "plan_version", 0, 1 << 62),
            epoch=_int(body, "epoch", 0, 1 << 62),
            ratio_warmup=_warmup(body.get("ratio_warmup")),
        )
