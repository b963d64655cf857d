"""Building a stage's executor from a setup: the torch engine, with a memory check first.

``build_torch_stage`` resolves the spec's family in this peer's ``ModelRegistry`` (an
unknown family is refused, nothing is imported), traces the model under a fake tensor
mode (nothing allocated), checks the data owner's graph fingerprint and what the stage
needs against ``max_memory``, and only then allocates this stage's own tensors (never the
whole model): made here from the spec's seed (``opdag.init``), or empty for the job
owner's weights (a checkpoint's) to fill. Another engine plugs in as another function of
the same signature (``ENGINES``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from fusionp2p.config import format_bytes
from fusionp2p.errors import ConfigError, LimitError
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import model_init, resolve_spec
from fusionp2p.opdag.split import Partition, partition
from fusionp2p.opdag.trace import TracedModel, trace_spec
from fusionp2p.records import JobSetup, ModelSpec
from fusionp2p.runtime.device_profile import free_memory
from fusionp2p.runtime.executor import Executor
from fusionp2p.runtime.memory import StageMemory, stage_memory
from fusionp2p.runtime.torch_executor import TorchExecutor

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "ENGINES",
    "BuildStage",
    "build_torch_stage",
    "check_stage_memory",
    "memory_allowance",
    "stage_initial",
]

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.8  # of the device's free memory, when no --max-memory is set
BuildStage = Callable[[JobSetup, ModelRegistry, "int | None", str], Executor]


def memory_allowance(max_memory: int | None, device: str = "cpu") -> int:
    """Bytes a stage may need: ``max_memory``, or 80% of the device's free memory now."""
    if max_memory is not None:
        return max_memory
    return int(DEFAULT_MEMORY_FRACTION * free_memory(device)[0])


def _split(traced: TracedModel, setup: JobSetup) -> Partition:
    if traced.dag.fingerprint != setup.fingerprint:
        raise ConfigError(
            f"model {setup.spec.family!r} traced to OP-DAG {traced.dag.fingerprint} here but "
            f"{setup.fingerprint} at the data owner (different torch/transformers versions?)"
        )
    return partition(traced.program, setup.assignment, setup.n_stages, data_stage=setup.data_stage)


def check_stage_memory(
    need: StageMemory, allowed: int, what: str, who: str = "this peer allows (--max-memory)"
) -> None:
    """Raises LimitError naming ``what`` and ``who`` sets the limit, if ``need`` is over ``allowed``."""
    if need.total > allowed:
        raise LimitError(f"{what} needs {need.describe()}, more than the {format_bytes(allowed)} {who}")


def stage_initial(spec: ModelSpec, registry: ModelRegistry, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """A stage's initial tensors ``names``, made here from ``spec``'s seed (``opdag.init``):
    the same values on any peer, in any split, as the reference ``build_model``.

    Raises:
        ConfigError: the family's init cannot run one tensor at a time, or the trace has a
            tensor the model does not (a constant made in ``forward``).
    """
    plan = model_init(spec, registry)
    names = list(names)
    unknown = sorted(set(names) - set(plan.names()))
    if unknown:
        raise ConfigError(
            f"model {spec.family!r}: tensors {unknown[:3]} are not parameters or buffers of the model, "
            "so no stage can make them on its own"
        )
    return plan.tensors(names)


def build_torch_stage(
    setup: JobSetup, registry: ModelRegistry, max_memory: int | None, device: str = "cpu"
) -> Executor:
    """This peer's stage of ``setup``, if its family is served here and it fits in memory.

    The model is traced fake (nothing allocated) and only this stage's tensors are
    materialized on ``device``: made from the spec's seed one at a time (``setup.weights ==
    "seed"``), or empty for the owner's weights to fill. A model that cannot be traced fake
    is refused: the real model is never built to find out its size.

    Raises:
        UnknownModelError: the family is not served by this peer.
        ConfigError: the config breaks the family's schema, the model cannot be traced
            without allocating it, its init cannot run one tensor at a time, or the graph
            differs from the data owner's.
        LimitError: the stage would need more memory than allowed.
    """
    family, _ = resolve_spec(setup.spec, registry)
    allowed = memory_allowance(max_memory, device)
    try:
        traced = trace_spec(setup.spec, registry, fake=True)
    except ConfigError:
        raise
    except Exception as e:  # a factory that cannot run without real tensors, or a bad input
        raise ConfigError(
            f"model {family.name!r} cannot be traced without allocating it ({type(e).__name__}: "
            f"{str(e)[:200]}); this peer never builds a model to find out its size"
        ) from None
    part = _split(traced, setup)
    need = stage_memory(traced, part, setup.stage, in_flight=setup.in_flight, optimizer=setup.optimizer)
    check_stage_memory(need, allowed, f"stage {setup.stage} of job {setup.job} ({setup.spec.family})")
    logger.info(
        "stage %d of job %s (%s): needs about %s of the %s allowed",
        setup.stage,
        setup.job,
        family.name,
        format_bytes(need.total),
        format_bytes(allowed),
    )
    initial = (
        stage_initial(setup.spec, registry, part.params[setup.stage]) if setup.weights == "seed" else None
    )
    return TorchExecutor(
        traced.program,
        part,
        setup.stage,
        job=setup.job,
        n_micro_batches=setup.n_micro_batches,
        optimizer=setup.optimizer,
        ratios=dict(setup.ratios),
        materialize=False,
        initial=initial,
        plan_version=setup.plan_version,
        device=device,
        ratio_warmup=setup.ratio_warmup,
    )


ENGINES: dict[str, BuildStage] = {"torch": build_torch_stage}  # what a PeerRecord's ``executors`` lists
