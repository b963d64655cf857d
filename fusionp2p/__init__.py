"""fusionp2p: decentralized training of one model over many peers (after FusionLLM).

The layers, lowest first (each imports only from those below it; ``docs/architecture.md``
draws them):

- ``errors.py``, ``config.py``, ``version.py``: the FusionP2PError tree; validated config
  dataclasses; the version.
- ``records/``: every byte that crosses a process boundary, versioned and validated.
- ``opdag/``: the OP-DAG IR, model families and specs, tracing, splitting.
- ``planning/``: cost model, OP-Fence, baselines, the Plan (pure).
- ``compression/``: Top-K, its wire packing, error feedback (CUDA sources in ``kernels/``).
- ``net/``: identity, the DHT and its directory, frames, transports, probes, a client's connection.
- ``runtime/``: device profiling, the stage server, executors, the data owner's pipeline driver.
- ``coordination/``: the lease and its election, the coordinator, a stage's check of the plan.
- ``training/``: the data owner's role: job specs, data, submission, pipelines, the run.
- ``peer.py``, ``swarm.py``, ``launch.py``, ``viz.py``, ``cli*.py``: composition.
"""

from fusionp2p.config import DEFAULT_SWARM, ExecLimits, OptimizerConfig, PeerConfig, ProbeConfig, Timeouts
from fusionp2p.errors import (
    ConfigError,
    FusionP2PError,
    LimitError,
    PeerUnreachableError,
    ProfileError,
    ProtocolError,
    RecordError,
    SwarmError,
)
from fusionp2p.records import LinkRecord, ModelSpec, PeerRecord
from fusionp2p.version import __version__

__all__ = [
    "DEFAULT_SWARM",
    "ConfigError",
    "DataOwner",
    "ExecLimits",
    "FusionP2PError",
    "JobOptions",
    "JobSpec",
    "LimitError",
    "LinkRecord",
    "ModelFamily",
    "ModelRegistry",
    "ModelSpec",
    "OptimizerConfig",
    "PeerConfig",
    "PeerRecord",
    "PeerUnreachableError",
    "Pipeline",
    "ProbeConfig",
    "ProfileError",
    "ProtocolError",
    "RecordError",
    "Swarm",
    "SwarmError",
    "Timeouts",
    "__version__",
]


def __getattr__(name: str) -> object:
    # these pull in hivemind and torch: imported only when asked for
    if name == "Swarm":
        from fusionp2p.swarm import Swarm

        return Swarm
    if name == "DataOwner":
        from fusionp2p.training.data_owner import DataOwner

        return DataOwner
    if name == "Pipeline":
        from fusionp2p.training.pipeline import Pipeline

        return Pipeline
    if name == "JobSpec":
        from fusionp2p.training.job_spec import JobSpec

        return JobSpec
    if name == "JobOptions":
        from fusionp2p.runtime.job_setup import JobOptions

        return JobOptions
    if name in ("ModelFamily", "ModelRegistry"):
        from fusionp2p.opdag import families

        return getattr(families, name)
    raise AttributeError(f"module 'fusionp2p' has no attribute {name!r}")
