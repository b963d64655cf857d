"""Top-K compression: speed against torch.topk + scatter, and bytes on the wire.

    python benchmarks/compression_bench.py [--sizes 1e4 1e5 1e6 1e7 1e8] [--ratios 10 100 1000]

Per size and ratio: the time to select (torch.topk vs fusionp2p's path), the time of a
full compress + decompress round trip (torch.topk + gather + scatter vs encode + decode of
the wire format), the recall of the selection against torch.topk (exact k: 1.000 means
the same set), and the bytes on the wire: dense fp32, FusionLLM's fp32 + int64, ours
(fp32 values and fp16 values). Runs on CUDA too when there is one (--device cuda).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from fusionp2p.compression import decode, encode, k_for_ratio, paper_bytes, topk_indices, topk_reference


def _time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def row(x: torch.Tensor, ratio: float, repeats: int, sync: Callable[[], None]) -> str:
    """One table row: selection and round-trip times, recall, and bytes, for one size and ratio."""
    n = x.numel()
    k = k_for_ratio(n, ratio)

    def ref_select() -> torch.Tensor:
        return torch.topk(x.abs(), k, sorted=False).indices

    def ref_round_trip() -> torch.Tensor:
        idx = torch.topk(x.abs(), k, sorted=False).indices
        return torch.zeros_like(x).scatter_(0, idx, x.gather(0, idx))

    def ours_round_trip() -> torch.Tensor:
        enc = encode(x, ratio)
        return decode(enc.header, enc.body, device=x.device)

    t_ref = _time(ref_select, repeats, sync)
    t_ours = _time(lambda: topk_indices(x, k), repeats, sync)
    r_ref = _time(ref_round_trip, repeats, sync)
    r_ours = _time(ours_round_trip, repeats, sync)
    got = topk_indices(x, k).cpu()
    recall = (
        len(set(got.tolist()) & set(topk_reference(x, k).cpu().tolist())) / k if n <= 10**7 else float("nan")
    )
    enc32, enc16 = encode(x, ratio), encode(x, ratio, value_dtype="float16")
    return (
        f"{n:>9.0e} {ratio:>5.0f} {t_ref * 1e3:>9.2f} {t_ours * 1e3:>9.2f} {t_ref / t_ours:>6.1f} "
        f"{recall:>6.3f} | {r_ref * 1e3:>15.2f} {r_ours * 1e3:>16.2f} {r_ref / r_ours:>6.1f} | "
        f"{4 * n / 1e6:>9.3f} {paper_bytes(k) / 1e6:>9.3f} "
        f"{enc32.nbytes / 1e6:>8.3f} {enc16.nbytes / 1e6:>8.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7, 1e8])
    parser.add_argument("--ratios", type=float, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; best of 3-5 runs")
    print(
        f"{'numel':>9} {'ratio':>5} {'topk ms':>9} {'ours ms':>9} {'x':>6} {'recall':>6} | "
        f"{'topk+scatter ms':>15} {'encode+decode ms':>16} {'x':>6} | {'dense MB':>9} {'paper MB':>9} "
        f"{'ours MB':>8} {'fp16 MB':>8}"
    )
    for size in args.sizes:
        x = torch.randn(int(size), device=device)
        for ratio in args.ratios:
            print(row(x, ratio, 3 if size >= 1e8 else 5, sync), flush=True)
        del x


if __name__ == "__main__":
    main()
