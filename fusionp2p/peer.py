"""The long-running peer: joins the swarm, publishes what it measured, answers probes.

A ``Peer`` is an async resource: ``peer = await Peer.create(config)`` ... ``await
peer.aclose()``, or ``async with await Peer.create(config) as peer``. While open it runs
an executor service (a data owner sets a stage of its job up here and streams OpData
to it; ``runtime/service.py`` says what it accepts from whom) and two tracked background
tasks: the heartbeat (PeerRecord + its LinkRecords, each a signed expiring DHT entry)
and the probe loop (a bounded sample of peers per period).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from functools import partial

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from fusionp2p.config import PeerConfig
from fusionp2p.coordination.coordinator import Coordinator
from fusionp2p.coordination.election import LeaseJudge, LeaseKeeper, read_lease
from fusionp2p.coordination.plan_check import check_planned_setup
from fusionp2p.errors import FusionP2PError, ProtocolError
from fusionp2p.net.dht_node import start_dht, stop_dht
from fusionp2p.net.directory import SwarmDirectory, Unread
from fusionp2p.net.dropped_streams import quiet_dropped_streams
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.net.limits import StreamGate
from fusionp2p.net.listen import check_listen_addresses
from fusionp2p.net.probe import HINT_SOURCES, LinkEstimator, hints_from, probe_link, serve_probe
from fusionp2p.net.sockets import hivemind_sockets, remove_stale
from fusionp2p.net.transport import P2PTransport, RateLimitedTransport, Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.records import MAX_LINKS_PER_PEER, PROBE_PROTOCOL, JobSetup, PeerRecord
from fusionp2p.runtime.averaging import StageAverager
from fusionp2p.runtime.device_profile import DeviceProfile, free_memory, profile_device, resolve_device
from fusionp2p.runtime.engines import memory_allowance
from fusionp2p.runtime.executor import Executor
from fusionp2p.runtime.service import ExecutorService, ServicePolicy
from fusionp2p.runtime.shard_store import default_shard_dir
from fusionp2p.version import __version__

__all__ = ["Peer"]

logger = logging.getLogger(__name__)

STALE_SOCKET_AGE_S = 60.0  # a dead hivemind socket at least this old is removed when a peer starts


class Peer:
    """A swarm member on this machine. Create with ``await Peer.create(config)``."""

    def __init__(
        self,
        config: PeerConfig,
        dht: hivemind.DHT,
        transport: Transport,
        profile: DeviceProfile,
        directory: SwarmDirectory,
    ) -> None:
        self.config = config
        self.dht = dht
        self.transport = transport
        self.profile = profile
        self.directory = directory
        self.peer_id = transport.peer_id
        self.estimator = LinkEstimator(self.peer_id, config.probe)
        self.state = "joining"
        self.started_at = get_dht_time()
        self._busy = False
        self._expiration = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._probed_by: OrderedDict[str, None] = OrderedDict()  # who probed this peer, newest last
        self._closed = False
        self._maddrs: list[str] = []
        self.executors: ExecutorService | None = None  # runs the stage a data owner assigns here
        # what this peer accepts of lease claims, for its keeper and its plan checks
        self.judge = LeaseJudge(allowed=frozenset(config.coordinators))
        self.keeper = LeaseKeeper(
            directory, self.peer_id, lease_s=config.lease_seconds, maddrs=self._lease_maddrs, judge=self.judge
        )
        self.coordinator: Coordinator | None = None  # plans jobs while this peer holds the lease

    @classmethod
    async def create(cls, config: PeerConfig) -> Peer:
        """Profiles the device, starts the DHT node and joins the swarm.

        Raises:
            ConfigError: a bad identity file, an ``allow_models`` entry that cannot be imported,
                or a ``host_maddrs`` port already in use.
            SwarmError: the DHT node could not start or join.
            ProfileError: the device could not be measured.
        """
        registry = ModelRegistry(allow=config.allow_models)  # the operator's choice; fails early
        check_listen_addresses(config.host_maddrs)
        remove_stale(hivemind_sockets(), min_age_s=STALE_SOCKET_AGE_S)  # left by killed peers before
        tmpdir = None
        identity_path = config.identity_path
        if identity_path is None:
            tmpdir = tempfile.mkdtemp(prefix="fusionp2p-")
            identity_path = os.path.join(tmpdir, "identity.key")
        fresh = not os.path.exists(identity_path)  # made now: no other peer can be using it
        try:
            ensure_identity(identity_path)
            signing_key = load_signing_key(identity_path)
            device = resolve_device(config.device)
            logger.info("stages compute on %s (--device %s)", device, config.device)
            profile = await asyncio.to_thread(
                profile_device,
                device,
                flops_override=config.flops_override,
                speed=config.emulated_speed,
                use_cache=not config.reprofile,
            )
            dht = start_dht(
                initial_peers=config.initial_peers,
                host_maddrs=config.host_maddrs,
                announce_maddrs=config.announce_maddrs,
                identity_path=identity_path,
                signing_key=signing_key,
                fresh_identity=fresh,
            )
        finally:  # an ephemeral identity lives only while p2pd starts (it has read it then)
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
        try:
            quiet_dropped_streams()
            transport: Transport = P2PTransport(await dht.replicate_p2p())
            if config.upload_limit_mbps is not None:
                transport = RateLimitedTransport(transport, config.upload_limit_mbps * 1e6 / 8)
            marker = RSASignatureValidator(signing_key).local_public_key
            directory = SwarmDirectory(dht, config.swarm, owner_marker=marker, timeout=config.timeouts.dht)
            peer = cls(config, dht, transport, profile, directory)
            maddrs = await dht.run_coroutine(
                partial(hivemind.DHT._get_visible_maddrs, latest=True), return_future=True
            )
            peer._maddrs = [str(m) for m in maddrs]
            limits = config.exec_limits
            gate = StreamGate(per_peer=limits.streams_per_peer, total=limits.streams_total)
            await transport.serve(PROBE_PROTOCOL, peer._serve_probe, gate=gate)
            policy = ServicePolicy(
                max_jobs=config.max_jobs,
                shard_dir=config.checkpoint_dir or default_shard_dir(peer.peer_id),
                weights_dir=config.weights_dir,
                accept_jobs_from=frozenset(config.accept_jobs_from),
                max_memory_bytes=config.max_memory_bytes,
                limits=limits,
                device=profile.device,
                emulated_speed=config.emulated_speed,
            )
            peer.executors = await ExecutorService(
                transport,
                policy,
                registry=registry,
                gate=gate,
                plan_check=peer._check_plan,
                on_jobs_changed=peer._jobs_changed,
                averagers=peer._averager,
            ).start()
            if peer.stands_for_election:
                peer.coordinator = await Coordinator(
                    transport,
                    directory,
                    peer.keeper,
                    registry,
                    timeout=config.timeouts.dht * 4,
                    gate=gate,
                    budget=config.trace_budget,
                ).start()
            await peer._publish_self()
            peer.state = "idle"
            await peer._publish_self()
        except BaseException:
            stop_dht(dht)
            raise
        peer._spawn(peer._heartbeat_loop(), "heartbeat")
        peer._spawn(peer._probe_loop(), "probe")
        if peer.stands_for_election:
            peer._spawn(peer.keeper.run(), "lease")
        logger.info("peer %s joined swarm %r", peer.peer_id, config.swarm)
        return peer

    async def __aenter__(self) -> Peer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def stands_for_election(self) -> bool:
        """Whether this peer may become the coordinator: it stands, and its own list of
        coordinators (if any) names it."""
        listed = self.config.coordinators
        return self.config.coordinator and (not listed or self.peer_id in listed)

    @property
    def multiaddrs(self) -> list[str]:
        """Addresses another machine passes as ``--initial-peers`` to join through this peer."""
        return list(self._maddrs)

    def set_busy(self, busy: bool) -> None:
        """Marks the peer as training: it probes ``busy_slowdown`` times less often, and a
        coordinator leaves it out of other jobs' plans."""
        self._busy = busy
        self.state = "training" if busy else "idle"

    def _lease_maddrs(self) -> list[str]:
        return self.multiaddrs

    async def _check_plan(self, setup: JobSetup, sender: str) -> None:
        """A planned setup must be the coordinator's plan in force; an unplanned one (epoch 0)
        comes only from a peer the operator lists, or while the swarm has no coordinator.

        Raises:
            ProtocolError: the reason, sent back to the data owner.
        """
        if setup.epoch:
            await check_planned_setup(self.directory, setup, sender=sender, me=self.peer_id, judge=self.judge)
            return
        if sender in self.config.accept_unplanned_from:
            return
        lease = await read_lease(self.directory, self.judge)
        if lease is not None:
            raise ProtocolError(
                f"job {setup.job}: this swarm has a coordinator ({lease.holder[-8:]}, epoch {lease.epoch}), "
                "so this peer runs only its published plans; its operator takes unplanned jobs with "
                "--accept-unplanned-from"
            )

    def _averager(self, setup: JobSetup, owner: str, executor: Executor) -> StageAverager:
        """The averager of a replicated stage this peer runs, on the swarm's DHT (blocking)."""
        return StageAverager(
            self.dht,
            executor.param_tensors(),
            job=setup.group,
            plan_version=setup.plan_version,
            stage=setup.stage,
            replicas=setup.replicas,
            deadline_s=setup.averaging_s,
            owner=owner,
            members=setup.averaging_peers,
            generation=setup.generation,
            codec=setup.averaging_codec,
        )

    def _jobs_changed(self) -> None:
        if self._closed or self.executors is None:
            return
        busy = bool(self.executors.jobs)
        if busy != self._busy:
            self.set_busy(busy)
            self._spawn(self._publish_self(), "publish-state")

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=f"fusionp2p.{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve_probe(self, stream) -> None:
        # a link counts once both ends measured it (planning.vouch): probe back who probed this peer
        self._probed_by.pop(stream.remote, None)
        self._probed_by[stream.remote] = None
        while len(self._probed_by) > MAX_LINKS_PER_PEER:
            self._probed_by.popitem(last=False)
        await serve_probe(stream, max_bytes=self.config.probe.max_bytes, timeout=self.config.timeouts.probe)

    def _peer_record(self, now: float) -> PeerRecord:
        free, total = free_memory(self.profile.device)
        free = min(
            free, memory_allowance(self.config.max_memory_bytes, self.profile.device)
        )  # what a stage gets
        limit = (self.config.upload_limit_mbps or 0) * 1e6 / 8
        jobs = self.executors.jobs if self.executors is not None else {}
        return PeerRecord(
            peer_id=self.peer_id,
            maddrs=tuple(self.multiaddrs[:8]),
            device=self.profile.device,
            device_name=self.profile.device_name[:64],
            flops=dict(self.profile.flops),
            topk_codec_s=dict(self.profile.topk_codec_s),
            site=self.config.site,
            memory_bytes=free,
            total_memory_bytes=total,
            state=self.state,
            started_at=self.started_at,
            updated_at=now,
            torch_version=self.profile.torch_version,
            fusionp2p_version=__version__,
            executors=self.profile.executors,
            upload_limit_bytes_per_s=limit,
            job=next(iter(jobs), "")[:64],
            stage_s=max((j.last_step_s for j in jobs.values()), default=0.0),
        )

    def _next_expiration(self, now: float) -> float:
        # the DHT keeps the record with the highest expiration: never go below the last one
        self._expiration = max(now + self.config.record_ttl, self._expiration + 1e-3)
        return self._expiration

    async def _publish_self(self) -> None:
        now = get_dht_time()
        record = self._peer_record(now)
        if not await self.directory.publish_peer(record, self._next_expiration(now)):
            if await self.directory.holds_peer(record):
                logger.debug("a DHT replica refused this peer's record, others hold it")
            else:
                logger.warning("no DHT node accepted this peer's record (state %s)", self.state)

    async def _publish_links(self) -> None:
        now = get_dht_time()
        records = self.estimator.records(now, max_age=self.config.probe.fresh_seconds * 2)
        if records:
            await self.directory.publish_links(records, now + self.config.record_ttl)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat)
            try:
                await self._publish_self()
                await self._publish_links()
            except (TimeoutError, FusionP2PError, OSError) as e:
                logger.warning("heartbeat failed, will retry: %s", e)

    async def _probe_loop(self) -> None:
        await asyncio.sleep(min(1.0, self.config.probe.period))
        while True:
            try:
                await self._probe_round()
            except (TimeoutError, FusionP2PError, OSError) as e:
                logger.warning("probe round failed, will retry: %s", e)
            await asyncio.sleep(self.estimator.probe_interval(busy=self._busy))

    async def _probe_round(self) -> None:
        peers = await self.directory.fetch_peers()
        now = get_dht_time()
        self.estimator.forget(self.estimator.known_peers() - set(peers))
        nearest = [p for p in self.estimator.fastest(HINT_SOURCES) if p in peers]
        around = await self.directory.fetch_links(nearest, unread=Unread())  # a missing one: fewer hints
        known = self.estimator.known_peers()
        asked = [p for p in reversed(self._probed_by) if p in peers and p not in known]
        hints = [*asked, *hints_from(around)]
        measured = []
        for dst in self.estimator.choose_targets(peers, now, hints):
            nbytes = self.estimator.next_probe_bytes(dst)
            try:
                sample = await probe_link(
                    self.transport,
                    dst,
                    nbytes=nbytes,
                    ping_count=self.config.probe.ping_count,
                    timeout=self.config.timeouts.probe,
                )
            except (FusionP2PError, TimeoutError, OSError) as e:
                logger.info("probe of %s failed: %s", dst[:12], e)
                continue
            record = self.estimator.update(dst, sample, get_dht_time())
            measured.append(record)
            logger.debug(
                "link -> %s: %.1f MB/s, rtt %.2f ms (%d bytes)",
                dst[:12],
                sample.bandwidth_bytes_per_s / 1e6,
                sample.rtt_s * 1e3,
                nbytes,
            )
        if measured:
            await self.directory.publish_links(measured, get_dht_time() + self.config.record_ttl)

    async def aclose(self) -> None:
        """Leaves the swarm: marks the record 'leaving', stops tasks, stops the DHT and p2pd."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.state = "leaving"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._publish_self(), self.config.timeouts.shutdown / 2)
        if self.coordinator is not None:
            await self.coordinator.aclose()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.keeper.release(), self.config.timeouts.shutdown / 2)
        if self.executors is not None:
            await self.executors.aclose()
        with contextlib.suppress(Exception):
            await self.transport.aclose()
        await asyncio.to_thread(stop_dht, self.dht)
        logger.info("peer %s left swarm %r", self.peer_id, self.config.swarm)
