"""Typed, validated configuration of a peer and of its probes.

Every field carries one comment; ``__post_init__`` rejects bad values with a message
that shows them. Timeouts and limits are small keyword-only value objects.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from fusionp2p.errors import ConfigError

__all__ = [
    "DEFAULT_SWARM",
    "DEFAULT_TIMEOUTS",
    "MAX_LEASE_SECONDS",
    "NAME_RE",
    "NO_WARMUP",
    "PEER_ID_RE",
    "SITE_PATTERN",
    "ExecLimits",
    "OptimizerConfig",
    "PeerConfig",
    "ProbeConfig",
    "RatioWarmup",
    "Timeouts",
    "TraceBudget",
    "check_site",
    "format_bytes",
    "parse_bytes",
]

DEFAULT_SWARM = "fusionp2p"
MAX_LEASE_SECONDS = 120.0  # the longest coordinator lease period a peer takes or accepts
NAME_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")  # a swarm's or a job's name: 1-64 letters, digits, - or _
PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,128}$")  # a base58 PeerID
SITE_PATTERN = re.compile(r"[A-Za-z0-9._-]{0,64}")  # a data centre's label (PeerRecord.site); "" for none


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{owner}.{name} must be a positive finite number, got {value!r}")


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def check_site(site: object, where: str) -> str:
    """``site`` if it is a data-centre label a PeerRecord can carry (``SITE_PATTERN``).

    Raises:
        ConfigError: not up to 64 letters, digits, '.', '_' or '-'.
    """
    if not isinstance(site, str) or not SITE_PATTERN.fullmatch(site):
        raise ConfigError(f"{where} takes up to 64 letters, digits, '.', '_' or '-', got {site!r:.80}")
    return site


def check_peer_maddr(maddr: object, where: str) -> str:
    """``maddr`` if it is a multiaddr that names a peer (``/ip4/1.2.3.4/tcp/31337/p2p/Qm...``).

    Raises:
        ConfigError: not a string, not a parseable multiaddr, or without a ``/p2p/`` PeerID.
    """
    from hivemind.utils.multiaddr import Multiaddr

    example = "like /ip4/1.2.3.4/tcp/31337/p2p/Qm... (printed by `fusionp2p peer`)"
    if not isinstance(maddr, str):
        raise ConfigError(f"{where}: {maddr!r:.80} is not a peer multiaddr {example}")
    try:
        parsed = Multiaddr(maddr)
    except Exception as e:  # the parser raises several kinds of errors
        raise ConfigError(f"{where}: {maddr!r:.80} is not a peer multiaddr {example}: {e}") from None
    if "p2p" not in [p.name for p in parsed.protocols()]:
        raise ConfigError(f"{where}: {maddr!r:.80} names no peer (/p2p/<PeerID>); use a multiaddr {example}")
    return maddr


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"4 GB"``, ``"1000000"`` -> bytes (KiB/MiB/GiB are powers of 1024).

    Raises:
        ConfigError: not a number with a known unit.
    """
    found = _BYTES_RE.match(text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _BYTE_UNITS:
        raise ConfigError(f"{text!r} is not a size; use e.g. 4GiB, 512MiB or a number of bytes")
    return int(float(found.group(1)) * _BYTE_UNITS[unit])


def format_bytes(n: float) -> str:
    """A human-readable size: ``format_bytes(3 << 30) == "3.0 GiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Deadlines for remote work, in seconds."""

    probe: float = 20.0  # one whole bandwidth/RTT probe of one link
    dht: float = 15.0  # one DHT get or store
    shutdown: float = 10.0  # leaving the swarm cleanly
    request: float = 120.0  # one request of a data owner to a stage or the coordinator
    serve: float = 60.0  # a server answering one request, or a stage finishing its part of an iteration
    frame: float = 30.0  # one frame written to a stream
    ping: float = 5.0  # a stage owner answering a liveness ping
    teardown: float = 3.0  # one stage tearing a job down
    courtesy: float = 2.0  # a last frame (END, ERROR) sent before a stream closes

    def __post_init__(self) -> None:
        _positive(
            "Timeouts",
            probe=self.probe,
            dht=self.dht,
            shutdown=self.shutdown,
            request=self.request,
            serve=self.serve,
            frame=self.frame,
            ping=self.ping,
            teardown=self.teardown,
            courtesy=self.courtesy,
        )


DEFAULT_TIMEOUTS = Timeouts()


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """How a peer measures bandwidth and RTT to others."""

    period: float = 10.0  # seconds between probe rounds
    fanout: int = 3  # peers probed per round: a bounded sample, never all pairs
    ping_count: int = 5  # tiny round trips per probe; the RTT is their median
    initial_bytes: int = 1 << 20  # payload of the first probe of a link
    min_bytes: int = 256 << 10  # smallest payload (keeps the estimate above noise)
    max_bytes: int = 16 << 20  # largest payload a probe sends or a peer accepts
    target_seconds: float = 0.4  # later probes size their payload to take about this long
    window: int = 4  # a link's estimate: best bandwidth and RTT of its last this many probes
    fresh_seconds: float = 60.0  # a link measured more recently than this is "fresh"
    busy_slowdown: float = 4.0  # a peer busy training probes this many times less often

    def __post_init__(self) -> None:
        _positive(
            "ProbeConfig",
            period=self.period,
            target_seconds=self.target_seconds,
            fresh_seconds=self.fresh_seconds,
            busy_slowdown=self.busy_slowdown,
        )
        for name in ("fanout", "ping_count", "initial_bytes", "min_bytes", "max_bytes", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ProbeConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.min_bytes <= self.initial_bytes <= self.max_bytes:
            raise ConfigError(
                "ProbeConfig needs min_bytes <= initial_bytes <= max_bytes, got "
                f"{self.min_bytes} / {self.initial_bytes} / {self.max_bytes}"
            )
        if self.busy_slowdown < 1:
            raise ConfigError(f"ProbeConfig.busy_slowdown must be >= 1, got {self.busy_slowdown}")


def _positive_ints(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ExecLimits:
    """What a peer accepts on its exec protocol. Over a limit, the stream gets an ERROR
    reply naming the limit and is closed; the peer keeps serving everyone else."""

    control_bytes: int = 64 << 10  # body of a control message (step, fetch and teardown have none)
    setup_bytes: int = 4 << 20  # body of a setup (a restoring stage's names every tensor's digest)
    weights_chunk_bytes: int = 64 << 20  # one weights message (a tensor larger than this comes alone)
    max_stages: int = 64  # stages of one job
    idle_timeout: float = 30.0  # an inbound stream that starts no frame for this long is closed
    stall_timeout: float = 30.0  # a frame whose bytes stop arriving for this long is dropped
    min_inbound_rate: float = 512 << 10  # ... or that arrives slower than this (bytes/s) in all
    streams_per_peer: int = 16  # concurrent inbound streams from one remote peer, every protocol
    streams_total: int = 256  # concurrent inbound streams from all peers
    inbox_depth: int = 256  # OpData queued for compute per job; more waits (back-pressure)
    inbound_bytes: int = 1 << 30  # message bodies held in memory at once, from all peers
    inbound_bytes_per_peer: int = 256 << 20  # ... from one remote peer
    job_idle_timeout: float = 600.0  # a job whose owner and neighbours send nothing this long is freed

    def __post_init__(self) -> None:
        _positive_ints(
            "ExecLimits",
            control_bytes=self.control_bytes,
            setup_bytes=self.setup_bytes,
            weights_chunk_bytes=self.weights_chunk_bytes,
            max_stages=self.max_stages,
            streams_per_peer=self.streams_per_peer,
            streams_total=self.streams_total,
            inbox_depth=self.inbox_depth,
            inbound_bytes=self.inbound_bytes,
            inbound_bytes_per_peer=self.inbound_bytes_per_peer,
        )
        _positive(
            "ExecLimits",
            idle_timeout=self.idle_timeout,
            stall_timeout=self.stall_timeout,
            job_idle_timeout=self.job_idle_timeout,
            min_inbound_rate=self.min_inbound_rate,
        )


@dataclass(frozen=True)
class TraceBudget:
    """What a coordinator spends on one job request (``fusionp2p peer --coordinator-trace-seconds``,
    ``--coordinator-max-model``)."""

    seconds: float = 30.0  # CPU seconds of one trace, after its model was built
    max_model_bytes: int = 64 << 30  # the parameters of a model it plans
    size_seconds: float = 10.0  # CPU seconds building the (fake) model to learn its size

    def __post_init__(self) -> None:
        _positive("TraceBudget", seconds=self.seconds, size_seconds=self.size_seconds)
        if not isinstance(self.max_model_bytes, int) or self.max_model_bytes <= 0:
            raise ConfigError(f"TraceBudget.max_model_bytes must be an int > 0, got {self.max_model_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Everything a long-running peer needs to join a swarm."""

    swarm: str = DEFAULT_SWARM  # name of the swarm; peers of different swarms ignore each other
    initial_peers: tuple[str, ...] = ()  # multiaddrs of live peers; empty starts a new swarm
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)  # where p2pd listens
    announce_maddrs: tuple[str, ...] = ()  # addresses other peers should dial (NAT, public IP)
    identity_path: str | None = None  # libp2p identity file; gives a stable PeerID
    device: str = "auto"  # "cpu", "cuda[:N]", or "auto" (a GPU when there is one): where stages compute
    flops_override: float | None = None  # declared fp32 FLOP/s, replacing the measured one
    emulated_speed: float = 1.0  # testbeds: profile and compute as a device this much as fast, in (0, 1]
    reprofile: bool = False  # measure the device even when a plausible cached profile exists
    upload_limit_mbps: float | None = None  # cap on this peer's outgoing stream traffic
    site: str = ""  # the data centre this peer is in: peers of one site share links to other sites
    heartbeat: float = 5.0  # seconds between PeerRecord/LinkRecord refreshes
    record_ttl: float = 20.0  # seconds a record lives without a heartbeat
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    allow_models: tuple[
        str, ...
    ] = ()  # model factories ("module:attr") to serve besides the built-in families
    max_memory_bytes: int | None = (
        None  # a stage may need at most this; None: 80% of the device's free memory
    )
    max_jobs: int = 1  # jobs served at once; a setup beyond this is refused, never replaces one
    checkpoint_dir: str | None = None  # where stages keep checkpoint shards; None: the user's cache
    weights_dir: str | None = None  # local copies of pretrained models a stage may load from
    accept_jobs_from: tuple[str, ...] = ()  # PeerIDs allowed to set jobs up here; empty: anyone
    accept_unplanned_from: tuple[str, ...] = ()  # ... a job no coordinator planned, while one exists
    exec_limits: ExecLimits = field(default_factory=ExecLimits)
    coordinator: bool = True  # stands for coordinator election (False: --no-coordinator)
    coordinators: tuple[str, ...] = ()  # the only peers whose lease this peer accepts; empty: any live peer
    lease_seconds: float = 15.0  # the coordinator lease's period; a dead holder is replaced within 3
    trace_budget: TraceBudget = field(default_factory=TraceBudget)  # what planning one request may cost

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.swarm):
            raise ConfigError(
                f"PeerConfig.swarm must be 1-64 letters, digits, '-' or '_', got {self.swarm!r}"
            )
        for maddr in self.initial_peers:
            check_peer_maddr(maddr, "--initial-peers")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
            for maddr in getattr(self, name):
                if not isinstance(maddr, str) or not maddr.startswith("/"):
                    host_port = re.fullmatch(r"(\d+\.\d+\.\d+\.\d+):(\d+)", str(maddr))
                    hint = f" (did you mean /ip4/{host_port[1]}/tcp/{host_port[2]}?)" if host_port else ""
                    raise ConfigError(f"PeerConfig.{name} holds {maddr!r}, not a multiaddr{hint}")
        if not self.host_maddrs:
            raise ConfigError("PeerConfig.host_maddrs must name at least one address")
        if self.device not in ("cpu", "auto") and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ConfigError(f"PeerConfig.device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}")
        _positive(
            "PeerConfig",
            heartbeat=self.heartbeat,
            record_ttl=self.record_ttl,
            lease_seconds=self.lease_seconds,
        )
        if self.flops_override is not None:
            _positive("PeerConfig", flops_override=self.flops_override)
        if self.upload_limit_mbps is not None:
            _positive("PeerConfig", upload_limit_mbps=self.upload_limit_mbps)
        check_site(self.site, "PeerConfig.site")
        if not 0 < self.emulated_speed <= 1:
            raise ConfigError(f"PeerConfig.emulated_speed must be in (0, 1], got {self.emulated_speed}")
        for target in self.allow_models:
            if not isinstance(target, str) or not re.fullmatch(r"[\w.]+:[\w.]+", target):
                raise ConfigError(f"PeerConfig.allow_models holds {target!r}, not 'package.module:factory'")
        for name in ("accept_jobs_from", "accept_unplanned_from", "coordinators"):
            for peer_id in getattr(self, name):
                if not isinstance(peer_id, str) or not PEER_ID_RE.match(peer_id):
                    raise ConfigError(f"PeerConfig.{name} holds {peer_id!r}, not a base58 PeerID")
        if self.max_memory_bytes is not None:
            _positive_ints("PeerConfig", max_memory_bytes=self.max_memory_bytes)
        _positive_ints("PeerConfig", max_jobs=self.max_jobs)
        if self.lease_seconds > MAX_LEASE_SECONDS:
            raise ConfigError(
                f"PeerConfig.lease_seconds must be at most {MAX_LEASE_SECONDS:g}, got {self.lease_seconds}"
            )
        if self.record_ttl < 2 * self.heartbeat:
            raise ConfigError(
                f"PeerConfig.record_ttl ({self.record_ttl}) must be at least twice the "
                f"heartbeat ({self.heartbeat}), or records expire between refreshes"
            )


_OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer every stage applies to its own parameters after each iteration."""

    name: str = "adamw"  # "adamw" or "sgd"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)  # adamw
    eps: float = 1e-8  # adamw
    weight_decay: float = 0.01
    momentum: float = 0.0  # sgd

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ConfigError(f"OptimizerConfig.name must be one of {_OPTIMIZERS}, got {self.name!r}")
        _positive("OptimizerConfig", lr=self.lr, eps=self.eps)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"OptimizerConfig.betas must be two numbers in [0, 1), got {self.betas!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0 and 0 <= self.momentum < 1):
            raise ConfigError("OptimizerConfig.weight_decay must be >= 0 and momentum in [0, 1)")


@dataclass(frozen=True)
class RatioWarmup:
    """Top-K ratios grow as ``ratio ** (t / steps)`` over a job's steps ``t < steps``; ``done``
    of them passed before a pipeline's iteration 0, so a re-plan or a resume continues the
    ramp instead of restarting it. An abrupt switch from dense to the full ratio costs more
    loss than no warm-up at all; growing it geometrically costs less than either
    (benchmarks/convergence.py)."""

    steps: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "done"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
                raise ConfigError(f"RatioWarmup.{name} must be an integer in [0, 2**62), got {value!r:.40}")

    def ratio(self, ratio: float, iteration: int) -> float:
        """The Top-K ratio to send at a pipeline's ``iteration`` for a planned ``ratio``."""
        step = self.done + iteration
        if step >= self.steps or ratio <= 1:
            return ratio
        return float(ratio ** (step / self.steps))


NO_WARMUP = RatioWarmup()  # the plan's ratios from the first step
