"""``train``: a data owner's whole job, from a ``JobSpec`` to saved weights.

Submits the job (the coordinator plans it), prints the plan, sets it up over the peers,
then runs the steps on batches of its own text (which never leave this process) with a
progress bar: loss, tokens/s, plan version, the slowest stage's peer and compute per step.
Every step is a line of ``metrics.jsonl`` (and a TensorBoard scalar when tensorboard is
installed); checkpoints (every stage's tensors and optimizer state) go to
``checkpoints/`` every ``checkpoint_every`` steps (or as often as costs <= 10% when 0),
fault-handling events to ``events.jsonl`` (``JobRun``: lost peers and stragglers are
planned around), and at the end the weights are written as safetensors; transformers
families also get ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.families import BUILTIN_FAMILIES, ModelRegistry
from fusionp2p.opdag.lm_families import LM_FAMILIES
from fusionp2p.planning import cluster_peers
from fusionp2p.training.corpus import BYTE_VOCAB
from fusionp2p.training.data import load_data
from fusionp2p.training.images import DIGIT_CLASSES
from fusionp2p.training.job_run import JobRun, StepFailed, resumable
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.submit import SubmittedJob, new_run_id
from fusionp2p.training.supervision import EventLog

if TYPE_CHECKING:
    from fusionp2p.swarm import Swarm

__all__ = ["TrainResult", "describe_submitted", "preflight", "save_weights", "train"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished job left: its losses, its plan, and where its files are."""

    run_id: str
    losses: list[float]
    submitted: SubmittedJob
    run_dir: Path
    weights: Path
    pretrained: Path | None  # a save_pretrained directory, for transformers families
    seconds: float
    stage_seconds: list[float] = field(default_factory=list)  # last step's compute per stage
    replans: int = 0  # plans after the first: lost peers and stragglers planned around


def describe_submitted(submitted: SubmittedJob) -> str:
    """The plan as a user wants it: the coordinator, bandwidth clusters, stages, link ratios."""
    plan, topo = submitted.plan, submitted.topology
    names = {pid: pid[-8:] for pid in topo.peer_ids}
    names[submitted.data_owner] += " (data owner)"
    clusters = [[names[topo.peer_ids[i]] for i in c] for c in cluster_peers(topo)]
    head = [
        f"coordinator {submitted.reply.coordinator[-8:]} (epoch {submitted.epoch}) planned job "
        f"{submitted.run_id} with {plan.method} over {len(topo) - 1} idle peer(s)",
        f"{len(clusters)} bandwidth cluster(s): {' | '.join(', '.join(c) for c in clusters)}",
    ]
    return "\n".join([*head, plan.describe(submitted.traced.dag)])


