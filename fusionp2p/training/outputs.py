"""What a run leaves in its directory: metrics, the final weights, a ``save_pretrained`` copy.

``metrics.jsonl`` gets one row per step (and a TensorBoard scalar when the job asks and tensorboard is
installed); the weights are written as safetensors, atomically; transformers families
also get ``save_pretrained``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import resolve_spec
from fusionp2p.records import ModelSpec

__all__ = ["MetricsLog", "logged_losses", "save_pretrained", "save_weights"]

logger = logging.getLogger(__name__)


def save_weights(params: dict[str, torch.Tensor], path: Path) -> Path:
    """Writes ``params`` as safetensors (atomically: a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in params.items()}, str(tmp))
    tmp.replace(path)
    return path


def save_pretrained(
    spec: ModelSpec, params: dict[str, torch.Tensor], out: Path, registry: ModelRegistry | None = None
) -> Path | None:
    """``save_pretrained`` of a transformers family's model holding ``params`` (built from
    ``registry``, the one the job was trained with); None for others (or when a tensor the
    model needs is missing, with a warning)."""
    family, config = resolve_spec(spec, registry or ModelRegistry.for_data_owner(spec.family))
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


class MetricsLog:
    """metrics.jsonl, plus TensorBoard scalars when the job asks for them."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False) -> None:
        self.file = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self.board: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # preflight checked it imports

            self.board = SummaryWriter(str(run_dir / "tensorboard"))

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


def logged_losses(run_dir: Path, upto: int) -> list[float]:
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
