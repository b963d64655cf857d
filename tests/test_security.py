"""A peer faces strangers: real `fusionp2p peer` processes, attacked over libp2p from this process.

Two identities live here: the owner (a data owner running a legitimate job) and a
stranger who can reach the peers but was never given anything. The stranger tries what
docs/security.md says must fail: run code, take over or disturb a running job, make a
peer allocate what it cannot hold, crash it with malformed input.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import hivemind
import psutil
import pytest
import torch
from exec_helpers import Identities, fake_setups, first_forward, stranger_setup, user_model_swarm
from fuzz_frames import FrameFuzzer
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from user_models import SkipNet

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import PeerUnreachableError, ProtocolError
from fusionp2p.launch import LocalSwarm, PeerProcess
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.identity import load_signing_key
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.spec import build_model
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import EXEC_PROTOCOL, PROBE_PROTOCOL, ExecControl, ModelSpec
from fusionp2p.runtime.codec import ExecClient
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.swarm import Swarm

SKIPNET = ModelSpec("user_models:SkipNet", {"hidden": 16}, input_shape=(4, 12), input_dtype="float32", seed=9)
LOCAL = ModelRegistry(allow=["user_models:SkipNet"])
OPT = OptimizerConfig(lr=1e-2, eps=1e-6)
N_MB = 2


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("sec"))
    with user_model_swarm(2, swarm="sec", workdir=workdir, peer_args=["--max-memory", "1GiB"]) as s:
        yield s


class Net(Identities):
    """This process's two identities: the owner of a legitimate job, and a stranger."""

    def __init__(self, swarm: LocalSwarm) -> None:
        super().__init__(swarm.initial_peers, 2)
        self.owner_p2p, self.stranger_p2p = self.p2ps
        self.owner, self.stranger = self.transports


@pytest.fixture(scope="module")
def net(swarm: LocalSwarm) -> Iterator[Net]:
    n = Net(swarm)
    yield n
    n.close()


