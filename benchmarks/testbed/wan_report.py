"""The WAN benchmark's outputs: ``wan.json``, a Markdown table with the targets, a bar chart
(``wan-resnet18.*`` for the ResNet-18 matrix)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.testbed.wan_job import PLANNERS, POLICIES, WanJob

__all__ = ["compute_ratio", "drift", "final_loss", "targets", "write_report"]

SPEEDUP_VS_NAIVE = 10.0  # OP-Fence + planned vs equal-number without compression
SPEEDUP_VS_BASELINE = 1.5  # ... vs the best baseline cell
ESTIMATE_TOLERANCE = 0.25  # |measured / estimate - 1| in every cell


def _cell(rows: list[dict[str, Any]], planner: str, policy: str) -> dict[str, Any] | None:
    return next(
        (r for r in rows if r["planner"] == planner and r["compression"] == policy and "step_s" in r), None
    )


LOSS_STEPS = 3  # "loss after the fixed steps": the mean of the last few (one step's loss is noisy)


def final_loss(row: dict[str, Any]) -> float:
    """The mean training loss of a cell's last ``LOSS_STEPS`` steps."""
    losses = row["losses"][-LOSS_STEPS:]
    return sum(losses) / len(losses)


def compute_ratio(row: dict[str, Any]) -> float | None:
    """The median over stages of measured / estimated compute seconds per step (the
    stages report theirs with every step; the data owner's own entry comes first)."""
    measured, planned = row.get("stage_compute_s") or [], row.get("stage_compute_estimate_s") or []
    if len(measured) != len(planned) + 1:
        return None  # a peer ran two plan stages as one runtime stage
    ratios = sorted(m / e for m, e in zip(measured[1:], planned, strict=True) if e > 0)
    return ratios[len(ratios) // 2] if ratios else None


def drift(row: dict[str, Any], result: dict[str, Any]) -> float | None:
    """The emulated device's training speed measured around the cell (the mean of before
    and after) over the profile the peers published: 1 where the machine ran as profiled."""
    speed, now = result.get("drift_probe_speed"), row.get("device_gflops")
    if not speed or not now:
        return None
    return sum(now) / len(now) / result["devices_gflops"][speed]


STEADY = 0.10  # a cell's machine "ran as profiled" within this drift


def _steady_cells(result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """How the plan's estimate fares where the machine ran as it was profiled."""
    drifts = [(r, drift(r, result)) for r in rows]
    if all(d is None for _, d in drifts):
        return ""
    steady = [r for r, d in drifts if d is not None and abs(d - 1) <= STEADY]
    inside = sum(abs(r["step_s"] / r["estimate_s"] - 1) <= ESTIMATE_TOLERANCE for r in steady)
    return (
        f"The {result['drift_probe_speed']}x device, measured again just before and after each cell "
        f"(column device now/profile), ran within {STEADY:.0%} of its published profile in "
        f"{len(steady)}/{len(rows)} cells; {inside} of those came within {ESTIMATE_TOLERANCE:.0%} of "
        "the plan's estimate."
    )


def _name(row: dict[str, Any]) -> str:
    return f"{row['planner']}/{row['compression']}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 15: what it asks, what was measured, met or not."""
    out: list[dict[str, Any]] = []
    ours, naive = _cell(rows, "op-fence", "planned"), _cell(rows, "equal-number", "none")
    baselines = [r for r in rows if r["planner"] != "op-fence" and "step_s" in r]
    if ours and naive:
        x = naive["step_s"] / ours["step_s"]
        out.append(
            {
                "target": f"OP-Fence+planned >= {SPEEDUP_VS_NAIVE:g}x equal-number/none",
                "value": f"{x:.2f}x",
                "met": x >= SPEEDUP_VS_NAIVE,
            }
        )
    if ours and baselines:
        best = min(baselines, key=lambda r: r["step_s"])
        x = best["step_s"] / ours["step_s"]
        out.append(
            {
                "target": f"OP-Fence+planned >= {SPEEDUP_VS_BASELINE:g}x the best baseline cell",
                "value": f"{x:.2f}x ({best['planner']}/{best['compression']})",
                "met": x >= SPEEDUP_VS_BASELINE,
            }
        )
    for key, what in (
        ("estimate_s", "the plan's estimate"),
        ("calibrated_s", "the re-estimate after warm-up"),
    ):
        measured = [r for r in rows if "step_s" in r and r.get(key)]
        if not measured:
            continue
        worst = max(measured, key=lambda r: abs(r["step_s"] / r[key] - 1))
        ratio = worst["step_s"] / worst[key]
        inside = sum(abs(r["step_s"] / r[key] - 1) <= ESTIMATE_TOLERANCE for r in measured)
        out.append(
            {
                "target": f"measured within {ESTIMATE_TOLERANCE:.0%} of {what} in every cell",
                "value": f"{inside}/{len(measured)} cells; worst {ratio:.2f}x ({_name(worst)})",
                "met": inside == len(measured),
            }
        )
    for planner in PLANNERS:
        planned, uniform = _cell(rows, planner, "planned"), _cell(rows, planner, "uniform")
        if planned and uniform:
            out.append(
                {
                    "target": f"{planner}: planned loss <= uniform loss after the fixed steps",
                    "value": f"{final_loss(planned):.3f} vs {final_loss(uniform):.3f}",
                    "met": final_loss(planned) <= final_loss(uniform),
                }
            )
    return out


def _speeds(gflops: dict[str, float]) -> str:
    return ", ".join(f"{s}x: {g:.1f}" for s, g in gflops.items())


def _markdown(result: dict[str, Any], dry_run: bool) -> str:
    topo, job = result["topology"], result["job"]
    lines = [f"# WAN benchmark: {topo['name']}", ""]
    clusters = ", ".join(
        f"{c['name']}: {c['hosts']} hosts at {c['slowdown']:g}x speed, {c['host_mbps']:g} Mbit/s host links"
        for c in topo["clusters"]
    )
    wan = ", ".join(f"{w['src']}->{w['dst']} {w['mbps']:g}" for w in topo["wan"])
    lines += [
        f"Clusters {clusters}. WAN (Mbit/s): {wan}. The first host of the first cluster is the data owner.",
        f"Model: {WanJob(**job).describe()}, "
        f"micro-batch {job['micro_batch']}, {job['batch'] // job['micro_batch']} micro-batches per step; "
        f"{job['steps']} steps, "
        f"the first {job['warmup_steps']} untimed; Top-K max ratio {job['max_ratio']:g}.",
        f"Machine: {result['machine']}. Emulated devices ("
        + (
            "training GFLOP/s of a transformer block"
            if "devices_matmul_gflops" in result
            else "fp32 matmul GFLOP/s"
        )
        + "): "
        + _speeds(result["devices_gflops"])
        + (
            "; measured again inside the idle swarm (its peers, DHTs and p2pds sharing the cores): "
            + _speeds(result["devices_in_situ_gflops"])
            if result.get("devices_in_situ_gflops")
            else ""
        )
        + ".",
        "",
    ]
    if result.get("tcp_check"):
        lines += ["| WAN direction | set Mbit/s | one TCP flow Mbit/s |", "|---|---:|---:|"]
        lines += [
            f"| {r['src']} -> {r['dst']} | {r['set_mbps']:g} | {r['tcp_mbps']:.1f} |"
            for r in result["tcp_check"]
        ]
        lines.append("")
    if result.get("probes"):
        lines += [
            "Links measured by the peers' own probes "
            f"({result.get('links_measured_s', 0):.0f} s after start):",
            "",
            "| clusters | set Mbit/s | links | median probe Mbit/s |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {r['src']} -> {r['dst']} | {r['set_mbps']:g} | {r['links']} | {r['probe_mbps']:.1f} |"
            for r in result["probes"]
        ]
        lines.append("")
    rows = result.get("cells", [])
    if rows:
        naive = _cell(rows, "equal-number", "none")
        lines += [
            "| planner | compression | stages (clusters) | Top-K ratios | measured s/step | estimate s "
            "| meas/est | compute meas/est | device now/profile | after warm-up s | meas/after "
            f"| loss, steps {job['steps'] - LOSS_STEPS + 1}-{job['steps']} | vs equal-number/none |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if "step_s" not in r:
                lines.append(
                    f"| {r['planner']} | {r['compression']} | failed: {r.get('error', '?')[:120]} "
                    "| | | | | | | | | | |"
                )
                continue
            ratios = r["ratios"] or [1.0]
            span = f"{min(ratios):g}" if len(ratios) == 1 else f"{min(ratios):g}-{max(ratios):g}"
            speedup = f"{naive['step_s'] / r['step_s']:.2f}x" if naive else "-"
            after = r.get("calibrated_s")
            lines.append(
                f"| {r['planner']} | {r['compression']} | {r['stages']} ({''.join(r['clusters'])}) | {span} "
                f"| {r['step_s']:.2f} ± {r['step_sd']:.2f} | {r['estimate_s']:.2f} "
                f"| {r['step_s'] / r['estimate_s']:.2f} | {_fmt(compute_ratio(r))} "
                f"| {_fmt(drift(r, result))} | {_fmt(after)} "
                f"| {_fmt(r['step_s'] / after if after else None)} "
                f"| {final_loss(r):.3f} | {speedup} |"
            )
        steady = _steady_cells(result, [r for r in rows if "step_s" in r])
        lines += ["", steady] if steady else []
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [
            f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'NO'} |" for t in result["targets"]
        ]
        lines.append("")
    lines += [
        "Plans on the topology file's nominal rates (cost model only"
        + (", `--dry-run`" if dry_run else ", before the peers measured anything")
        + "):",
        "",
        "| planner | compression | stages (clusters) | estimate s |",
        "|---|---|---|---:|",
    ]
    lines += [
        f"| {r['planner']} | {r['compression']} | {r['stages']} ({''.join(r['clusters'])}) "
        f"| {r['estimate_s']:.2f} |"
        for r in result["nominal"]
    ]
    spread = result.get("order_spread")
    if spread:
        naive, ours = spread["equal-number/none"], spread["op-fence/planned"]
        mid = naive[len(naive) // 2]
        lines += [
            "",
            f"The baselines take peers in PeerID order, a draw: over {spread['orders']} random PeerID "
            f"assignments on the nominal rates, equal-number/none is estimated at {naive[0]:.2f}-"
            f"{naive[-1]:.2f} s (median {mid:.2f} s), OP-Fence/planned at {ours[0]:.2f}-{ours[-1]:.2f} s: "
            f"{mid / ours[len(ours) // 2]:.2f}x at the median, {naive[0] / ours[0]:.2f}-"
            f"{naive[-1] / ours[-1]:.2f}x over the draws.",
        ]
    return "\n".join(lines) + "\n"


def _chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.get("cells", []) if "step_s" in r]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(POLICIES)
    for k, policy in enumerate(POLICIES):
        xs, ys, est, after = [], [], [], []
        for i, planner in enumerate(PLANNERS):
            r = _cell(rows, planner, policy)
            if r:
                xs.append(i + (k - (len(POLICIES) - 1) / 2) * width)
                ys.append(r["step_s"])
                est.append(r["estimate_s"])
                after.append(r.get("calibrated_s") or float("nan"))
        ax.bar(xs, ys, width, label=policy)
        ax.scatter(xs, est, marker="_", s=200, color="black", zorder=3, label="estimate" if k == 0 else None)
        ax.scatter(
            xs, after, marker="x", s=30, color="black", zorder=3, label="after warm-up" if k == 0 else None
        )
    ax.set_xticks(range(len(PLANNERS)), PLANNERS)
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step (log)")
    ax.set_title(
        f"fusionp2p on the emulated WAN '{result['topology']['name']}': measured (bars), estimates (—, x)"
    )
    ax.legend(title="Top-K", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], out: Path, *, dry_run: bool) -> None:
    """Writes wan.json, wan.md (and wan.png after a run) under ``out`` (wan-resnet18.* for
    the ResNet); prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    model = result["job"].get("model", "gpt2")
    stem = ("wan" if model == "gpt2" else f"wan-{model}") + ("-dry-run" if dry_run else "")
    if not dry_run:
        result["targets"] = targets(result.get("cells", []))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = _markdown(result, dry_run)
    (out / f"{stem}.md").write_text(text)
    if not dry_run and result.get("cells"):
        _chart(result, out / f"{stem}.png")
    print(text)
