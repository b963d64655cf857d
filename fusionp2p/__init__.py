"""fusionp2p: decentralized training of one model over many peers (after FusionLLM).

- ``errors.py``: the FusionP2PError tree.
- ``config.py``: PeerConfig, ProbeConfig, Timeouts.
- ``records.py``: PeerRecord, LinkRecord: versioned wire records for the DHT.
- ``net/``: identity, DHT directory and validators, frame streams, transports, probes.
- ``runtime/``: device profiling.
- ``opdag/``: the OP-DAG IR and analytic transformer OP-DAGs.
- ``planning/``: cost model, estimators, clustering, OP-Fence, baselines, exact solver, Plan.
- ``compression/``: Top-K selection, wire format, error feedback (CUDA kernels in ``kernels``).
- ``peer.py``: the long-running Peer.
- ``swarm.py``: the public Swarm facade.
- ``launch.py``: LocalSwarm, several peer processes on this machine.
- ``viz.py``: a picture of a plan on the clustered bandwidth graph.
- ``cli.py``: ``fusionp2p peer | status | plan | local``.
"""

__version__ = "0.1.0"

from fusionp2p.config import DEFAULT_SWARM, PeerConfig, ProbeConfig, Timeouts
from fusionp2p.errors import (
    ConfigError,
    FusionP2PError,
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
    "FusionP2PError",
    "LinkRecord",
    "PeerConfig",
    "PeerRecord",
    "PeerUnreachableError",
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
    # Swarm pulls in hivemind and torch; import it only when asked for
    if name == "Swarm":
        from fusionp2p.swarm import Swarm

        return Swarm
    raise AttributeError(f"module 'fusionp2p' has no attribute {name!r}")
