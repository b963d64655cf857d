"""``fusionp2p export RUN_DIR --out DIR``: a run's weights, from the shards its stages keep.

The run's newest checkpoint names every shard's holders; this process, holding the run's
secret, grants itself each shard on its live holders and reads the trainable parameters
(never the optimizer state) one piece at a time, each piece checked against the
manifest's digests and written as one file of a sharded ``save_pretrained`` layout
(``model-0000k-of-0000N.safetensors`` and ``model.safetensors.index.json``), so memory
stays at one piece whatever the model's size. For a transformers family the names are
transformers' (``from_pretrained`` loads the directory; its ``config.json`` is written
too); for others, the model's own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from fusionp2p.config import ExecLimits, format_bytes
from fusionp2p.errors import ConfigError
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import resolve_spec
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ShardSource
from fusionp2p.runtime.pretrained import INDEX_FILE
from fusionp2p.runtime.restore import grant_sources
from fusionp2p.runtime.shard_store import ShardStore, namespace_of
from fusionp2p.runtime.shards import read_shards
from fusionp2p.runtime.stage_state import OPTIMIZER_SEPARATOR
from fusionp2p.training.checkpoint import SECRET_FILE, latest_checkpoint
from fusionp2p.training.job_spec import JobSpec

__all__ = ["export_run"]

logger = logging.getLogger(__name__)

Out = Callable[[str], Any]


def _job(run_dir: Path) -> JobSpec:
    try:
        values = json.loads((run_dir / "job.json").read_text())
        return JobSpec(**values)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{run_dir} is not a run directory of fusionp2p train ({e})") from None


def _names(job: JobSpec, registry: ModelRegistry) -> tuple[dict[str, list[str]], Any]:
    """Each model tensor name -> the names to write it under (a tied one under each), and
    a transformers config to write beside (None for other families)."""
    spec = job.model_spec()
    family, config = resolve_spec(spec, registry)
    with torch.device("meta"):
        wrapper = family.build(config)
    inner = getattr(wrapper, "model", None)
    hf = inner is not None and hasattr(inner, "save_pretrained")
    prefix = family.strip_prefix if hf else ""
    aliases: dict[int, list[str]] = {}
    for name, param in wrapper.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    out = {}
    for names in aliases.values():
        written = [n.removeprefix(prefix) for n in names]
        for name in names:
            out[name] = written
    return out, (inner.config if hf and inner is not None else None)


async def export_run(
    transport: Transport,
    run_dir: Path,
    out_dir: Path,
    *,
    registry: ModelRegistry | None = None,
    timeout: float = 120.0,
    out: Out = print,
) -> Path:
    """Writes the trainable parameters of ``run_dir``'s newest checkpoint into ``out_dir``.

    Raises:
        ConfigError: not a run directory, no checkpoint or secret, or a shard with no live
            holder. ProtocolError: no holder of a shard gave it with its digests.
    """
    job = _job(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    secret_path = run_dir / SECRET_FILE
    if checkpoint is None or not secret_path.is_file():
        raise ConfigError(f"{run_dir} has no checkpoint to export (or no {SECRET_FILE})")
    registry = registry or ModelRegistry.for_data_owner(job.family)
    spec = job.model_spec()
    program = trace_spec(spec, registry, fake=True).program
    state = {**getattr(program, "constants", {}), **program.state_dict}
    trainable = set(program.graph_signature.inputs_to_parameters.values())
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    written_as, hf_config = _names(job, registry)
    secret, run = secret_path.read_bytes(), run_dir.name
    restore = checkpoint.restore()
    sources = {}
    for i, report in enumerate(restore.shards):
        tensors = tuple((n, d) for n, d in report.tensors if OPTIMIZER_SEPARATOR not in n and n in trainable)
        if tensors:
            ns = namespace_of(secret)
            sources[i] = (ShardSource(ns, run, restore.step, report.shard, report.holders, tensors),)
    granted = await grant_sources(
        transport, secret, sources, dict.fromkeys(sources, transport.peer_id), timeout=timeout
    )
    store = ShardStore(run_dir / "shards")
    out_dir.mkdir(parents=True, exist_ok=True)
    files: list[tuple[Path, list[str]]] = []
    total = 0
    for stage_sources in granted.values():
        pieces = read_shards(
            transport, stage_sources, sizes, limits=ExecLimits(), timeout=timeout, store=store
        )
        async for data in pieces:
            piece = safetensors.torch.load(data)
            named = {w: t.clone() for n, t in piece.items() for w in written_as.get(n, [n])}
            path = out_dir / f"part-{len(files):05d}.tmp"
            safetensors.torch.save_file(named, str(path), metadata={"format": "pt"})
            files.append((path, list(named)))
            total += sum(t.numel() * t.element_size() for t in named.values())
            out(f"  {len(files)} piece(s), {format_bytes(total)}")
    weight_map = {}
    for k, (path, names) in enumerate(files, 1):
        final = out_dir / f"model-{k:05d}-of-{len(files):05d}.safetensors"
        path.replace(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if hf_config is not None:
        hf_config.save_pretrained(str(out_dir))
    what = f"{len(weight_map)} tensors, {format_bytes(total)}"
    out(f"exported step {restore.step} of run {run}: {what} in {out_dir}")
    return out_dir
