"""Measured, not declared: how long this device takes to Top-K-code a tensor.

A compressed link costs its two peers device time besides the wire: the sender selects
the Top-K of each activation and packs it, and later unpacks the gradient; the receiver
unpacks the activation and gathers its gradient at the kept positions (``compression.wire``,
as the runtime runs it). Both sides are timed on an activation of a transformer (rows of a
hidden dimension) and of a convolution (a flat Top-K) at a light and a strong ratio, and
fitted per side as ``numel * per_element + kept * per_entry`` (``records.CODEC_TERMS``),
which is what the planner charges a compressed link (``planning.cost.codec_seconds``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from fusionp2p.compression import wire
from fusionp2p.records import CODEC_TERMS
from fusionp2p.runtime.throttle import Throttle

__all__ = ["measure_codec"]

_SHAPES = ((8, 128, 512), (8, 64, 32, 32))  # a transformer's and a CNN's activation
_RATIOS = (2.0, 50.0)


def _seconds(device: torch.device, fn: Callable[[], object], throttle: Throttle, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        fn()
        sync()

    step()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        throttle.run(step)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _side_times(
    device: torch.device, ratio: float, throttle: Throttle, repeats: int
) -> tuple[float, float, int, int]:
    """(sender seconds, receiver seconds, elements, kept entries) over ``_SHAPES``."""
    gen = torch.Generator(device=device).manual_seed(0)
    send = recv = 0.0
    numel = kept = 0
    for shape in _SHAPES:
        x = torch.randn(shape, generator=gen, device=device)
        grad = torch.randn(shape, generator=gen, device=device)
        sent = wire.encode(x, ratio, rows=True)
        back = wire.encode_at(grad, sent.indices)
        for side, work in (
            ("send", partial(wire.encode, x, ratio, rows=True)),
            ("send", partial(wire.decode_at, back.header, back.body, sent.indices)),
            ("recv", partial(wire.decode, sent.header, sent.body, device=device)),
            ("recv", partial(wire.encode_at, grad, sent.indices)),
        ):
            seconds = _seconds(device, work, throttle, repeats)
            send, recv = (send + seconds, recv) if side == "send" else (send, recv + seconds)
        numel += x.numel()
        kept += sent.header.k
    return send, recv, numel, kept


def measure_codec(device: str, *, throttle: Throttle | None = None, repeats: int = 3) -> dict[str, float]:
    """Seconds of Top-K coding on ``device`` per dense element and per kept entry, on the
    sending and the receiving side (keys ``records.CODEC_TERMS``), slowed by ``throttle``
    as the peer's compute is."""
    dev = torch.device(device)
    throttle = throttle or Throttle()
    light, strong = (_side_times(dev, r, throttle, repeats) for r in _RATIOS)
    fitted: list[float] = []
    for side in (0, 1):
        t_light, t_strong = light[side], strong[side]
        numel, k_light, k_strong = light[2], light[3], strong[3]
        per_entry = max(0.0, (t_light - t_strong) / max(1, k_light - k_strong))
        per_element = max(0.0, (t_strong - k_strong * per_entry) / numel)
        fitted += [per_element, per_entry]
    return dict(zip(CODEC_TERMS, fitted, strict=True))
