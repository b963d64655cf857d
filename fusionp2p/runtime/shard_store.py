"""A peer's checkpoint shards on its own disk, and who may read them.

A shard is one stage's state at one step (its tensors and optimizer state), in parts of
bounded size, each a safetensors file: ``<root>/<ns>/<run>/step-NNNNNN/<shard>.NNNN.safetensors``,
where ``ns`` is the run's namespace (``records.shards``). Parts are written atomically;
the newest ``keep`` steps of a run stay, older ones are removed. A shard is read only by
peers granted it by the holder of the namespace's secret, and only the tensors they ask
for. Nothing here is ever unpickled: shards are safetensors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

from fusionp2p.errors import ProtocolError

__all__ = [
    "GRANT_TTL_S",
    "ShardStore",
    "default_shard_dir",
    "namespace_of",
    "tensor_digest",
    "tensor_digests",
]

logger = logging.getLogger(__name__)

GRANT_TTL_S = 3600.0  # a grant to read a shard lasts this long
_STEP_RE = re.compile(r"^step-(\d{6,})$")


def default_shard_dir(peer_id: str) -> str:
    """Where a peer keeps shards without ``--checkpoint-dir``: the user's cache, per PeerID."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fusionp2p", "shards", peer_id)


def namespace_of(secret: bytes) -> str:
    """The shard namespace a run's secret names (what stages and holders see of it)."""
    return hashlib.sha256(secret).hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (its shape and dtype are checked separately)."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).hexdigest()


def tensor_digests(tensors: dict[str, torch.Tensor]) -> tuple[tuple[str, str], ...]:
    """(name, sha256) of every tensor, sorted by name."""
    return tuple((name, tensor_digest(tensors[name])) for name in sorted(tensors))


class ShardStore:
    """Checkpoint shards under ``root``, the newest ``keep`` steps of each run."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root).expanduser()
        self.keep = keep
        self._grants: dict[tuple[str, str, int, str], dict[str, float]] = {}  # shard -> reader -> expiry

    def _dir(self, ns: str, run: str, step: int) -> Path:
        return self.root / ns / run / f"step-{step:06d}"

    def parts(self, ns: str, run: str, step: int, shard: str) -> list[Path]:
        """The files of a shard, in order (none if this peer does not hold it)."""
        folder = self._dir(ns, run, step)
        return sorted(folder.glob(f"{shard}.*.safetensors")) if folder.is_dir() else []

    def write(self, ns: str, run: str, step: int, shard: str, part: int, data: bytes | bytearray) -> Path:
        """Stores part ``part`` of a shard atomically; a new step drops the run's steps
        older than the newest ``keep``.

        Raises:
            ProtocolError: ``data`` is not safetensors (nothing is kept).
        """
        folder = self._dir(ns, run, step)
        new = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{shard}.{part:04d}.safetensors"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            with safe_open(str(tmp), framework="pt") as f:
                f.keys()
        except Exception as e:
            tmp.unlink(missing_ok=True)
            raise ProtocolError(f"shard {shard} part {part} is not safetensors: {str(e)[:120]}") from None
        tmp.replace(path)
        if new:
            steps = sorted(
                (int(m.group(1)), d) for d in folder.parent.iterdir() if (m := _STEP_RE.match(d.name))
            )
            for _, old in steps[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def grant(self, secret: bytes, run: str, step: int, shard: str, readers: Iterable[str]) -> None:
        """Lets ``readers`` read a shard in the namespace ``secret`` names.

        Raises:
            ProtocolError: this peer holds no such shard.
        """
        ns = namespace_of(secret)
        if not self.parts(ns, run, step, shard):
            raise ProtocolError(f"this peer holds no shard {shard} of step {step} of run {run}")
        now = time.monotonic()
        key = (ns, run, step, shard)
        granted = {r: t for r, t in self._grants.get(key, {}).items() if t > now}
        granted.update((r, now + GRANT_TTL_S) for r in readers)
        self._grants[key] = granted

    def read(
        self, ns: str, run: str, step: int, shard: str, names: Iterable[str], reader: str | None = None
    ) -> bytes:
        """The tensors ``names`` of a shard, as safetensors bytes, for a granted ``reader``
        (None: this peer itself).

        Raises:
            ProtocolError: ``reader`` was not granted it, the shard is not here, or it has
                no tensor of one of ``names``.
        """
        if reader is not None:
            expiry = self._grants.get((ns, run, step, shard), {}).get(reader, 0.0)
            if expiry <= time.monotonic():
                raise ProtocolError(f"{reader[:12]} may not read shard {shard} of step {step} of run {run}")
        files = self.parts(ns, run, step, shard)
        if not files:
            raise ProtocolError(f"this peer holds no shard {shard} of step {step} of run {run}")
        wanted = set(names)
        out: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                out.update((n, f.get_tensor(n)) for n in f.keys() if n in wanted)  # noqa: SIM118 - a safetensors handle, not a dict
        unknown = sorted(wanted - set(out))
        if unknown:
            raise ProtocolError(f"shard {shard} of step {step} holds no {unknown[:3]}")
        return safetensors.torch.save(out)
