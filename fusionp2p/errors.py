"""The one exception tree of fusionp2p.

FusionP2PError
├── ConfigError            a config value is invalid (bad CLI flag, bad dataclass field)
├── RecordError            a wire record is malformed, oversized or from a newer major version
├── ProtocolError          a peer sent bytes that break a stream protocol (size, order, kind)
├── LimitError             a request needs more than this peer allows (memory, jobs, bytes)
├── PeerUnreachableError   a remote call or stream to a peer failed or passed its deadline
│   └── DeadlineError      ... passed its deadline (nothing arrived in time)
├── SwarmError             joining, reading or leaving the swarm failed
│   └── CoordinatorError   no coordinator, or it refused or could not plan a job
└── ProfileError           measuring this device failed
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CoordinatorError",
    "DeadlineError",
    "FusionP2PError",
    "LimitError",
    "PeerUnreachableError",
    "ProfileError",
    "ProtocolError",
    "RecordError",
    "ReplicasDiverged",
    "SwarmError",
]


class FusionP2PError(Exception):
    """Root of every error fusionp2p raises on purpose."""


class ConfigError(FusionP2PError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class RecordError(FusionP2PError, ValueError):
    """A wire record (DHT value, OpData header) is malformed, oversized or unsupported."""


class ProtocolError(FusionP2PError):
    """A peer broke a stream protocol: wrong frame kind, oversized frame, bad order."""


class ReplicasDiverged(ProtocolError):
    """Data-parallel replicas of a job hold different parameters for one stage."""


class LimitError(FusionP2PError):
    """A request needs more than this peer allows; the message says how much of what, and the limit."""


class PeerUnreachableError(FusionP2PError):
    """A remote peer did not answer in time or its stream broke."""


class DeadlineError(PeerUnreachableError):
    """Nothing arrived from a peer within a deadline (the stream itself may still be open)."""


class SwarmError(FusionP2PError):
    """Joining, reading or leaving the swarm failed."""


class IncompleteReadError(SwarmError):
    """Directory keys that could not be read in time, even after a retry; ``keys`` names them."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(
            f"{len(keys)} directory key(s) could not be read in time, even after a retry: "
            f"{', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        )
        self.keys = keys


class CoordinatorError(SwarmError):
    """No peer holds the coordinator lease, or the coordinator refused or failed a job."""


class ProfileError(FusionP2PError):
    """Measuring this device's compute or memory failed."""
