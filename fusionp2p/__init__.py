"""fusionp2p: decentralized training of one model over many peers (after FusionLLM).

- ``errors.py``: the FusionP2PError tree.
- ``config.py``: PeerConfig, ProbeConfig, Timeouts, ExecLimits, OptimizerConfig.
- ``records/``: versioned wire records: PeerRecord, LinkRecord, PlanStageRecord and the
  rest of the DHT's (``swarm.py``); TopKHeader, OpData and ExecControl for the exec protocol
  (``tensors.py``); their shared msgpack form (``wire.py``).
- ``net/``: identity, DHT directory and validators, frame streams, transports, probes.
- ``runtime/``: device profiling; executors (remote autodiff), the exec protocol and who
  may use it, stage memory needs, the data owner's pipeline driver.
- ``opdag/``: the OP-DAG IR, analytic transformer OP-DAGs, tracing, model families and
  specs (a peer builds only families its operator installed), splitting.
- ``planning/``: cost model, estimators, clustering, OP-Fence, baselines, exact solver, Plan.
- ``compression/``: Top-K selection, wire format, error feedback (CUDA kernels in ``kernels/``).
- ``peer.py``: the long-running Peer.
- ``swarm.py``: the public Swarm facade; ``pipeline.py``: its training Pipeline.
- ``launch.py``: LocalSwarm, several peer processes on this machine.
- ``viz.py``: a picture of a plan on the clustered bandwidth graph.
- ``cli.py``: ``fusionp2p peer | status | plan | local | train`` (``cli_swarm.py``,
  ``cli_jobs.py``).
"""

__version__ = "0.1.0"

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
from fusionp2p.records import LinkRecord, PeerRecord

__all__ = [
    "DEFAULT_SWARM",
    "ConfigError",
    "ExecLimits",
    "FusionP2PError",
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
    # these pull in hivemind and torch; import them only when asked for
    if name in ("Swarm", "Pipeline"):
        from fusionp2p import swarm

        return getattr(swarm, name)
    if name == "ModelSpec":
        from fusionp2p.opdag.spec import ModelSpec

        return ModelSpec
    if name in ("ModelFamily", "ModelRegistry"):
        from fusionp2p.opdag import families

        return getattr(families, name)
    raise AttributeError(f"module 'fusionp2p' has no attribute {name!r}")