def save_weights(params: dict[str, torch.Tensor], path: Path) -> Path:
    """Writes ``params`` as safetensors (atomically: a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in params.items()}, str(tmp))
    tmp.replace(path)
    return path


def _save_pretrained(job: JobSpec, params: dict[str, torch.Tensor], out: Path) -> Path | None:
    """``save_pretrained`` of a transformers family's model holding ``params``; None for others
    (or when a tensor the model needs is missing, with a warning)."""
    spec = job.model_spec()
    family, config = spec.resolve(ModelRegistry.for_data_owner(spec.family))
    with torch.device("meta"):
        wrapper = family.build(config)
    inner = getattr(wrapper, "model", None)
    if inner is None or not hasattr(inner, "save_pretrained"):
        return None
    state = dict(params)
    aliases: dict[int, list[str]] = {}  # tied parameters are one tensor under several names
    for name, param in wrapper.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    for names in aliases.values():
        held = [n for n in names if n in state]
        for name in names:
            if held:
                state.setdefault(name, state[held[0]])
    wrapper.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, t in wrapper.state_dict().items() if t.is_meta]
    if missing:
        logger.warning("no save_pretrained: the fetched weights miss %s", missing[:3])
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    inner.save_pretrained(str(out))
    return out


class _Metrics:
    """metrics.jsonl, plus TensorBoard scalars when tensorboard is installed."""

    def __init__(self, run_dir: Path) -> None:
        self.file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self.board: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.board is not None:
            for key in ("loss", "tokens_per_s", "images_per_s", "step_s"):
                if key in row:
                    self.board.add_scalar(key, row[key], row["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _console(out: Any, progress: bool) -> Any:
    """Where event lines go: above the progress bar while there is one."""
    if not progress:
        return out
    from tqdm import tqdm

    return lambda line: tqdm.write(line, file=sys.stderr)


_LM_NAMES = frozenset(f.name for f in LM_FAMILIES)  # built-in families that take token ids
_BUILTIN_NAMES = frozenset(f.name for f in BUILTIN_FAMILIES)


def preflight(job: JobSpec, registry: ModelRegistry | None = None) -> None:
    """Checks what can be checked before the swarm is contacted: the model family is known
    here and its config valid, the data kind suits it (text for a causal LM, images for a
    built-in vision family), the vocabulary holds the byte-level tokens, a classifier has
    the digits' classes.

    Raises:
        ConfigError: one line naming the field.
    """
    lm = job.family in _LM_NAMES
    if job.data_kind == "text":
        if job.family in _BUILTIN_NAMES and not lm:
            raise ConfigError(f"[data] kind: 'text' feeds token ids to a causal LM, not to '{job.family}'")
        vocab = job.model_config.get("vocab_size", BYTE_VOCAB)
        if not isinstance(vocab, int) or vocab < BYTE_VOCAB:
            raise ConfigError(
                f"[model.config] vocab_size: byte-level tokens need >= {BYTE_VOCAB}, got {vocab}"
            )
    else:
        if lm:
            raise ConfigError(f"[data] kind: '{job.data_kind}' feeds images, not token ids to '{job.family}'")
        for key in ("num_classes", "classes"):
            classes = job.model_config.get(key, DIGIT_CLASSES)
            if isinstance(classes, int) and classes < DIGIT_CLASSES:
                raise ConfigError(
                    f"[model.config] {key}: the digits have {DIGIT_CLASSES} classes, got {classes}"
                )
    spec = job.model_spec()
    spec.resolve(registry or ModelRegistry.for_data_owner(spec.family))


def _previous_losses(run_dir: Path, upto: int) -> list[float]:
    """The losses of steps 1..``upto`` from a run's metrics (the last row of each step)."""
    by_step: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                by_step[int(row["step"])] = float(row["loss"])
            except (ValueError, KeyError, TypeError):
                continue
    return [by_step[s] for s in range(1, upto + 1) if s in by_step]


