"""fusionp2p: decentralized training of one model over many peers (after FusionLLM).

The public API is below (``__all__``): ``Swarm`` reads a swarm, ``DataOwner`` trains a
``JobSpec`` on it, ``PeerConfig`` runs a peer. The subpackages and the layers they form
(each importing only from those below it) are drawn in ``docs/architecture.md``; each
subpackage's ``__init__`` maps its own files.
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
