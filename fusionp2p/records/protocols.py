"""The stream protocols peers speak, all named ``/fusionp2p/<name>/<major>``.

A protocol's major version changes only when its messages change in a way an older peer
would misread; then the two simply do not speak (libp2p refuses the unknown protocol)
instead of exchanging bytes neither understands.
"""

from __future__ import annotations

__all__ = ["COORD_PROTOCOL", "EXEC_PROTOCOL", "PROBE_PROTOCOL", "protocol_id"]


def protocol_id(name: str, major: int) -> str:
    """The libp2p protocol id of ``name`` at ``major``: ``/fusionp2p/exec/3``."""
    return f"/fusionp2p/{name}/{major}"


EXEC_PROTOCOL = protocol_id("exec", 3)  # 3: JobSetup is a msgpack record (it was JSON)
COORD_PROTOCOL = protocol_id("coord", 2)  # 2: JobRequest and JobReply are msgpack records
PROBE_PROTOCOL = protocol_id("probe", 1)