def train(
    swarm: Swarm,
    job: JobSpec,
    *,
    progress: bool = True,
    out: Any = print,
    registry: ModelRegistry | None = None,
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Runs ``job`` on ``swarm`` with this process as the data owner (see the module doc).

    A lost or stopped stage owner is planned around and the run goes on from its latest
    checkpoint; a straggler is re-planned around without losing a step (``JobRun``). With
    ``resume`` the newest run of the job that has a checkpoint goes on from it (after the
    data owner itself was lost). ``on_step`` gets each step's metrics row.

    Raises:
        ConfigError: a bad job (a model vocabulary smaller than the byte tokenizer's, a
            missing data path, an unknown family or config key), or nothing to resume.
        SwarmError: too few idle peers within ``job.wait_peers_s``, or no new plan in time.
        CoordinatorError: no coordinator, it refused or could not plan the job, or
            ``max_replans`` re-plans did not get the run through.
    """
    preflight(job, registry)
    data = load_data(job)
    out(f"data: {data.describe()}")
    checkpoint = None
    if resume:
        found = resumable(job)
        if found is None:
            raise ConfigError(
                f"nothing to resume: no run of job {job.name} under {job.run_dir} has a checkpoint"
            )
        run_dir, checkpoint = found
        run_id = run_dir.name
    else:
        run_id = new_run_id(job.name)
        run_dir = job.run_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2, default=str))
    events = EventLog(run_dir / "events.jsonl", out=_console(out, progress))
    done_versions = [int(e.get("plan_version", 0)) for e in EventLog.read(events.path)]
    run = JobRun(
        swarm,
        job,
        data,
        run_id,
        run_dir,
        events,
        registry=registry,
        version=max(done_versions, default=0),
    )
    start = time.perf_counter()
    losses: list[float] = []
    if checkpoint is not None:
        losses = _previous_losses(run_dir, checkpoint.step)
        events.emit(
            "resumed",
            f"resuming run {run_id} from the checkpoint of step {checkpoint.step} (plan version "
            f"{checkpoint.plan_version})",
            step=checkpoint.step,
        )
    submitted = run.start(checkpoint)
    out(describe_submitted(submitted))
    metrics = _Metrics(run_dir)
    per_step, unit = job.batch_size * data.units_per_sample, data.unit
    stage_seconds: list[float] = []
    params: dict[str, torch.Tensor] = {}
    checkpoint_s: float | None = None  # the last checkpoint's cost, reported with the next step
    try:
        bar = _progress(job.steps, progress)
        bar.update(run.step)
        while True:
            try:
                if run.step >= job.steps:
                    state = run.fetch_state()
                    params = {k: v for k, v in state.items() if k in _trainable(run)}
                    break
                loss, took = run.train_step()
                assert run.pipeline is not None and run.submitted is not None
                stage_seconds = run.pipeline.stage_seconds()
                del losses[run.step - 1 :]
                losses.append(loss)
                owners = ["data owner", *(p[-8:] for p in run.stage_peers)]
                slowest = (
                    max(range(len(stage_seconds)), key=stage_seconds.__getitem__) if stage_seconds else 0
                )
                who = owners[slowest] if slowest < len(owners) else "?"
                row = {
                    "step": run.step,
                    "loss": loss,
                    unit: run.step * per_step,
                    "step_s": took,
                    f"{unit}_per_s": per_step / took,
                    "epoch": run.submitted.epoch,
                    "plan_version": run.version,
                    "peers": run.stage_peers,
                    "stage_compute_s": stage_seconds,
                    "time": time.time(),
                }
                if checkpoint_s is not None:
                    row["checkpoint_s"] = checkpoint_s
                # the step's row first: a checkpoint of step N must never exist without it
                metrics.write(row)
                checkpoint_s = run.maybe_checkpoint() if run.step < job.steps else None
                run.report(loss, force=run.step == job.steps)
                bar.n = run.step
                bar.set_postfix_str(
                    f"loss {loss:.3f}, {row[f'{unit}_per_s']:.0f} {unit[:3]}/s, plan v{run.version}, "
                    f"slowest {who} ({stage_seconds[slowest] if stage_seconds else 0:.2f} s)"
                )
                bar.refresh()
                if on_step is not None:
                    on_step(row)
                if run.clock.straggling() and run.step < job.steps:
                    run.switch_for_straggler()
            except StepFailed as failure:
                run.recover(failure)
                bar.n = run.step
                bar.refresh()
        bar.close()
    finally:
        metrics.close()
        run.close()
    weights = save_weights(params, run_dir / "weights.safetensors")
    pretrained = _save_pretrained(job, params, run_dir / "pretrained")
    seconds = time.perf_counter() - start
    window = max(1, min(10, len(losses) // 2))
    out(
        f"trained {job.steps} steps in {seconds:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(mean of the first {window} steps {sum(losses[:window]) / window:.3f}, "
        f"of the last {window} {sum(losses[-window:]) / window:.3f}); "
        f"{run.replans} re-plan(s); weights in {weights}"
        + (f", save_pretrained in {pretrained}" if pretrained else "")
    )
    assert run.submitted is not None
    return TrainResult(
        run_id, losses, run.submitted, run_dir, weights, pretrained, seconds, stage_seconds, run.replans
    )


def _trainable(run: JobRun) -> set[str]:
    assert run.pipeline is not None
    program = run.pipeline.driver.traced.program
    return set(program.graph_signature.inputs_to_parameters.values())
