"""Four real `fusionp2p peer` OS processes on loopback, observed and attacked from the test."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import hivemind
import psutil
import pytest
from conftest import wait_until
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from fusionp2p.launch import LocalSwarm
from fusionp2p.net.directory import SwarmDirectory, _shard
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.records import PeerRecord
from fusionp2p.swarm import Swarm

SWARM = "itest"
HEARTBEAT, TTL = 1.0, 6.0
FAST = ["--heartbeat", str(HEARTBEAT), "--record-ttl", str(TTL), "--probe-period", "2"]
LIMIT_MBPS = 40.0  # peer 3's upload cap: 5e6 bytes/s


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("swarm")
    args = [FAST, FAST, FAST, [*FAST, "--upload-limit-mbps", str(LIMIT_MBPS)]]
    with LocalSwarm(4, swarm=SWARM, workdir=str(workdir), peer_args=args) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client(local):
    with Swarm(local.initial_peers, swarm=SWARM) as swarm:
        yield swarm


def _ids(local: LocalSwarm, count: int = 4) -> set[str]:
    return {p.peer_id for p in local.peers[:count]}


def test_every_peer_sees_all_peer_and_link_records(local: LocalSwarm) -> None:
    ids = _ids(local)
    for peer in local.peers[:4]:  # read the swarm through each peer in turn
        with Swarm(peer.multiaddrs, swarm=SWARM) as view:
            records = wait_until(
                lambda v=view: {p.peer_id for p in v.peers()} == ids and v.peers(),
                timeout=30,
                message="all 4 PeerRecords",
            )
            pairs = wait_until(
                lambda v=view: len({(lk.src, lk.dst) for lk in v.links()}) == 12 and v.links(),
                timeout=45,
                message="all 12 LinkRecords",
            )
        assert all(r.fp32_flops > 0 and r.total_memory_bytes > 0 and r.state == "idle" for r in records)
        assert {(lk.src, lk.dst) for lk in pairs} == {(a, b) for a in ids for b in ids if a != b}
        assert all(lk.bandwidth_bytes_per_s > 0 and lk.rtt_s > 0 for lk in pairs)
    for peer in local.peers[:4]:  # probes and reads open and drop many streams: none is an error
        assert "Unhandled exception" not in peer.log() and "Traceback" not in peer.log(), peer.log()[-3000:]


def test_rate_limited_peer_is_published_within_20_percent_of_its_rate(client: Swarm, local) -> None:
    limited = local.peers[3].peer_id
    rate = LIMIT_MBPS * 1e6 / 8

    def limited_links():
        links = [lk for lk in client.links() if lk.src == limited and lk.samples >= 2]
        return links if len(links) == 3 else None

    links = wait_until(limited_links, timeout=45, message="3 smoothed links from the limited peer")
    for link in links:
        assert abs(link.bandwidth_bytes_per_s - rate) / rate < 0.2, (link, rate)
    others = [lk for lk in client.links() if lk.dst == limited]
    assert others and all(lk.bandwidth_bytes_per_s > 2 * rate for lk in others), others


class _SignAnything(RecordValidatorBase):
    """An attacker's validator: signs every record with its own key, whatever the subkey says."""

    def __init__(self, key) -> None:
        self.key = key

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        signature = self.key.sign(MSGPackSerializer.dumps(dataclasses.astuple(record)))
        return record.value + b"[signature:" + signature + b"]"

    @property
    def priority(self) -> int:
        return 10


