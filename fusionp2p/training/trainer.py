"""``train``: a data owner's whole job, from a ``JobSpec`` to saved weights.

Submits the job (the coordinator plans it), prints the plan, sets it up over the peers,
then runs the steps on batches of its own data (which never leave this process) with a
progress bar: loss, tokens/s, plan version, the slowest stage's peer and compute per step.
Every step is a line of ``metrics.jsonl``; every ``checkpoint_every`` steps (or as often
as costs <= 10% when 0) a checkpoint: each stage's shard of tensors and optimizer state,
kept by the stages, and its manifest in ``checkpoints/``; fault-handling events to
``events.jsonl`` (``JobRun``: lost peers and stragglers are planned around), and at the
end the weights are written (``outputs.py``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionp2p.errors import ConfigError
from fusionp2p.net.connection import SwarmConnection
from fusionp2p.opdag.families import BUILTIN_FAMILIES, ModelRegistry
from fusionp2p.opdag.lm_families import LM_FAMILIES
from fusionp2p.opdag.spec import resolve_spec
from fusionp2p.planning import cluster_peers
from fusionp2p.training.checkpoint import newest_resumable
from fusionp2p.training.corpus import BYTE_VOCAB
from fusionp2p.training.elastic import Elastic
from fusionp2p.training.images import DIGIT_CLASSES
from fusionp2p.training.job_run import JobRun, StepFailed
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.outputs import MetricsLog, logged_losses, save_pretrained, save_weights
from fusionp2p.training.submit import SubmittedJob, new_run_id
from fusionp2p.training.supervision import EventLog

__all__ = ["TrainResult", "describe_submitted", "preflight", "train"]

Out = Callable[[str], Any]


@dataclass
class TrainResult:
    """What a finished job left: its losses, its plan, and where its files are."""

    run_id: str
    losses: list[float]
    submitted: SubmittedJob
    run_dir: Path
    weights: Path | None  # weights.safetensors ([output] weights = "gather"); None: kept by the stages
    pretrained: Path | None  # a save_pretrained directory, for transformers families (gathered)
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
    replicated = submitted.replicated
    if replicated is not None and replicated.replicas > 1:
        codecs = [replicated.averaging_codec(k) for k in range(len(replicated.averaging_s))]
        head.append(
            f"{replicated.replicas} replicas, {plan.n_micro_batches} micro-batches each, "
            f"{replicated.expected_s:.3f} s per step (estimate); each stage's gradients averaged in "
            f"{', '.join(f'{s * 1e3:.0f}' for s in replicated.averaging_s)} ms (estimate)"
            + (f", sent as {', '.join(codecs)}" if set(codecs) != {"none"} else "")
        )
        head += [
            f"replica {k}: {', '.join(names[p] for p in r.peer_ids)}" for k, r in enumerate(replicated.plans)
        ]
        head.append("replica 0:")
    return "\n".join([*head, plan.describe(submitted.traced.dag, submitted.data_owner)])


WEIGHTS = "weights.safetensors"  # a finished run's final weights, in its run directory
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
    resolve_spec(spec, registry or ModelRegistry.for_data_owner(spec.family))
    if job.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "[output] tensorboard: TensorBoard logging needs the tensorboard package: "
            "pip install 'fusionp2p[tensorboard]'"
        )


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _console(out: Out, progress: bool) -> Out:
    """Where event lines go: above the progress bar while there is one."""
    if not progress:
        return out
    from tqdm import tqdm

    return lambda line: tqdm.write(line, file=sys.stderr)


def _open_run(
    connection: SwarmConnection,
    job: JobSpec,
    out: Out,
    *,
    progress: bool,
    registry: ModelRegistry | None,
    resume: bool,
) -> tuple[JobRun, list[float]]:
    """A new run of ``job`` or, with ``resume``, its newest run that has a checkpoint,
    started on its first plan; the losses of the steps it already did.

    Raises:
        ConfigError: nothing to resume, or bad data.
    """
    data = job.load_data()
    out(f"data: {data.describe()}")
    found = newest_resumable(job.run_dir) if resume else None
    if resume and found is None:
        raise ConfigError(f"nothing to resume: no run of job {job.name} under {job.run_dir} has a checkpoint")
    complete = found is not None and found[1].step >= job.steps  # its final state is a checkpoint
    if found is not None and complete and len(logged_losses(found[0], job.steps)) >= job.steps:
        raise ConfigError(
            f"nothing to resume: run {found[0].name} of job {job.name} is complete ({job.steps} steps, "
            f"its final checkpoint in {found[1].path}); to train it longer, raise [train] steps and resume"
        )
    run_dir, checkpoint = found if found is not None else (job.run_dir / new_run_id(job.name), None)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2, default=str))
    events = EventLog(run_dir / "events.jsonl", out=_console(out, progress))
    done_versions = [int(e.get("plan_version", 0)) for e in EventLog.read(events.path)]
    run = JobRun(
        connection,
        job,
        data,
        run_dir.name,
        run_dir,
        events,
        registry=registry,
        version=max(done_versions, default=0),
    )
    losses: list[float] = []
    if checkpoint is not None:
        losses = logged_losses(run_dir, checkpoint.step)
        events.emit(
            "resumed",
            f"resuming run {run.run_id} from the checkpoint of step {checkpoint.step} (plan version "
            f"{checkpoint.plan_version})",
            step=checkpoint.step,
        )
    out(describe_submitted(run.start(checkpoint)))
    return run, losses


def _step_row(run: JobRun, loss: float, took: float, stage_seconds: list[float]) -> dict[str, Any]:
    """The metrics row of the step ``run`` just did (with replicas: how many ran it, and
    per stage the seconds its replicas spent averaging)."""
    assert run.submitted is not None and run.pipeline is not None
    left, planned = run.pipeline.replicas
    share = run.pipeline.n_micro_batches / run.job.n_micro_batches  # a dropped replica's share is skipped
    per_step, unit = run.job.batch_size * share * run.data.units_per_sample, run.data.unit
    replicas = (
        {"replicas": left, "averaging_s": [round(s, 4) for s, _ in run.pipeline.stage_averaging()]}
        if planned > 1
        else {}
    )
    return {
        "step": run.step,
        "loss": loss,
        unit: run.step * per_step,
        "step_s": took,
        f"{unit}_per_s": per_step / took,
        "epoch": run.submitted.epoch,
        "plan_version": run.version,
        "peers": run.stage_peers,
        "stage_compute_s": stage_seconds,
        **replicas,
        "time": time.time(),
    }


def _postfix(run: JobRun, row: dict[str, Any]) -> str:
    """The progress bar's summary of a step: loss, speed, plan, the slowest stage."""
    seconds = row["stage_compute_s"]
    owners = ["data owner", *(p[-8:] for p in run.stage_peers)]
    slowest = max(range(len(seconds)), key=seconds.__getitem__) if seconds else 0
    who = owners[slowest] if slowest < len(owners) else "?"
    unit = run.data.unit
    averaging = row.get("averaging_s")
    return (
        f"loss {row['loss']:.3f}, {row[f'{unit}_per_s']:.0f} {unit[:3]}/s, plan v{run.version}, "
        + (f"{row['replicas']} replicas (averaging {max(averaging):.2f} s), " if averaging else "")
        + f"slowest {who} ({seconds[slowest] if seconds else 0:.2f} s)"
    )


