"""Replays the plans of a kept WAN run through the schedule simulation, offline.

    python -m benchmarks.wan --keep DIR ...      # the run; DIR keeps each cell's log
    python -m benchmarks.wan_replay DIR

Each cell's log holds the plan as the data owner printed it (per stage: owner and compute
ms per micro-batch; per link: forward and backward ms); ``DIR/partial.json`` holds the
measured rows (step time, the clusters of the stages, each stage's measured compute). Per
cell this prints the measured step, the re-estimate after warm-up the run reported (the
closed form ``L + (n_b - 1)·B`` in runs before the schedule simulation existed), and
``planning.schedule.simulate`` over the same plan with the stages' compute as measured in
the timed steps, so that two models of one plan can be compared on the same inputs. A
stage's measured compute is split 1:2 between forward and backward, as the OP-DAG's
FLOPs are.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from fusionp2p.planning.cost import stage_in_flight
from fusionp2p.planning.schedule import Hop, simulate

STAGE = re.compile(r"^\s+(\d+) (\S+)\s+.*?\s([\d.]+)\s+([\d.]+)$", re.M)
LINK = re.compile(r"link (\d+)->(\d+): .*?fwd ([\d.]+) ms, bwd ([\d.]+) ms")


def replay(row: dict, log: str, n_micro_batches: int) -> float | None:
    """The simulated step of one cell with its stages' measured compute; None where the
    log's plan and the row's stages disagree."""
    peers = [m[1] for m in STAGE.findall(log)]
    measured = [c / n_micro_batches for c in row["stage_compute_s"][1:]]  # [0]: the data owner
    if len(measured) != len(peers) or len(row["clusters"]) != len(peers):
        return None
    site = row["clusters"]

    def resource(a: int, b: int) -> tuple[str, str, str] | None:
        if peers[a] == peers[b]:
            return None
        return ("site", site[a], site[b]) if site[a] != site[b] else ("pair", peers[a], peers[b])

    hops = [
        Hop(
            int(a), int(b), float(f) / 1e3, float(g) / 1e3, resource(int(a), int(b)), resource(int(b), int(a))
        )
        for a, b, f, g in LINK.findall(log)
    ]
    fwd, bwd = [c / 3 for c in measured], [2 * c / 3 for c in measured]
    return simulate(fwd, bwd, peers, hops, n_micro_batches, stage_in_flight(n_micro_batches, peers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keep", help="the --keep directory of a benchmarks.wan run")
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args(argv)
    keep = Path(args.keep)
    rows = [r for r in json.loads((keep / "partial.json").read_text()) if "step_s" in r]
    print(
        f"{'cell':<28} {'measured s':>10} {'reported s':>10} {'meas/rep':>8} "
        f"{'schedule s':>10} {'meas/sch':>8}"
    )
    errors: dict[str, list[float]] = {"reported re-estimate": [], "schedule replayed": []}
    for r in rows:
        log = (keep / f"{r['planner']}-{r['compression']}.log").read_text()
        played, reported = replay(r, log, args.micro_batches), r.get("calibrated_s")
        if played is None or not reported:
            print(f"{r['planner'] + '/' + r['compression']:<28} (plan and measurements disagree)")
            continue
        errors["reported re-estimate"].append(abs(r["step_s"] / reported - 1))
        errors["schedule replayed"].append(abs(r["step_s"] / played - 1))
        print(
            f"{r['planner'] + '/' + r['compression']:<28} {r['step_s']:>10.2f} {reported:>10.2f} "
            f"{r['step_s'] / reported:>8.2f} {played:>10.2f} {r['step_s'] / played:>8.2f}"
        )
    for name, errs in errors.items():
        if errs:
            inside = sum(e <= 0.25 for e in errs)
            print(
                f"{name}: mean |measured/estimate - 1| {statistics.mean(errs):.1%}, worst {max(errs):.1%}, "
                f"{inside}/{len(errs)} cells within 25%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