def _batches(iteration: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + iteration)
    return [(torch.randn(4, 12, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(N_MB)]


def _reference(iterations: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    model = build_model(SKIPNET, LOCAL)
    assert isinstance(model, SkipNet)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    losses = []
    for it in range(iterations):
        opt.zero_grad()
        step = []
        for x, y in _batches(it):
            loss = LOSSES["classification"]([model(x)], y)
            step.append(loss.item())
            (loss / N_MB).backward()
        losses.append(step)
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


async def _job(
    net: Net, peer: PeerProcess, spec: ModelSpec = SKIPNET, loss: str = "classification"
) -> PipelineDriver:
    return await PipelineDriver.create(
        net.owner,
        spec,
        RuntimeLayout((net.owner.peer_id, peer.peer_id)),
        JobOptions(n_micro_batches=N_MB, optimizer=OPT, loss=loss, timeout=60),
        addresses={peer.peer_id: peer.multiaddrs},
        registry=LOCAL,
    )


def _setup(family: str, config: dict, stranger: str, peer: PeerProcess, job: str = "evil") -> bytes:
    return stranger_setup(family, config, stranger, peer.peer_id, job=job)


async def _ask(client: ExecClient, header: ExecControl, body: bytes = b"") -> str:
    """The peer's refusal (the test fails if it accepts)."""
    with pytest.raises(ProtocolError) as refused:
        await client.request(header, body)
    return str(refused.value)


def _rss(peer: PeerProcess) -> tuple[int, int]:
    """(current, peak) resident bytes of the peer process."""
    status = Path(f"/proc/{peer.popen.pid}/status").read_text()
    peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))
    return psutil.Process(peer.popen.pid).memory_info().rss, peak


def test_a_setup_naming_os_system_runs_nothing(net: Net, swarm: LocalSwarm, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    peer = swarm.peers[0]
    attempts = [
        ("os:system", {"command": f"touch {target}"}),
        ("subprocess:check_call", {"args": ["touch", str(target)]}),
        ("builtins:exec", {"source": f"open({str(target)!r}, 'w')"}),
        ("gpt2", {"command": f"touch {target}"}),
    ]

    async def main() -> list[str]:
        client = ExecClient(net.stranger, peer.peer_id, timeout=30)
        try:
            replies = []
            for family, config in attempts:
                body = _setup(family, config, net.stranger.peer_id, peer)
                replies.append(
                    await _ask(client, ExecControl(command="setup", job="evil", body_bytes=len(body)), body)
                )
            return replies
        finally:
            await client.aclose()

    replies = net.run(main())
    assert "model family 'os:system' is not served" in replies[0] and "--allow-model os:system" in replies[0]
    assert "'subprocess:check_call' is not served" in replies[1]
    assert "'builtins:exec' is not served" in replies[2]
    assert "no config key 'command'" in replies[3] and "known keys" in replies[3]
    assert not target.exists()
    assert "os:system" in peer.log()  # the refusal is in the peer's log


def test_a_running_job_belongs_to_its_owner(net: Net, swarm: LocalSwarm) -> None:
    peer = swarm.peers[0]
    ref_losses, ref_params = _reference(2)

    async def main() -> tuple[list[list[float]], dict[str, torch.Tensor], list[str]]:
        driver = await _job(net, peer)
        stranger = ExecClient(net.stranger, peer.peer_id, timeout=30)
        refusals = []
        try:
            losses = [await driver.run_iteration(_batches(0))]
            job = driver.job
            body = _setup("user_models:SkipNet", {}, net.stranger.peer_id, peer, job="other")
            refusals.append(
                await _ask(stranger, ExecControl(command="setup", job="other", body_bytes=len(body)), body)
            )
            body = _setup("user_models:SkipNet", {}, net.stranger.peer_id, peer, job=job)
            refusals.append(
                await _ask(stranger, ExecControl(command="setup", job=job, body_bytes=len(body)), body)
            )
            for command in ("step", "teardown", "fetch"):
                refusals.append(await _ask(stranger, ExecControl(command=command, job=job, what="params")))
            refusals.append(
                await _ask(stranger, ExecControl(command="weights", job=job, body_bytes=8), bytes(8))
            )
            forged = first_forward(driver.partition, job)  # what stage 0 sends, from the wrong peer
            refusals.append(await _ask(stranger, forged, bytes(forged.body_bytes)))  # type: ignore[arg-type]
            await driver.step()
            losses.append(await driver.run_iteration(_batches(1)))
            await driver.step()
            return losses, await driver.fetch("params"), refusals
        finally:
            await stranger.aclose()
            await driver.aclose()

    losses, params, refusals = net.run(main())
    assert "busy" in refusals[0] and "--max-jobs is 1" in refusals[0]
    assert "already set up" in refusals[1]
    assert all("only the peer that set job" in r for r in refusals[2:6]), refusals[2:6]
    assert "runs no stage 0" in refusals[6]
    for got, want in zip(losses, ref_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-6)


def test_a_model_over_max_memory_is_refused_before_allocation(net: Net, swarm: LocalSwarm) -> None:
    peer = swarm.peers[1]
    small = ModelSpec("gpt2", {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 50}, input_shape=(2, 8))
    huge = ModelSpec(
        "gpt2", {"n_layer": 8, "n_embd": 4096, "n_head": 16, "vocab_size": 50257}, input_shape=(2, 8)
    )

    async def warm_up() -> None:  # the first gpt2 setup imports transformers on the peer
        driver = await _job(net, peer, small, loss="lm")
        await driver.aclose()

    # what a data owner would send for the huge model (traced fake here too: 7.6 GiB never exist)
    peers = [(net.owner.peer_id, []), (peer.peer_id, peer.multiaddrs)]
    body = fake_setups(huge, peers, job="huge", n_micro_batches=2)[1].to_wire()

    async def setup_huge() -> str:
        client = ExecClient(net.owner, peer.peer_id, timeout=60)
        try:
            return await _ask(client, ExecControl(command="setup", job="huge", body_bytes=len(body)), body)
        finally:
            await client.aclose()

    net.run(warm_up())
    before, peak_before = _rss(peer)
    message = net.run(setup_huge())
    after, peak_after = _rss(peer)
    assert "needs" in message and "more than the 1.0 GiB this peer allows (--max-memory)" in message
    assert "stage state" in message and "activations" in message  # says what the need is made of
    assert peak_after - peak_before < 50 << 20, (peak_before, peak_after)
    assert after - before < 50 << 20
    driver = net.run(_job(net, peer))  # and it still takes a job that fits
    net.run(driver.aclose())


def test_a_private_peer_takes_jobs_only_from_its_list(net: Net, swarm: LocalSwarm) -> None:
    private = swarm.add_peer(
        ["--accept-jobs-from", net.owner.peer_id, "--probe-period", "30", "--no-coordinator"]
    )

    async def main() -> str:
        client = ExecClient(net.stranger, private.peer_id, timeout=30)
        await net.stranger.connect(private.peer_id, private.multiaddrs, timeout=30)
        try:
            body = _setup("user_models:SkipNet", {}, net.stranger.peer_id, private)
            refusal = await _ask(client, ExecControl(command="setup", job="evil", body_bytes=len(body)), body)
        finally:
            await client.aclose()
        driver = await _job(net, private)
        await driver.aclose()
        return refusal

    assert "--accept-jobs-from" in net.run(main())


def test_fuzzed_frames_leave_the_peer_serving(net: Net, swarm: LocalSwarm) -> None:
    """500 random and mutated frames to every protocol the peer serves; then a real job."""
    peer = swarm.peers[0]
    fuzzer = FrameFuzzer(random.Random(1234), stranger=net.stranger.peer_id, target=peer.peer_id)
    before, _ = _rss(peer)

    async def attack(payloads: list[tuple[str, bytes]]) -> dict[str, int]:
        outcomes = {"error": 0, "ack": 0, "closed": 0}

        async def one(protocol: str, data: bytes) -> None:
            if protocol.startswith("DHTProtocol."):
                try:
                    await asyncio.wait_for(
                        net.stranger_p2p._client.call_unary_handler(
                            PeerID.from_base58(peer.peer_id), protocol, data
                        ),
                        5,
                    )
                except Exception:
                    outcomes["error"] += 1
                else:
                    outcomes["ack"] += 1
                return
            try:
                stream = await net.stranger.open(peer.peer_id, protocol, timeout=10)
            except PeerUnreachableError:
                outcomes["closed"] += 1
                return
            try:
                stream._writer.write(data)
                await stream._writer.drain()
                kind, _ = await stream.recv(max_payload=1 << 20, timeout=2)
                outcomes["error" if kind is FrameKind.ERROR else "ack"] += 1
            except (PeerUnreachableError, ProtocolError, ConnectionError):
                outcomes["closed"] += 1
            finally:
                await stream.close()

        for start in range(0, len(payloads), 8):  # 8 at a time: under the per-peer stream limit
            await asyncio.gather(*(one(p, d) for p, d in payloads[start : start + 8]))
        return outcomes

    protocols = [EXEC_PROTOCOL] * 5 + [PROBE_PROTOCOL] * 2 + list(fuzzer.DHT_PROTOCOLS)
    payloads = fuzzer.payloads(500, protocols=protocols)
    outcomes = net.run(attack(payloads))
    assert sum(outcomes.values()) == 500
    assert outcomes["error"] > 50, outcomes  # most are answered with an ERROR, not dropped silently
    assert peer.popen.poll() is None, "the peer died"
    after, _ = _rss(peer)
    assert after - before < 100 << 20, (before, after)
    ref_losses, _ = _reference(1)

    async def legit() -> list[float]:
        driver = await _job(net, peer)
        try:
            return await driver.run_iteration(_batches(0))
        finally:
            await driver.aclose()

    assert net.run(legit()) == pytest.approx(ref_losses[0], rel=1e-5)
    assert "Traceback" not in peer.log()


def test_forged_dht_records_never_hide_a_real_peer(tmp_path: Path) -> None:
    """A DHT node that validates nothing stores a forged record under a peer's own subkey,
    with a far expiration (honest nodes refuse it). hivemind then reports each of the
    peer's stores as refused (the forger answers last); the peer reads its record back
    instead of warning, and readers, who drop the forger's answer, still see it."""
    fast = ["--heartbeat", "2", "--record-ttl", "10", "--probe-period", "30"]
    with LocalSwarm(1, swarm="forged", workdir=str(tmp_path), peer_args=[fast]) as alone:
        victim = alone.peers[0]
        marker = RSASignatureValidator(load_signing_key(str(tmp_path / "peer0.key"))).local_public_key
        forger = hivemind.DHT(
            initial_peers=alone.initial_peers,
            start=True,
            record_validators=[],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        )
        try:
            key = SwarmDirectory(forger, alone.swarm).peer_key(victim.peer_id)
            assert not forger.store(
                key, b"\x81\xa4kind\xa4peer", get_dht_time() + 3000, subkey=victim.peer_id.encode() + marker
            )
            forger.store(key, b"x" * 2500, get_dht_time() + 3000, subkey=b"mallory" + marker)
            time.sleep(10)  # five heartbeats
            with Swarm(alone.initial_peers, swarm=alone.swarm) as reader:
                seen = {p.peer_id: p for p in reader.peers()}
        finally:
            forger.shutdown()
        log = victim.log()
    assert victim.peer_id in seen
    assert get_dht_time() - seen[victim.peer_id].updated_at < 6
    assert "rejected DHT record: bad signature" in log  # the victim's node refused the forgery
    assert "no DHT node accepted" not in log
