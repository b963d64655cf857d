"""Measures a testbed path's TCP rate: one bulk flow between two hosts' namespaces."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.testbed.netns import Host, TestbedError

__all__ = ["tcp_rate_mbps"]

_RECEIVER = """
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(30)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(30)
total, marks = 0, []
while chunk := conn.recv(1 << 16):
    total += len(chunk)
    marks.append((time.perf_counter(), total))
skip = marks[0][0] + float(sys.argv[3])  # slow start and the shaper's first burst
steady = [m for m in marks if m[0] >= skip]
(t0, b0), (t1, b1) = steady[0], steady[-1]
print(json.dumps({"bytes": b1 - b0, "seconds": t1 - t0}), flush=True)
"""

_SENDER = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
block, end = bytes(1 << 16), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    sock.sendall(block)
sock.close()
"""


def tcp_rate_mbps(
    src: Host, dst: Host, *, seconds: float = 3.0, skip_s: float = 0.5, port: int = 5201
) -> float:
    """The steady rate (Mbit/s) of one TCP flow from ``src`` to ``dst`` over ``seconds``.

    Raises:
        TestbedError: either end failed or hung.
    """
    receiver = subprocess.Popen(
        dst.wrap([sys.executable, "-c", _RECEIVER, dst.ip, str(port), str(skip_s)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise TestbedError(f"the receiver on {dst.name} did not start: {receiver.stderr.read()[:300]}")  # type: ignore[union-attr]
        began = time.monotonic()
        sender = subprocess.run(
            src.wrap([sys.executable, "-c", _SENDER, dst.ip, str(port), str(seconds)]),
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        if sender.returncode:
            raise TestbedError(f"the sender on {src.name} failed: {sender.stderr.strip()[-300:]}")
        out, err = receiver.communicate(timeout=max(5.0, seconds + 30 - (time.monotonic() - began)))
        if receiver.returncode:
            raise TestbedError(f"the receiver on {dst.name} failed: {err.strip()[-300:]}")
        result = json.loads(out.strip().splitlines()[-1])
        return result["bytes"] * 8 / result["seconds"] / 1e6
    except subprocess.TimeoutExpired as e:
        raise TestbedError(f"measuring {src.name} -> {dst.name} hung: {e}") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(5)