def test_forged_malformed_and_oversized_records_are_rejected(local, client, tmp_path) -> None:
    victim = local.peers[1]
    victim_marker = RSASignatureValidator(load_signing_key(str(local.workdir / "peer1.key"))).local_public_key
    mallory_path = str(tmp_path / "mallory.key")
    mallory = ensure_identity(mallory_path).to_base58()
    mallory_key = load_signing_key(mallory_path)
    mallory_marker = RSASignatureValidator(mallory_key).local_public_key
    before = {p.peer_id: p for p in client.peers()}
    forged = dataclasses.replace(before[victim.peer_id], device_name="FORGED", updated_at=time.time() + 5)

    loop = asyncio.new_event_loop()  # hivemind's futures take the current loop: ours, closed below
    asyncio.set_event_loop(loop)
    attacker = hivemind.DHT(
        initial_peers=local.initial_peers,
        start=True,
        client_mode=True,
        record_validators=[_SignAnything(mallory_key)],
        nat_port_map=False,
    )
    try:
        directory = SwarmDirectory(attacker, SWARM)
        victim_key = directory.peers_key(_shard(victim.peer_id))
        expiration = get_dht_time() + 30
        attempts = {
            "forged": (victim_key, victim.peer_id.encode() + mallory_marker, forged.to_wire()),
            "bad signature": (victim_key, victim.peer_id.encode() + victim_marker, forged.to_wire()),
            "malformed": (
                directory.peers_key(_shard(mallory)),
                mallory.encode() + mallory_marker,
                b"\x93not a record",
            ),
            "oversized": (
                directory.peers_key(_shard(mallory)),
                mallory.encode() + mallory_marker,
                bytes(2200),  # > MAX_RECORD_BYTES; the pickled store request stays < 4 KiB
            ),
        }
        for key, subkey, value in attempts.values():
            future = attacker.store(key, value, expiration, subkey=subkey, return_future=True)
            assert future.result(timeout=60) is False
    finally:
        attacker.shutdown()
        asyncio.set_event_loop(None)
        loop.close()

    logs = "".join(p.log() for p in local.peers[:4])
    for reason in attempts:
        assert f"rejected DHT record: {reason}" in logs, reason
    # the swarm keeps working: the victim's real record stands and heartbeats go on
    after = wait_until(
        lambda: (
            (ps := {p.peer_id: p for p in client.peers()})
            and all(ps[i].updated_at > before[i].updated_at for i in before)
            and ps
        ),
        timeout=15,
        message="heartbeats",
    )
    assert set(after) == _ids(local)
    assert after[victim.peer_id].device_name != "FORGED"


def test_status_json_lists_the_swarms_peers_and_links_and_plans_offline(local: LocalSwarm, tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusionp2p",
            "--log-level",
            "warning",
            "status",
            "--swarm",
            SWARM,
            "--json",
            "--initial-peers",
            *local.peers[2].multiaddrs,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    status = json.loads(out.stdout)
    assert status["swarm"] == SWARM
    assert {p["peer_id"] for p in status["peers"]} == _ids(local)
    assert len({(lk["src"], lk["dst"]) for lk in status["links"]}) == 12
    assert all(
        PeerRecord(**{**p, "maddrs": tuple(p["maddrs"]), "executors": tuple(p["executors"])})
        for p in status["peers"]
    )


def _gone(pids: set[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return not alive


def _p2pd_children(peer) -> set[int]:
    procs = psutil.Process(peer.popen.pid).children(recursive=True)
    return {p.pid for p in procs if p.name() == "p2pd"}


def test_sigkilled_peer_disappears_within_its_ttl_and_leaves_no_orphans(local, client) -> None:
    peer = local.add_peer(FAST)
    wait_until(lambda: peer.peer_id in {p.peer_id for p in client.peers()}, timeout=20, message="joined")
    p2pd = _p2pd_children(peer)
    assert p2pd, "the peer should run a p2pd child"
    descendants = {c.pid for c in psutil.Process(peer.popen.pid).children(recursive=True)}
    killed_at = time.monotonic()
    local.signal(peer.index, signal.SIGKILL)
    peer.popen.wait(10)
    wait_until(
        lambda: peer.peer_id not in {p.peer_id for p in client.peers()},
        timeout=TTL + 10,
        message="the killed peer gone from peers()",
    )
    assert time.monotonic() - killed_at <= TTL + 10
    wait_until(lambda: _gone(descendants), timeout=10, message="the DHT process and p2pd ended")


def test_sigtermed_peer_leaves_at_once_with_no_p2pd_and_keeps_its_identity(local, client, tmp_path) -> None:
    identity = str(tmp_path / "stable.key")
    peer = local.add_peer([*FAST, "--identity", identity])
    wait_until(lambda: peer.peer_id in {p.peer_id for p in client.peers()}, timeout=20, message="joined")
    p2pd = _p2pd_children(peer)
    assert p2pd
    local.signal(peer.index, signal.SIGTERM)
    assert peer.popen.wait(20) == 0
    assert _gone(p2pd), "p2pd outlived its peer"
    left = time.monotonic()
    # the 'leaving' record hides it before its TTL would have
    wait_until(
        lambda: peer.peer_id not in {p.peer_id for p in client.peers()},
        timeout=TTL - 2,
        message="the leaving peer gone from peers()",
    )
    assert time.monotonic() - left < TTL - 2

    again = local.add_peer([*FAST, "--identity", identity])
    assert again.peer_id == peer.peer_id
    assert os.path.exists(identity)
