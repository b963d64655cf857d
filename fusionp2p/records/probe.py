"""The probe protocol's messages: what a prober sends a peer to measure the link to it.

On ``PROBE_PROTOCOL``, one probe per stream, prober -> server:

    PING(nonce) ... -> PONG(nonce)     tiny round trips; the RTT is their median
    DATA ... END    -> ACK(PROBE_ACK)  a bounded payload; the ACK counts the bytes received

A nonce is at most ``MAX_PING_PAYLOAD`` bytes and a DATA frame at most ``PROBE_FRAME_BYTES``;
a server takes at most its ``ProbeConfig.max_bytes`` of DATA in all.
"""

from __future__ import annotations

import struct

__all__ = ["MAX_PING_PAYLOAD", "PROBE_ACK", "PROBE_FRAME_BYTES", "PROBE_NONCE"]

PROBE_FRAME_BYTES = 256 << 10  # one DATA frame of a probe's payload
MAX_PING_PAYLOAD = 64
PROBE_NONCE = struct.Struct("!I")  # the prober's PING payload: the round trip's number
PROBE_ACK = struct.Struct("!Q")  # the server's ACK payload: DATA bytes it received
