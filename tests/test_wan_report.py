"""The WAN benchmark's report: targets, and the machine's drift next to each cell."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.testbed.topology import load_topology
from benchmarks.testbed.wan_job import WanJob
from benchmarks.testbed.wan_report import drift, targets, write_report
from benchmarks.wan import DEFAULT_TOPOLOGY


def _cell(planner: str, policy: str, step_s: float, estimate_s: float, now: list[float]) -> dict[str, Any]:
    return {
        "planner": planner,
        "compression": policy,
        "stages": 2,
        "clusters": ["a", "a"],
        "ratios": [1.0],
        "step_s": step_s,
        "step_sd": 0.1,
        "estimate_s": estimate_s,
        "calibrated_s": step_s,
        "losses": [3.0, 2.9, 2.8],
        "stage_compute_s": [0.1, 1.0, 1.0],
        "stage_compute_estimate_s": [1.0, 1.0],
        "device_gflops": now,
    }


def test_each_cell_shows_the_machines_drift_and_the_estimate_where_it_ran_as_profiled(tmp_path: Path) -> None:
    cells = [
        _cell("equal-number", "none", 30.0, 20.0, [12.0, 14.0]),  # machine at 0.65x: slow, estimate off
        _cell("op-fence", "uniform", 3.1, 3.0, [19.0, 21.0]),  # as profiled, within 25%
        _cell("op-fence", "planned", 4.0, 3.0, [20.0, 20.0]),  # as profiled, 1.33x off
    ]
    result = {
        "topology": asdict(load_topology(DEFAULT_TOPOLOGY)),
        "job": asdict(WanJob()),
        "machine": "test",
        "devices_gflops": {"0.25": 20.0, "1.0": 80.0},
        "drift_probe_speed": "0.25",
        "nominal": [],
        "cells": cells,
    }
    assert drift(cells[0], result) == 13.0 / 20.0
    assert drift({"planner": "x"}, result) is None  # a run from before the probe existed
    write_report(result, tmp_path, dry_run=False)
    text = (tmp_path / "wan.md").read_text()
    assert "| 0.65 |" in text and "| 1.00 |" in text
    assert "within 10% of its published profile in 2/3 cells; 1 of those came within 25%" in text
    written = json.loads((tmp_path / "wan.json").read_text())
    assert written["targets"] == targets(cells)
    estimate = next(t for t in written["targets"] if "plan's estimate" in t["target"])
    assert estimate["value"].startswith("1/3 cells") and not estimate["met"]
