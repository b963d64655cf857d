"""Shared fixtures: a real multi-process swarm, and a guard that no child process outlives a test."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

# files whose tests start peers, swarms or other processes (most of the suite's minutes):
# `make test-fast` leaves them out, and the in-process tests marked `slow` (pytest -m "not
# swarm and not slow"); `make test` runs everything
SWARM_MODULES = frozenset(
    {
        "test_coordinator.py",
        "test_demo_digits.py",
        "test_fault_tolerance.py",
        "test_flow_control.py",
        "test_large_model.py",
        "test_lying_coordinator.py",
        "test_newcomer.py",
        "test_plan_pipeline.py",
        "test_probe_latency.py",
        "test_remote_autodiff.py",
        "test_scale_sim.py",
        "test_security.py",
        "test_swarm_integration.py",
        "test_testbed.py",
        "test_wheel.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SWARM_MODULES:
            item.add_marker(pytest.mark.swarm)


def wait_until(
    condition: Callable[[], object], timeout: float, interval: float = 0.5, message: str = "condition"
) -> object:
    """Polls ``condition`` until it returns something truthy; fails the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"{message} not reached within {timeout} s (last value: {last!r})")


def _multiprocessing_helper(process: psutil.Process) -> bool:
    """The fork server the coordinator traces in (and multiprocessing's resource tracker):
    they read a pipe from this process and exit when it does."""
    command = " ".join(process.cmdline())
    return "from multiprocessing.forkserver import main" in command or (
        "from multiprocessing.resource_tracker import main" in command
    )


@pytest.fixture(scope="session", autouse=True)
def no_leftover_children() -> Iterator[None]:
    """Ends (and reports) any child process a test left running, e.g. an orphaned p2pd."""
    yield
    me = psutil.Process(os.getpid())
    leftovers = []
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() == "torch_shm_manager" or _multiprocessing_helper(child):
                continue  # helpers of torch / multiprocessing that end with this process
            leftovers.append(f"{child.pid} {child.name()}")
            child.kill()
    assert not leftovers, f"tests left processes behind: {leftovers}"


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSIONP2P_CACHE", str(tmp_path_factory.getbasetemp() / "profile-cache"))
