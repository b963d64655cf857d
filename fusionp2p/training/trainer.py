"""``train``: a data owner's whole job, from a ``JobSpec`` to saved weights.

Submits the job (the coordinator plans it), prints the plan, sets it up over the peers,
then runs the steps on batches of its own text (which never leave this process) with a
progress bar: loss, tokens/s, plan epoch, the slowest stage's peer and compute per step. Every
step is a line of ``metrics.jsonl`` (and a TensorBoard scalar when tensorboard is
installed); every ``checkpoint_every`` steps and at the end the weights are written as
safetensors, and transformers families also get ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.planning import cluster_peers
from fusionp2p.training.corpus import BYTE_VOCAB, TextCorpus
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.submit import SubmittedJob

if TYPE_CHECKING:
    from fusionp2p.swarm import Pipeline, Swarm

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
            for key in ("loss", "tokens_per_s", "step_s"):
                self.board.add_scalar(key, row[key], row["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def preflight(job: JobSpec, registry: ModelRegistry | None = None) -> None:
    """Checks what can be checked before the swarm is contacted: the model family is known
    here and its config valid, and the vocabulary holds the byte-level tokens.

    Raises:
        ConfigError: one line naming the field.
    """
    vocab = job.model_config.get("vocab_size", BYTE_VOCAB)
    if not isinstance(vocab, int) or vocab < BYTE_VOCAB:
        raise ConfigError(f"[model.config] vocab_size: byte-level tokens need >= {BYTE_VOCAB}, got {vocab}")
    spec = job.model_spec()
    spec.resolve(registry or ModelRegistry.for_data_owner(spec.family))


def train(
    swarm: Swarm,
    job: JobSpec,
    *,
    progress: bool = True,
    out: Any = print,
    registry: ModelRegistry | None = None,
) -> TrainResult:
    """Runs ``job`` on ``swarm`` with this process as the data owner (see the module doc).

    Raises:
        ConfigError: a bad job (a model vocabulary smaller than the byte tokenizer's, a
            missing data path, an unknown family or config key).
        SwarmError: too few idle peers within ``job.wait_peers_s``.
        CoordinatorError: no coordinator, or it refused or could not plan the job.
        ProtocolError / PeerUnreachableError: a stage refused its setup or failed.
    """
    preflight(job, registry)
    corpus = TextCorpus.load(job.data_path, seq_len=job.seq_len, max_bytes=job.max_bytes)
    out(f"data: {len(corpus.tokens) / 1e6:.1f} MB of text from {corpus.source} ({corpus.n_samples} samples)")
    submitted = swarm.submit(job, registry=registry)
    out(describe_submitted(submitted))
    run_dir = job.run_dir / submitted.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job.to_dict(), indent=2, default=str))
    spec = job.model_spec()
    start = time.perf_counter()
    losses: list[float] = []
    metrics = _Metrics(run_dir)
    tokens_per_step = job.batch_size * job.seq_len
    pipeline: Pipeline = swarm.pipeline(
        spec,
        plan=submitted.plan,
        optimizer=job.optimizer_config,
        registry=registry,
        epoch=submitted.epoch,
        job=submitted.run_id,
    )
    stage_seconds: list[float] = []
    owners = ["data owner", *(p.peer_id[-8:] for p in pipeline.peers)]  # by runtime stage
    try:
        bar = _progress(job.steps, progress)
        batches = corpus.batches(job.micro_batch_size, job.n_micro_batches, seed=job.data_seed)
        for step in range(1, job.steps + 1):
            began = time.perf_counter()
            loss = pipeline.train_step(next(batches))
            took = time.perf_counter() - began
            stage_seconds = pipeline.stage_seconds()
            losses.append(loss)
            slowest = max(range(len(stage_seconds)), key=stage_seconds.__getitem__) if stage_seconds else 0
            who = owners[slowest] if slowest < len(owners) else "?"
            row = {
                "step": step,
                "loss": loss,
                "tokens": step * tokens_per_step,
                "step_s": took,
                "tokens_per_s": tokens_per_step / took,
                "epoch": submitted.epoch,
                "stage_compute_s": stage_seconds,
                "time": time.time(),
            }
            metrics.write(row)
            bar.set_postfix_str(
                f"loss {loss:.3f}, {row['tokens_per_s']:.0f} tok/s, epoch {submitted.epoch}, "
                f"slowest {who} ({stage_seconds[slowest] if stage_seconds else 0:.2f} s)"
            )
            bar.update(1)
            if job.checkpoint_every and step % job.checkpoint_every == 0 and step < job.steps:
                save_weights(pipeline.fetch("params"), run_dir / f"checkpoint-{step:06d}.safetensors")
        bar.close()
        params = pipeline.fetch("params")
    finally:
        metrics.close()
        pipeline.close()
    weights = save_weights(params, run_dir / "weights.safetensors")
    pretrained = _save_pretrained(job, params, run_dir / "pretrained")
    seconds = time.perf_counter() - start
    window = max(1, min(10, len(losses) // 2))
    out(
        f"trained {job.steps} steps in {seconds:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"(mean of the first {window} steps {sum(losses[:window]) / window:.3f}, "
        f"of the last {window} {sum(losses[-window:]) / window:.3f}); "
        f"weights in {weights}" + (f", save_pretrained in {pretrained}" if pretrained else "")
    )
    return TrainResult(
        submitted.run_id, losses, submitted, run_dir, weights, pretrained, seconds, stage_seconds
    )
