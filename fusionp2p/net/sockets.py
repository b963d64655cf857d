"""hivemind's unix sockets in ``/tmp``: which belong to a daemon, and removing dead ones.

Each hivemind ``P2P`` makes two sockets, ``/tmp/hivemind-p2pd-<id>.sock`` (its p2pd
listens) and ``/tmp/hivemind-p2pclient-<id>.sock`` (the Python side listens). Each
``P2P.replicate`` (a peer's main process talking to its DHT process's daemon) adds
another client socket. A process that is SIGKILLed, or a daemon that fails to start,
leaves them behind. A socket is
removed here only when nothing listens on it any more (a connect is refused), so a live
peer's sockets are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil

__all__ = ["daemon_sockets", "hivemind_sockets", "listening_sockets", "remove_stale"]

logger = logging.getLogger(__name__)

SOCKET_DIR = Path("/tmp")  # hivemind's fixed prefix: /unix/tmp/hivemind-
_NAME_RE = re.compile(r"^hivemind-p2p(?:d|client)-[\w-]+\.sock$")
_ARG_RE = re.compile(r"/unix(/tmp/hivemind-p2pd-[\w-]+\.sock)")


def daemon_sockets(cmdline: Sequence[str]) -> set[Path]:
    """The two sockets of the p2pd started with ``cmdline`` (its ``-listen`` argument)."""
    out: set[Path] = set()
    for arg in cmdline:
        for match in _ARG_RE.finditer(arg):
            daemon = Path(match.group(1))
            out |= {daemon, daemon.with_name(daemon.name.replace("hivemind-p2pd-", "hivemind-p2pclient-"))}
    return out


def listening_sockets(process: psutil.Process) -> set[Path]:
    """The hivemind sockets ``process`` has open (a peer's own client socket, which its
    daemon's command line does not name: each ``P2P.replicate`` makes another)."""
    with contextlib.suppress(psutil.Error):
        return {
            Path(c.laddr)
            for c in process.net_connections(kind="unix")
            if isinstance(c.laddr, str) and _NAME_RE.match(Path(c.laddr).name)
        }
    return set()


def hivemind_sockets() -> set[Path]:
    """Every hivemind socket file in the socket directory now."""
    with contextlib.suppress(OSError):
        return {p for p in SOCKET_DIR.iterdir() if _NAME_RE.match(p.name)}
    return set()


def _listened(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(0.5)
    try:
        sock.connect(str(path))
        return True
    except OSError as e:
        return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)  # anything else: assume in use
    finally:
        sock.close()


def remove_stale(paths: Iterable[Path], *, min_age_s: float = 0.0) -> int:
    """Removes those of ``paths`` that are sockets nobody listens on (and at least
    ``min_age_s`` old, so one being set up is left alone); how many went."""
    removed = 0
    now = time.time()
    for path in paths:
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISSOCK(info.st_mode) or now - info.st_mtime < min_age_s or _listened(path):
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    if removed:
        logger.info("removed %d dead hivemind socket(s) from %s", removed, SOCKET_DIR)
    return removed
