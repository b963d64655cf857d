"""The version of fusionp2p, what a peer publishes in its record (``PeerRecord.fusionp2p_version``)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
