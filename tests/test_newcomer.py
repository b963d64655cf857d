"""What a new user meets on the command line: one-line errors that name what is wrong."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest
from process_helpers import hivemind_sockets, litter, run_grouped

from fusionp2p.errors import ConfigError
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.listen import check_listen_addresses
from fusionp2p.net.sockets import remove_stale
from fusionp2p.planning import synthetic_swarm

CLI = [sys.executable, "-m", "fusionp2p", "--log-level", "error"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _tiny_job(tmp_path: Path, name: str, *, steps: int) -> Path:
    """A job file of a 1-layer GPT-2 on a little stdlib text, for 2 local peers."""
    config = tmp_path / "job.toml"
    config.write_text(
        f'name = "{name}"\n[model.config]\nvocab_size = 256\nn_positions = 16\nn_embd = 16\nn_layer = 1\n'
        f"n_head = 2\n[data]\nseq_len = 16\nmax_bytes = 20000\n[train]\nsteps = {steps}\nbatch_size = 2\n"
        f'micro_batch_size = 1\nmin_peers = 2\n[output]\ndir = "{tmp_path / "runs"}"\n'
    )
    return config


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


DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmNreLokPPafd6BNEJzTs2fHVv9j9ycNKvDVv3nVAtRfzF"


@pytest.mark.parametrize("command", ["peer", "status"])
def test_a_failed_start_leaves_nothing_in_the_temp_directory(command: str, tmp_path: Path) -> None:
    before = hivemind_sockets()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done, left = run_grouped([*CLI, command, "--initial-peers", DEAD_PEER], timeout=120, env=env)
    assert "could not start the DHT node" in _one_error_line(done, command)
    assert not left and not litter(tmp_path, before)  # no process, no identity key, no daemon socket


def _ctrl_c_once(args: list[str], shown: str, tmp_path: Path) -> tuple[int, str]:
    """Runs the CLI with ``args``, sends it Ctrl-C's SIGINT once a line holds ``shown``, and
    checks that every process it started ends and nothing is left in its temp directory;
    its exit code and the output after the signal."""
    before = hivemind_sockets()
    command = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        # a background job's shell starts it with SIGINT ignored; a terminal's Ctrl-C is not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert command.stdout is not None
        deadline = time.monotonic() + 180
        lines = []
        while time.monotonic() < deadline:
            line = command.stdout.readline()
            lines.append(line)
            if shown in line or not line:
                break
        assert shown in lines[-1], "".join(lines)
        children = psutil.Process(command.pid).children(recursive=True)
        command.send_signal(signal.SIGINT)  # what Ctrl-C sends the command (its peers get theirs from it)
        rest, _ = command.communicate(timeout=90)
    finally:
        if command.poll() is None:
            command.kill()
            command.communicate()  # reaps it and closes the pipe
        if command.stdout is not None:
            command.stdout.close()
    # every process it started ends; torch's shared-memory helper (a peer's child) exits on
    # its own once its clients are gone, which may be a moment after the peers
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [c for c in alive if _running(c)]
    assert not litter(tmp_path, before)
    return command.returncode, rest


def test_a_local_swarm_stopped_with_ctrl_c_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    code, rest = _ctrl_c_once(
        ["local", "--peers", "2", "--duration", "120"], "keeping the swarm up", tmp_path
    )
    assert code == 130
    assert (
        "interrupted (Ctrl-C)" in rest
        and "stopping the local swarm" in rest
        and "done: every peer left" in rest
    )


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_local_peer_leaves_no_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the peers' temp directory
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's (the swarm's work directory)
    before = hivemind_sockets()
    with LocalSwarm(2, swarm="litter") as local:
        children = psutil.Process(local.peers[1].popen.pid).children(recursive=True)  # its p2pd
        local.signal(1, signal.SIGKILL)
        local.peers[1].popen.wait(10)
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not [c for c in alive if _running(c)]  # its daemon does not outlive it
    assert not litter(tmp_path, before)


def test_the_demo_path_leaves_nothing_in_the_temp_directory(tmp_path: Path) -> None:
    config = _tiny_job(tmp_path, "litter", steps=2)
    before = hivemind_sockets()
    done, left = run_grouped(
        [*CLI, "train", "--local", "2", "--config", str(config), "--no-progress"],
        timeout=240,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained 2 steps" in done.stdout and "no peer process is left" in done.stdout
    assert not left and not litter(tmp_path, before)


def test_a_loopback_peer_says_how_to_open_it_to_other_machines() -> None:
    from fusionp2p.cli import join_hint

    local = join_hint("fusionp2p", ["/ip4/127.0.0.1/tcp/4001/p2p/QmA"])
    assert "loopback only" in local[0] and "--host-maddrs /ip4/0.0.0.0/tcp/PORT" in local[-1]
    public = join_hint("fusionp2p", ["/ip4/127.0.0.1/tcp/4001/p2p/QmA", "/ip4/192.0.2.7/tcp/4001/p2p/QmA"])
    assert public[0] == "To join this swarm from another machine, run:" and "192.0.2.7" in public[1]


def test_ctrl_c_during_train_says_the_run_was_interrupted_and_how_to_resume(tmp_path: Path) -> None:
    config = _tiny_job(tmp_path, "ctrl-c", steps=100_000)
    args = ["train", "--local", "2", "--config", str(config), "--no-progress"]
    code, rest = _ctrl_c_once(args, "[planned]", tmp_path)  # it trains once its plan is printed
    assert code == 130, rest[-2000:]
    assert "fusionp2p train: interrupted." in rest, rest
    assert f"--config {config} --no-progress --resume" in rest, rest  # the same command, to go on


def test_tensorboard_is_an_extra_a_job_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusionp2p.errors import ConfigError
    from fusionp2p.training.job_spec import EXAMPLE_CONFIG, JobSpec
    from fusionp2p.training.trainer import preflight

    assert JobSpec.from_toml(EXAMPLE_CONFIG).tensorboard is False  # off unless asked for
    job = JobSpec.from_toml(EXAMPLE_CONFIG.replace("tensorboard = false", "tensorboard = true"))
    assert job.tensorboard is True
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed (nor is it here)
    with pytest.raises(ConfigError, match=r"pip install 'fusionp2p\[tensorboard\]'"):
        preflight(job)
    with pytest.raises(ConfigError, match="tensorboard: must be true or false"):
        JobSpec.from_toml(EXAMPLE_CONFIG.replace("tensorboard = false", "tensorboard = 1"))


def test_a_killed_peer_without_an_identity_file_leaves_no_key_behind(tmp_path: Path) -> None:
    """Its ephemeral identity lives only while p2pd starts: a SIGKILL later leaves no
    $TMPDIR/fusionp2p-*/identity.key (issue 34, trip 13)."""
    before = hivemind_sockets()
    ready = tmp_path / "ready.json"
    peer = subprocess.Popen(
        [*CLI, "peer", "--swarm", "litter-key", "--ready-file", str(ready), "--flops", "1e9"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert peer.poll() is None and time.monotonic() < deadline, "the peer did not start"
            time.sleep(0.2)
        children = psutil.Process(peer.pid).children(recursive=True)
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("fusionp2p-")]  # gone already
        peer.kill()
        peer.wait(10)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [c for c in alive if _running(c)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fusionp2p-")]
    # a killed process's client socket stays until the next peer's start sweeps it: sweep it now
    remove_stale(hivemind_sockets() - before)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--host-maddrs", "0.0.0.0:31337"],
            "--host-maddrs holds '0.0.0.0:31337', not a multiaddr (did you mean",
        ),
        (["--emulated-speed", "2"], "--emulated-speed must be in (0, 1]"),
        (["--flops", "-1"], "--flops"),
    ],
)
def test_a_bad_peer_flag_is_named_as_the_command_line_spells_it(flags: list[str], says: str) -> None:
    line = _one_error_line(_cli("peer", *flags), "peer")
    assert says in line and "PeerConfig" not in line


def test_a_peer_refuses_a_port_another_peer_listens_on() -> None:
    """p2pd listens with SO_REUSEPORT, so without this check a second peer would share the port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _one_error_line(_cli("peer", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"), "peer")
    assert f"--host-maddrs /ip4/127.0.0.1/tcp/{port}: port {port} is already in use" in line
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as free:  # a port nobody holds passes
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]
    check_listen_addresses([f"/ip4/127.0.0.1/tcp/{free_port}", "/ip4/127.0.0.1/tcp/0"])
    with pytest.raises(ConfigError, match="cannot listen there"):
        check_listen_addresses(["/ip4/203.0.113.9/tcp/31337"])  # not an address of this machine
