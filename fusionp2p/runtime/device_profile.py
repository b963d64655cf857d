"""Measured, not declared: the compute speed and memory of this peer's device.

``profile_device`` times square matmuls per dtype for a short, bounded time and caches
the result per device (name, torch version, host) so a restart is quick. Free memory is
read fresh every time, since it changes.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from fusionp2p.errors import ProfileError
from fusionp2p.records import TRAIN_FLOPS
from fusionp2p.runtime.codec_profile import measure_codec
from fusionp2p.runtime.throttle import Throttle

__all__ = [
    "DeviceProfile",
    "free_memory",
    "measure_device",
    "measure_training",
    "median_rate",
    "profile_device",
    "resolve_device",
]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 4  # 2: TRAIN_FLOPS; 3: topk_codec_s; 4: median of >= MIN_RUNS runs
CACHE_MAX_AGE_S = 7 * 24 * 3600.0  # a cached profile older than this is measured again
IMPLAUSIBLE = 4.0  # a quick check this many times faster than the cached speed: measure again
MIN_RUNS = 3


@dataclass(frozen=True)
class DeviceProfile:
    """What a peer publishes about its device."""

    device: str  # "cpu" or "cuda:N"
    device_name: str
    flops: dict[str, float]  # matmul FLOP/s per dtype name (always "float32"), and TRAIN_FLOPS
    total_memory_bytes: int
    torch_version: str = torch.__version__
    executors: tuple[str, ...] = ("torch",)
    measured: dict[str, bool] = field(default_factory=dict)  # False where --flops overrode it
    topk_codec_s: dict[str, float] = field(default_factory=dict)  # records.CODEC_TERMS; {}: not measured


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def resolve_device(device: str) -> str:
    """``"auto"``: ``"cuda:0"`` when a GPU is usable, else ``"cpu"``; ``"cuda"``: ``"cuda:0"``.

    Raises:
        ProfileError: a CUDA device asked for where torch sees none.
    """
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ProfileError(f"device {device!r} asked for, but torch sees no CUDA device here")
        return device if ":" in device else "cuda:0"
    return device


def free_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of memory on ``device``; on the CPU, free is what the kernel can
    hand out without swapping (``MemAvailable``: unused memory plus reclaimable caches)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(free), int(total)
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def median_rate(
    run: Callable[[], object],
    flops: float,
    *,
    budget_s: float,
    max_runs: int,
    throttle: Throttle | None = None,
    min_runs: int = MIN_RUNS,
    sync: Callable[[], object] = lambda: None,
) -> float:
    """FLOP/s of ``run`` (``flops`` each, then ``sync``): one untimed warm-up, then timed
    runs for ``budget_s`` (at least ``min_runs``, at most ``max_runs``), and the rate of the
    median run, so that one run caught by a page fault or a neighbour's burst does not
    become the speed a peer publishes for hours."""
    throttle = throttle or Throttle()

    def step() -> None:
        run()
        sync()

    step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        began = time.perf_counter()
        throttle.run(step)
        times.append(time.perf_counter() - began)
    return flops / statistics.median(times)


def _sync(device: torch.device) -> Callable[[], object]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _matmul_size(device: torch.device) -> int:
    """The side of the fp32 matmul a profile times on ``device``."""
    return 2048 if device.type == "cuda" else 512


def _time_matmul(
    device: torch.device, dtype: torch.dtype, n: int, budget_s: float, throttle: Throttle
) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    return median_rate(
        lambda: torch.matmul(a, b),
        2.0 * n**3,
        budget_s=budget_s,
        max_runs=1000,
        throttle=throttle,
        sync=_sync(device),
    )


class _ReferenceBlock(torch.nn.Module):
    """A GPT-2 transformer block (pre-norm, causal attention, 4x MLP) in plain torch."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


def _time_training(device: torch.device, budget_s: float, throttle: Throttle) -> float:
    """FLOP/s of a transformer block's forward + backward (the paper's warm-up profiling of
    real operators, §3.5): what the planner divides FLOPs by. FLOPs counted as the OP-DAG
    counts them (``opdag.analytic``: 24·T·d² + 4·b·s²·d forward, twice that backward)."""
    d, heads, b, s = (2048, 16, 8, 512) if device.type == "cuda" else (512, 8, 4, 128)
    block = _ReferenceBlock(d, heads).to(device)
    x = torch.randn(b, s, d, device=device, requires_grad=True)
    flops = 3 * (24 * b * s * d * d + 4 * b * s * s * d)

    def train_step() -> None:
        block(x).pow(2).mean().backward()

    return median_rate(
        train_step, flops, budget_s=budget_s, max_runs=200, throttle=throttle, sync=_sync(device)
    )


