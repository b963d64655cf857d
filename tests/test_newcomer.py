"""What a new user meets on the command line: one-line errors that name what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from fusionp2p.planning import synthetic_swarm


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusionp2p", "--log-level", "error", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_error_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"fusionp2p {command}: error: "), done.stderr
    return lines[0]


@pytest.fixture
def swarm_file(tmp_path: Path) -> Path:
    peers, links, _ = synthetic_swarm(5, n_peers=6)
    path = tmp_path / "swarm.json"
    path.write_text(json.dumps({"peers": [asdict(p) for p in peers], "links": [asdict(lk) for lk in links]}))
    return path


def test_help_describes_the_tool_not_its_code() -> None:
    done = _cli("--help")
    assert done.returncode == 0 and "train one model on many peers" in done.stdout
    assert "thin CLI" not in done.stdout


def test_an_unknown_flag_gets_the_subcommands_usage() -> None:
    done = _cli("peer", "--bogus-flag")
    assert done.returncode == 2
    assert "usage: fusionp2p peer" in done.stderr and "unrecognized arguments: --bogus-flag" in done.stderr


def test_plan_checks_the_png_path_before_planning(swarm_file: Path) -> None:
    done = _cli("plan", "--swarm-file", str(swarm_file), "--png", "/nonexistent/dir/x.png")
    line = _one_error_line(done, "plan")
    assert "--png: cannot write into /nonexistent/dir" in line and done.stdout == ""


def test_plan_refuses_an_unknown_model_config_key_naming_the_known(swarm_file: Path) -> None:
    done = _cli("plan", "--swarm-file", str(swarm_file), "--model-config", '{"nonsense_key": 3}')
    line = _one_error_line(done, "plan")
    assert "no config key 'nonsense_key'" in line and "n_layer" in line


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"links": []}, "needs a 'peers' list"),
        ({"peers": [1]}, "peers[0] is not a valid record"),
        ({"peers": [{"peer_id": "x"}]}, "peers[0] is not a valid record"),
        ({"peers": [], "links": {}}, "'links' must be a list"),
    ],
)
def test_a_swarm_file_of_the_wrong_shape_names_the_field(tmp_path: Path, doc: dict, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert says in _one_error_line(_cli("plan", "--swarm-file", str(path)), "plan")


@pytest.mark.parametrize(
    ("command", "maddr", "says"),
    [
        ("status", "garbage", "'garbage' is not a peer multiaddr"),
        ("status", "/ip4/999.1.1.1/tcp/1/p2p/QmTzQ1JRkWErjk39mryYw2WVaphAZNAREyMchXzYQ7c15n", "is not IPv4"),
        ("peer", "/ip4/127.0.0.1/tcp/1", "names no peer (/p2p/<PeerID>)"),
    ],
)
def test_initial_peers_are_checked_before_anything_starts(command: str, maddr: str, says: str) -> None:
    line = _one_error_line(_cli(command, "--initial-peers", maddr), command)
    assert "--initial-peers: " in line and says in line
