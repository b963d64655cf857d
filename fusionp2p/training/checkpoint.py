"""Checkpoints of a running job: shards kept by the stages, a manifest kept by the data owner.

Every ``checkpoint_every`` steps each stage writes its own shard (its tensors and its
optimizer's state) on its own disk and copies it to one other stage peer
(``runtime.shards``); the data owner writes only the manifest,
``<run>/checkpoints/step-NNNNNN.json``: the step, the plan version and coordinator epoch
it was taken under, and per shard its holders and every tensor's sha256, signed with an
HMAC of the run's secret (an edited manifest, or another run's, is refused). Tensor names
are the model's own, so a checkpoint restores onto any split of the model: after a
re-plan each new stage owner reads its tensors from the shards' holders, peer to peer.
The run's shard secret (``shard.secret``, which names the run's shards on every holder:
``records.shards``) stays in the run directory. The last ``keep`` manifests stay.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from fusionp2p.errors import ConfigError, RecordError
from fusionp2p.records import ShardReport
from fusionp2p.runtime.restore import Restore

__all__ = [
    "CHECKPOINT_DIR",
    "Checkpoint",
    "choose_replicas",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_resumable",
    "run_secret",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
SECRET_FILE = "shard.secret"
_NAME_RE = re.compile(r"^step-(\d{6,})\.json$")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's manifest: the state after ``step`` optimizer steps."""

    path: Path
    step: int
    plan_version: int
    epoch: int

    def restore(self, data_owner: str | None = None) -> Restore:
        """Where each shard is and what it holds. The shards the data owner that wrote the
        manifest held (in its run directory) are ``data_owner``'s now: a resumed data owner
        has another PeerID.

        Raises:
            ConfigError: the manifest is unreadable or malformed.
        """
        try:
            body = json.loads(self.path.read_text())
            secret = (self.path.parent.parent / SECRET_FILE).read_bytes()
            signed = hmac.compare_digest(str(body.pop("mac", "")), _mac(secret, body))
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"checkpoint {self.path} cannot be read: {str(e)[:200]}") from e
        if not signed:
            raise ConfigError(
                f"checkpoint {self.path} is not signed with its run's secret (edited, or another run's)"
            )
        try:
            old = body.get("data_owner")
            rehome = {old: data_owner} if old and data_owner else {}
            shards = tuple(
                ShardReport(
                    s["shard"],
                    int(s["nbytes"]),
                    tuple((n, d) for n, d in s["tensors"]),
                    tuple(rehome.get(h, h) for h in s["holders"]),
                )
                for s in body["shards"]
            )
        except (ValueError, KeyError, TypeError, RecordError) as e:
            raise ConfigError(f"checkpoint {self.path} cannot be read: {str(e)[:200]}") from e
        return Restore(self.step, shards)


def _mac(secret: bytes, body: dict) -> str:
    """The manifest's signature: an HMAC-SHA256 of its canonical JSON with the run's secret."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, canonical, hashlib.sha256).hexdigest()


def run_secret(run_dir: Path) -> bytes:
    """The run's shard secret, made on first use (readable by this user only)."""
    path = run_dir / SECRET_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()


def save_checkpoint(
    run_dir: Path,
    step: int,
    shards: list[ShardReport],
    *,
    plan_version: int,
    epoch: int,
    data_owner: str = "",
    keep: int = 2,
) -> Checkpoint:
    """Writes the manifest of ``step`` atomically and keeps the last ``keep``;
    ``data_owner`` is this process's PeerID, the holder of the shards in its run directory."""
    folder = run_dir / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.json"
    body = {
        "step": step,
        "plan_version": plan_version,
        "epoch": epoch,
        "data_owner": data_owner,
        "shards": [
            {
                "shard": s.shard,
                "nbytes": s.nbytes,
                "holders": list(s.holders),
                "tensors": [list(t) for t in s.tensors],
            }
            for s in shards
        ],
    }
    body["mac"] = _mac(run_secret(run_dir), body)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.path.unlink(missing_ok=True)
    return Checkpoint(path, step, plan_version, epoch)


def choose_replicas(
    owners: dict[int, str], bandwidth: dict[tuple[str, str], float], data_owner: str
) -> dict[int, str]:
    """Per stage (``owners[stage]``: its peer; the data owner's stage is not in it), the
    other stage peer its shard is copied to: the one it reaches fastest (``bandwidth``,
    bytes/s by (from, to)). A plan with one stage peer has no other: its shard is copied
    to the data owner, the one case where a checkpoint passes through it."""
    out = {}
    for stage, peer in owners.items():
        others = sorted({p for p in owners.values() if p != peer})
        out[stage] = max(others, key=lambda p: (bandwidth.get((peer, p), 0.0), p)) if others else data_owner
    return out


def _read(path: Path) -> Checkpoint | None:
    try:
        body = json.loads(path.read_text())
        return Checkpoint(path, int(body["step"]), int(body["plan_version"]), int(body["epoch"]))
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