def measure_training(device: str, *, budget_s: float = 0.5, speed: float = 1.0) -> float:
    """Training FLOP/s of ``device`` (emulated at ``speed``) alone, uncached: the figure
    a plan divides a stage's FLOPs by (``TRAIN_FLOPS``), measured again now."""
    return _time_training(torch.device(device), budget_s, Throttle(speed))


def measure_device(device: str, *, budget_s: float = 0.5, speed: float = 1.0) -> DeviceProfile:
    """Times matmuls on ``device`` (fp32 always; bf16/fp16 where they run), a transformer
    block's training step and Top-K coding (``runtime.codec_profile``), each slowed to an
    emulated ``speed`` (``runtime.throttle``; 1: as it is).

    Raises:
        ProfileError: the device is missing or fp32 matmul fails.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(f"device {device} requested but CUDA is not available here")
    n = _matmul_size(dev)
    throttle = Throttle(speed)
    flops: dict[str, float] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        try:
            size = n if name == "float32" or dev.type == "cuda" else n // 2  # slow on CPU
            flops[name] = _time_matmul(dev, dtype, size, budget_s, throttle)
        except (RuntimeError, TypeError) as e:
            if name == "float32":
                raise ProfileError(f"fp32 matmul failed on {device}: {e}") from e
            logger.info("%s matmul unavailable on %s: %s", name, device, e)
    flops[TRAIN_FLOPS] = _time_training(dev, budget_s, throttle)
    _, total = free_memory(device)
    return DeviceProfile(
        device=device,
        device_name=_device_name(dev),
        flops=flops,
        total_memory_bytes=total,
        measured={k: True for k in flops},
        topk_codec_s=measure_codec(device, throttle=throttle),
    )


def _cache_path(device: str, speed: float) -> Path:
    root = Path(os.environ.get("FUSIONP2P_CACHE", Path.home() / ".cache" / "fusionp2p"))
    key = f"{platform.node()}-{device.replace(':', '_')}-torch{torch.__version__}"
    if speed != 1.0:
        key += f"-speed{speed:g}"
    return root / f"profile-{key}.json"


def _cached(path: Path, device: str, speed: float) -> DeviceProfile | None:
    """The profile cached at ``path``, unless it is missing, unreadable, of another cache
    version, older than ``CACHE_MAX_AGE_S``, or implausible: a quick fp32 matmul check now
    runs ``IMPLAUSIBLE`` times faster than it says (a profile taken under load, say)."""
    try:
        age = time.time() - path.stat().st_mtime
        raw = json.loads(path.read_text())
        if raw.pop("cache_version", None) != _CACHE_VERSION:
            return None
        raw["executors"] = tuple(raw["executors"])
        profile = DeviceProfile(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as e:
        logger.info("ignoring unreadable profile cache %s: %s", path, e)
        return None
    if age > CACHE_MAX_AGE_S:
        logger.info("the cached profile of %s is %.0f days old: measuring again", device, age / 86400)
        return None
    cached = profile.flops.get("float32", 0.0)
    dev = torch.device(device)
    now = _time_matmul(dev, torch.float32, _matmul_size(dev), 0.05, Throttle(speed))  # ~0.1 s
    if now > IMPLAUSIBLE * cached:
        logger.warning(
            "the cached profile of %s says %.1f GFLOP/s, a quick check now %.1f: measuring again",
            device,
            cached / 1e9,
            now / 1e9,
        )
        return None
    logger.info("device profile of %s from cache %s", device, path)
    return profile


def profile_device(
    device: str, *, flops_override: float | None = None, use_cache: bool = True, speed: float = 1.0
) -> DeviceProfile:
    """The profile of ``device`` (emulated at ``speed``, see ``runtime.throttle``): cached
    if measured before (and still plausible, ``_cached``), else measured and cached;
    ``use_cache=False`` (``fusionp2p peer --reprofile``) always measures."""
    if flops_override is not None:
        _, total = free_memory(device)
        return DeviceProfile(
            device=device,
            device_name=_device_name(torch.device(device)),
            flops={"float32": flops_override},
            total_memory_bytes=total,
            measured={"float32": False},
        )
    path = _cache_path(device, speed)
    profile = _cached(path, device, speed) if use_cache else None
    if profile is None:
        logger.info("measuring %s (matmul FLOP/s per dtype)...", device)
        profile = measure_device(device, speed=speed)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"cache_version": _CACHE_VERSION, **asdict(profile)}))
        except OSError as e:
            logger.info("cannot cache the device profile at %s: %s", path, e)
    return profile
