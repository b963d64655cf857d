"""Runs a CLI in its own process group and finds what it left running or lying around: checks
that hold while other runs (another test session, a benchmark) start and stop their own
daemons in the same /tmp."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


def in_group(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    out = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
    return out


def wait_group_gone(pgid: int, timeout: float = 10.0) -> list[int]:
    """Waits up to ``timeout`` s for group ``pgid`` to empty; what is still in it."""
    deadline = time.monotonic() + timeout
    while (left := in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def run_grouped(
    command: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Runs ``command`` to completion as the leader of a new process group; its result and
    the processes of that group left running once it exited (its DHT daemon, say)."""
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    left = wait_group_gone(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a test that fails on leftovers leaves none behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), left


HIVEMIND_SOCKETS = Path("/tmp")  # hivemind puts its daemon sockets here, whatever TMPDIR says


def hivemind_sockets() -> set[Path]:
    """The hivemind daemon and client sockets in /tmp now."""
    names = ("hivemind-p2pd-", "hivemind-p2pclient-")
    return {p for p in HIVEMIND_SOCKETS.iterdir() if p.name.startswith(names)}


def litter(tmpdir: Path, sockets_before: set[Path]) -> set[str]:
    """What a run given ``TMPDIR=tmpdir`` left behind: fusionp2p's work directories there,
    and hivemind sockets that appeared in /tmp since ``sockets_before`` and no live process
    is bound to (another run's live daemon is not this run's litter)."""
    bound = {c.laddr for c in psutil.net_connections(kind="unix") if c.laddr}
    stray = {str(p) for p in hivemind_sockets() - sockets_before if str(p) not in bound}
    return stray | {str(p) for p in tmpdir.iterdir() if p.name.startswith("fusionp2p-")}
