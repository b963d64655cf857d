"""Checkpoints of a running job, kept by its data owner.

Every ``checkpoint_every`` steps the data owner fetches each stage's full state (its
tensors and its optimizer's, see ``StageState.save_full``), merges them by tensor name and
writes one safetensors file ``<run>/checkpoints/step-NNNNNN.safetensors`` tagged with the
step, the plan version and the coordinator epoch it was taken under. Names are the model's
own, so a checkpoint restores onto any split of the model: after a re-plan each new stage
owner gets its part of it. The last ``keep`` files stay; older ones are removed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fusionp2p.errors import ConfigError

__all__ = ["Checkpoint", "latest_checkpoint", "list_checkpoints", "newest_resumable", "save_checkpoint"]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
_NAME_RE = re.compile(r"^step-(\d{6,})\.safetensors$")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint file: the state after ``step`` optimizer steps."""

    path: Path
    step: int
    plan_version: int
    epoch: int

    def load(self) -> dict[str, torch.Tensor]:
        """The merged state of every stage, by tensor name (optimizer state as ``name#key``).

        Raises:
            ConfigError: the file is unreadable or not safetensors.
        """
        try:
            return load_file(str(self.path))
        except Exception as e:
            raise ConfigError(f"checkpoint {self.path} cannot be read: {str(e)[:200]}") from e


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, torch.Tensor], *, plan_version: int, epoch: int, keep: int = 2
) -> Checkpoint:
    """Writes ``state`` atomically as the checkpoint of ``step`` and keeps the last ``keep``."""
    folder = run_dir / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    meta = {"step": str(step), "plan_version": str(plan_version), "epoch": str(epoch)}
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp), metadata=meta)
    tmp.replace(path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.path.unlink(missing_ok=True)
    return Checkpoint(path, step, plan_version, epoch)


def _read(path: Path) -> Checkpoint | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return Checkpoint(path, int(meta["step"]), int(meta["plan_version"]), int(meta["epoch"]))
    except Exception as e:  # a torn or foreign file: skip it, say so
        logger.warning("ignoring checkpoint %s: %s", path, str(e)[:200])
        return None


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """The readable checkpoints of a run, oldest first."""
    folder = run_dir / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [_read(p) for p in sorted(folder.iterdir()) if _NAME_RE.match(p.name)]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The run's newest readable checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def newest_resumable(runs_dir: Path) -> tuple[Path, Checkpoint] | None:
    """The newest run under ``runs_dir`` (a job's ``run_dir``) that has a checkpoint."""
    if not runs_dir.is_dir():
        return None
    found = []
    for run in runs_dir.iterdir():
        checkpoint = latest_checkpoint(run) if run.is_dir() else None
        if checkpoint is not None:
            found.append((checkpoint.path.stat().st_mtime, run, checkpoint))
    if not found:
        return None
    _, run, checkpoint = max(found, key=lambda f: f[0])
    return run, checkpoint