def _run_steps(
    run: JobRun,
    losses: list[float],
    metrics: MetricsLog,
    bar: Any,
    on_step: Callable[[dict[str, Any]], None] | None,
) -> tuple[dict[str, torch.Tensor] | None, list[float]]:
    """Steps ``run`` to the job's end, recovering from failed steps, and checkpoints the
    final state; the final trainable weights if the job gathers them, and the last step's
    compute per stage."""
    job = run.job
    elastic = Elastic(run)
    stage_seconds: list[float] = []
    checkpoint_s: float | None = None  # the last checkpoint's cost, reported with the next step
    try:
        while True:
            try:
                if run.step >= job.steps:  # the final weights are a checkpoint, kept by the stages
                    if run.checkpoint is None or run.checkpoint.step < run.step:
                        run.maybe_checkpoint(force=True)
                    return (run.fetch_params() if job.weights == "gather" else None), stage_seconds
                loss, took = run.train_step()
                assert run.pipeline is not None
                stage_seconds = run.pipeline.stage_seconds()
                del losses[run.step - 1 :]
                losses.append(loss)
                row = _step_row(run, loss, took, stage_seconds)
                if checkpoint_s is not None:  # the checkpoint after the previous step: its cost here
                    row["checkpoint_s"] = checkpoint_s
                    row["checkpoint_bytes"] = run.checkpoint_bytes
                metrics.write(row)  # the step's row first: a checkpoint of step N never exists without it
                checkpoint_s = run.maybe_checkpoint() if run.step < job.steps else None
                run.report(loss, force=run.step == job.steps)
                bar.n = run.step
                bar.set_postfix_str(_postfix(run, row))
                bar.refresh()
                if on_step is not None:
                    on_step(row)
                if run.clock.straggling() and run.step < job.steps:
                    run.switch_for_straggler()
                else:
                    elastic.tick()
            except StepFailed as failure:
                run.recover(failure)
                bar.n = run.step
                bar.refresh()
    finally:
        elastic.close()  # a plan still being made is of no use now


def train(
    connection: SwarmConnection,
    job: JobSpec,
    *,
    progress: bool = True,
    out: Out = print,
    registry: ModelRegistry | None = None,
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Runs ``job`` on ``connection``'s swarm with this process as the data owner (see the
    module doc).

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
    start = time.perf_counter()
    run, losses = _open_run(connection, job, out, progress=progress, registry=registry, resume=resume)
    metrics = MetricsLog(run.run_dir, tensorboard=job.tensorboard)
    try:
        bar = _progress(job.steps, progress)
        bar.update(run.step)
        params, stage_seconds = _run_steps(run, losses, metrics, bar, on_step)
        bar.close()
    finally:
        metrics.close()
        run.close()
    weights = pretrained = None
    if params is not None:
        weights = save_weights(params, run.run_dir / WEIGHTS)
        pretrained = save_pretrained(job.model_spec(), params, run.run_dir / "pretrained", registry)
        where = f"weights in {weights}" + (f", save_pretrained in {pretrained}" if pretrained else "")
    else:
        where = (
            f"the weights stay with the stages (checkpoint of step {run.step}); write them with "
            f"`fusionp2p export {run.run_dir} --out DIR --initial-peers <multiaddr>`"
        )
    seconds = time.perf_counter() - start
    window = max(1, min(10, len(losses) // 2))
    out(
        f"trained {job.steps} steps in {seconds:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(mean of the first {window} steps {sum(losses[:window]) / window:.3f}, "
        f"of the last {window} {sum(losses[-window:]) / window:.3f}); "
        f"{run.replans} re-plan(s); {where}"
    )
    assert run.submitted is not None
    return TrainResult(
        run.run_id,
        losses,
        run.submitted,
        run.run_dir,
        weights,
        pretrained,
        seconds,
        stage_seconds,
        run.replans,
    )
