"""Whether this machine can listen where a peer is told to, before p2pd starts.

go-libp2p listens with ``SO_REUSEPORT``, so a second p2pd on a port another peer already
holds starts without an error and the two share the port's connections. A plain bind
without that option fails on a port anyone listens on, which is the check made here.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from fusionp2p.errors import ConfigError

__all__ = ["check_listen_addresses"]

_FAMILIES = {"ip4": socket.AF_INET, "ip6": socket.AF_INET6}


def _bind_error(family: int, host: str, port: int) -> OSError | None:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            return e
    return None


def check_listen_addresses(maddrs: Sequence[str], *, what: str = "PeerConfig.host_maddrs") -> None:
    """Raises ConfigError if a ``/ip4|ip6/HOST/tcp/PORT`` address of ``maddrs`` with a fixed
    port is in use on this machine, or names an address this machine does not have.

    Port 0 (any free port) and other transports are left to p2pd.
    """
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in _FAMILIES or parts[2] != "tcp" or not parts[3].isdigit():
            continue
        port = int(parts[3])
        if port == 0:
            continue
        error = _bind_error(_FAMILIES[parts[0]], parts[1], port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{what} {maddr}: port {port} is already in use on this machine (another peer?); "
                "pick a free port, or 0 for any"
            )
        raise ConfigError(f"{what} {maddr}: cannot listen there: {error.strerror or error}")
