"""The emulated WAN testbed (benchmarks/testbed): topology checks, shaped rates, teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.testbed import netns
from benchmarks.testbed.rate import tcp_rate_mbps
from benchmarks.testbed.topology import TestbedTopology as Topology
from benchmarks.testbed.topology import TopologyError, load_topology

PREFIX = netns.PREFIX

TWO = {
    "name": "two",
    "host_mbps": 1000,
    "cluster": [{"name": "a", "hosts": 2}, {"name": "b", "hosts": 1, "slowdown": 0.5}],
    "wan": [{"between": ["a", "b"], "mbps": 50, "reverse_mbps": 20}],
}


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def test_topology_reads_per_direction_rates(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        'name = "x"\n[[cluster]]\nname = "a"\nhosts = 2\n[[cluster]]\nname = "b"\nhosts = 1\n'
        '[[wan]]\nbetween = ["a", "b"]\nmbps = 100\nreverse_mbps = 8\n'
    )
    topo = load_topology(path)
    assert (topo.rate("a", "b"), topo.rate("b", "a")) == (100.0, 8.0)
    assert topo.n_hosts == 3 and topo.cluster("a").host_mbps == 1000.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"wan": []}, "clusters a and b have no link"),
        ({"cluster": [{"name": "a", "hosts": 2}]}, "needs 2 to 8 clusters"),
        ({"cluster": [{"name": "a", "hosts": 0}, {"name": "b", "hosts": 1}]}, "[[cluster]] 1 hosts"),
        ({"wan": [{"between": ["a", "c"], "mbps": 5}]}, "no cluster named 'c'"),
        ({"wan": [{"between": ["a", "b"], "mbps": -5}]}, "[[wan]] 1 mbps: must be in"),
        ({"wan": [{"between": ["a", "b"], "mbps": 5, "delay_ms": 20}]}, "delay is not emulated"),
        ({"speed": 3}, "speed: unknown key"),
        ({"cluster": [{"name": "a", "hosts": 1, "slowdown": 2}, {"name": "b", "hosts": 1}]}, "slowdown"),
    ],
)
def test_a_bad_topology_is_refused_before_anything_is_made(change: dict, message: str) -> None:
    before = _ours()
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Topology.from_dict({**TWO, **change})
    assert _ours() == before


def test_a_shaped_link_runs_at_its_rate_each_way_and_everything_is_torn_down() -> None:
    topo = Topology.from_dict(TWO)
    with netns.Testbed(topo) as testbed:
        (a0, a1), (b0,) = testbed.hosts_of("a"), testbed.hosts_of("b")
        assert len(_ours()) == 5  # 2 routers + 3 hosts
        forward = tcp_rate_mbps(a0, b0)
        backward = tcp_rate_mbps(b0, a1)
        assert forward == pytest.approx(50, rel=0.15), forward
        assert backward == pytest.approx(20, rel=0.15), backward
    assert _ours() == []


def test_a_failure_inside_the_block_tears_down() -> None:
    with pytest.raises(netns.TestbedError, match="boom"), netns.Testbed(Topology.from_dict(TWO)):
        assert len(_ours()) == 5
        raise netns.TestbedError("boom")
    assert _ours() == []


def test_sigterm_tears_down(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from benchmarks.testbed.netns import Testbed\n"
        "from benchmarks.testbed.topology import TestbedTopology\n"
        f"with Testbed(TestbedTopology.from_dict({TWO!r})):\n"
        "    print('built', flush=True)\n"
        "    time.sleep(60)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "built"
            assert len(_ours()) == 5
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    assert _ours() == []


def test_a_dead_testbeds_namespaces_are_removed_by_the_next() -> None:
    script = (
        "import os\n"
        "from benchmarks.testbed.netns import Testbed\n"
        "from benchmarks.testbed.topology import TestbedTopology\n"
        f"Testbed(TestbedTopology.from_dict({TWO!r})).build()\n"
        "os._exit(0)\n"  # no atexit, no teardown: as after SIGKILL
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert len(_ours()) == 5
    deadline = time.monotonic() + 5
    with netns.Testbed(Topology.from_dict(TWO)):
        assert len(_ours()) == 5  # the dead one's five are gone, ours are here
        assert time.monotonic() < deadline + 60
    assert _ours() == []


def test_the_wan_benchmark_refuses_a_bad_topology_before_building(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[cluster]]\nname = "a"\nhosts = 2\n[[cluster]]\nname = "b"\nhosts = 2\n')
    before = _ours()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.wan", "--topology", str(bad), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "clusters a and b have no link" in done.stderr and done.stderr.count("\n") == 1
    assert _ours() == before and not list(tmp_path.glob("wan*"))


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One device-profile cache for the dry runs: the first measures the emulated speeds
    (about 40 s here), the second reads them."""
    return str(tmp_path_factory.mktemp("wan-cache"))


def test_the_wan_dry_run_plans_every_cell_on_the_nominal_rates(tmp_path: Path, profile_cache: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.wan", "--dry-run", "--orders", "12", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FUSIONP2P_CACHE": profile_cache},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "wan-dry-run.json").read_text())["nominal"]
    assert [(r["planner"], r["compression"]) for r in rows][:2] == [
        ("equal-number", "none"),
        ("equal-number", "uniform"),
    ]
    assert len(rows) == 12 and all(r["estimate_s"] > 0 for r in rows)
    by = {(r["planner"], r["compression"]): r for r in rows}
    # OP-Fence keeps the model off the slow links: never slower than a baseline with the same policy
    for policy in ("none", "uniform", "adaptive", "planned"):
        assert by["op-fence", policy]["estimate_s"] <= by["equal-number", policy]["estimate_s"]
    assert set(by["op-fence", "planned"]["clusters"]) == {"a"}  # the fast, well-connected site
    # the baselines' PeerID order is a draw; OP-Fence beats every draw
    spread = json.loads((tmp_path / "wan-dry-run.json").read_text())["order_spread"]
    assert len(spread["equal-number/none"]) == spread["orders"] == 12
    assert max(spread["op-fence/planned"]) < min(spread["equal-number/none"])
    assert _ours() == []


def test_the_wan_matrix_also_plans_a_resnet18_on_the_digits(tmp_path: Path, profile_cache: str) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.wan", "--model", "resnet18", "--dry-run"),
            *("--orders", "4", "--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FUSIONP2P_CACHE": profile_cache},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "wan-resnet18-dry-run.json").read_text())
    assert result["job"]["model"] == "resnet18" and len(result["nominal"]) == 12
    assert "ResNet-18" in (tmp_path / "wan-resnet18-dry-run.md").read_text()
    by = {(r["planner"], r["compression"]): r["estimate_s"] for r in result["nominal"]}
    assert by["op-fence", "none"] <= by["equal-number", "none"]
