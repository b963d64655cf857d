"""The device profile is measured, cached per device, and overridable."""

import json
import os
import time

import pytest

from fusionp2p.errors import ProfileError
from fusionp2p.records import CODEC_TERMS
from fusionp2p.runtime.device_profile import free_memory, measure_device, profile_device


def test_measure_cpu_reports_positive_flops_and_memory() -> None:
    profile = measure_device("cpu", budget_s=0.05)
    assert profile.flops["float32"] > 1e8
    assert all(v > 0 for v in profile.flops.values())
    assert profile.total_memory_bytes > 0 and profile.measured["float32"]
    assert set(profile.topk_codec_s) == set(CODEC_TERMS)
    assert profile.topk_codec_s["send_element_s"] > 0 and profile.topk_codec_s["send_entry_s"] > 0
    assert all(0 <= v < 1e-5 for v in profile.topk_codec_s.values())  # seconds per element or entry
    free, total = free_memory("cpu")
    assert 0 < free <= total


def test_profile_is_cached_and_flops_override_skips_measuring(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FUSIONP2P_CACHE", str(tmp_path))
    first = profile_device("cpu")
    assert list(tmp_path.glob("profile-*.json"))
    start = time.perf_counter()
    again = profile_device("cpu")
    assert time.perf_counter() - start < 0.5  # read, not re-measured
    assert again.flops == first.flops
    declared = profile_device("cpu", flops_override=5e12)
    assert declared.flops == {"float32": 5e12} and declared.measured == {"float32": False}


@pytest.mark.slow  # measures this machine's device several times (10 s here)
def test_a_cached_profile_that_is_implausible_or_old_or_unwanted_is_measured_again(
    tmp_path, monkeypatch
) -> None:
    """Issue 34, trip 10: a profile taken under load (12.3 GFLOP/s on a machine that gives
    174) was reused by every later peer."""
    monkeypatch.setenv("FUSIONP2P_CACHE", str(tmp_path))
    first = profile_device("cpu")
    (path,) = tmp_path.glob("profile-*.json")

    def cache(**changes: object) -> None:
        raw = json.loads(path.read_text())
        raw.update(changes)
        path.write_text(json.dumps(raw))

    cache(flops={**first.flops, "float32": first.flops["float32"] / 100})  # taken under heavy load
    again = profile_device("cpu")
    assert again.flops["float32"] > first.flops["float32"] / 10  # measured again ...
    assert json.loads(path.read_text())["flops"] == again.flops  # ... and cached
    cache(device_name="marked")
    assert profile_device("cpu").device_name == "marked"  # plausible and fresh: read
    assert profile_device("cpu", use_cache=False).device_name != "marked"  # fusionp2p peer --reprofile
    cache(device_name="marked")
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(path, (week_ago, week_ago))
    assert profile_device("cpu").device_name != "marked"  # too old


def test_missing_cuda_is_a_clear_error(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match="CUDA is not available"):
        measure_device("cuda:0")


@pytest.mark.slow  # profiles an emulated device a quarter as fast (9 s here)
def test_an_emulated_slower_device_takes_longer_and_measures_slower(tmp_path, monkeypatch) -> None:
    from fusionp2p.errors import ConfigError
    from fusionp2p.runtime.throttle import Throttle

    def work() -> int:  # 20 ms of this thread's CPU
        began = time.thread_time()
        while time.thread_time() - began < 0.02:
            pass
        return 7

    start = time.perf_counter()
    assert Throttle(0.25).run(work) == 7
    assert time.perf_counter() - start >= 0.08  # 4x the work's CPU time
    start = time.perf_counter()
    Throttle(0.25).run(lambda: time.sleep(0.3))  # waiting is not work: no CPU, no extra sleep
    assert time.perf_counter() - start < 0.8  # a throttle that counted the wait would take 1.2 s
    with pytest.raises(ConfigError, match="in \\(0, 1\\]"):
        Throttle(1.5)

    def slowdowns() -> tuple[float, float]:
        """The 0.2x device's FLOP/s over full speed's, and its Top-K coding time over full speed's."""
        full, slowed = measure_device("cpu", budget_s=0.2), measure_device("cpu", budget_s=0.2, speed=0.2)
        numel, kept = 1e6, 1e5
        coding = [
            p.topk_codec_s["send_element_s"] * numel + p.topk_codec_s["send_entry_s"] * kept
            for p in (full, slowed)
        ]
        return slowed.flops["float32"] / full.flops["float32"], coding[1] / coding[0]

    # ~0.2x and ~5x; a busy machine can slow the full-speed run alone, so up to 3 tries
    for _ in range(3):
        flops, coding = slowdowns()
        if flops < 0.4 and coding > 2:
            break
    assert flops < 0.4  # measured slower
    assert coding > 2  # Top-K coding slows down with the device: what a compressed link costs a slow peer
    monkeypatch.setenv("FUSIONP2P_CACHE", str(tmp_path))
    profile_device("cpu", speed=0.2)
    assert [p.name for p in tmp_path.glob("profile-*speed0.2.json")]  # cached apart from full speed


def test_a_rate_is_the_median_run_so_one_outlier_does_not_become_the_published_speed() -> None:
    from fusionp2p.runtime.device_profile import median_rate

    durations = iter([0.0, 0.01, 0.2, 0.01, 0.01, 0.01])  # warm-up, then one run 20x slow
    calls = []

    def run() -> None:
        calls.append(1)
        time.sleep(next(durations))

    rate = median_rate(run, 1e9, budget_s=0.0, max_runs=100, min_runs=5)
    assert len(calls) == 6  # the untimed warm-up and min_runs timed runs, though the budget is 0
    assert 0.6e11 < rate <= 1e11  # ~1e9 / 10 ms; the mean of the runs would read 2.2e10
    calls.clear()
    durations = iter([0.0] * 10)
    median_rate(run, 1.0, budget_s=10.0, max_runs=3, min_runs=1)
    assert len(calls) == 4  # max_runs bounds it however much budget is left
