"""fusionp2p on an emulated geo-distributed network: every planner x every Top-K policy.

    make bench-wan        # = python -m benchmarks.wan (root: network namespaces and tc)
    python -m benchmarks.wan [--topology benchmarks/testbed/paper3.toml] [--steps 10]
                             [--cells op-fence/planned equal-number/none ...] [--dry-run]
                             [--out benchmarks/results]

Builds the testbed of ``--topology`` (``benchmarks/testbed``: clusters of hosts in network
namespaces, ``tc tbf`` per direction between clusters), checks each WAN direction with one
TCP flow, and starts a real ``fusionp2p peer`` in every host but the first (the data owner's),
each emulating its cluster's device speed (``--emulated-speed``; the profiler measures the
slowed device, once per speed, cached as a peer's restart would find it) and declaring its
cluster as its ``--site`` (a cluster reaches another through one shaped link, which the
planner then counts as shared by every transfer between the two). The peers measure
their links themselves; once every pair is measured, the data owner runs ``fusionp2p
train`` once per cell of {equal-number, equal-computation, OP-Fence} x {no compression,
uniform Top-K, the paper's adaptive Top-K, planned Top-K}: the elected coordinator plans
the cell's GPT-2 on what the peers published, the stages train it, and the cell reports
the mean step time after ``warmup_steps``, the plan's estimate, the data owner's
re-estimate after its first steps (``planning/calibrate.py``: each stage's speed from the
compute it reported; made before the timed steps), the loss after the fixed steps, and the
fastest emulated device measured again just before and after the cell (how far the
machine has drifted from the profile the plan used).
``--model resnet18`` runs the matrix on a ResNet-18 and scikit-learn's digits instead;
``--replicas N`` (or ``auto``) runs op-fence cells as data-parallel replicas.
Writes ``wan.json``, ``wan.md`` and ``wan.png`` under ``--out`` (``wan-resnet18.*``), and always tears down:
peers, the data owner and every namespace, also on failure or Ctrl-C.

``--dry-run`` builds nothing: it plans every cell on the topology file's nominal rates.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.testbed.netns import Host, Testbed
from benchmarks.testbed.rate import tcp_rate_mbps
from benchmarks.testbed.topology import TestbedTopology, TopologyError, load_topology
from benchmarks.testbed.wan_job import (
    MODELS,
    PLANNERS,
    POLICIES,
    EmulatedDevice,
    WanJob,
    nominal_records,
    order_spread,
    plan_cells,
)
from benchmarks.testbed.wan_report import write_report
from fusionp2p.records import TRAIN_FLOPS

logger = logging.getLogger("benchmarks.wan")

SWARM = "wan"
DEFAULT_TOPOLOGY = Path(__file__).parent / "testbed" / "paper3.toml"
PEER_ARGS = ("--probe-period", "10", "--lease-seconds", "15", "--job-idle-timeout", "120")
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # one core's worth of device per peer


def _env(cache: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **ENV, "FUSIONP2P_CACHE": str(cache), "PYTHONPATH": path}


def _python_line(code: str, args: Sequence[str], env: dict[str, str], launcher: Sequence[str]) -> str:
    """The last line ``code`` prints, run in a fresh interpreter (one thread, as a peer's
    device) behind ``launcher`` (a host's namespace, or nothing)."""
    done = subprocess.run(
        [*launcher, sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return done.stdout.strip().splitlines()[-1]


def profile_speeds(
    topo: TestbedTopology, env: dict[str, str], launcher: Sequence[str] = ()
) -> dict[float, EmulatedDevice]:
    """Measures this machine once per emulated speed (one thread), into the cache named by
    ``env`` (the peers' before they start): the fp32 matmul and the transformer-block
    training speed (``TRAIN_FLOPS``), and the Top-K coding times. ``launcher`` prefixes the
    command (a host's namespace)."""
    speeds = sorted({1.0, *(c.slowdown for c in topo.clusters)})
    code = (
        "import json, sys\n"
        "from fusionp2p.runtime.device_profile import profile_device\n"
        "ps = {s: profile_device('cpu', speed=float(s)) for s in sys.argv[1:]}\n"
        "print(json.dumps({s: [p.flops, p.topk_codec_s] for s, p in ps.items()}))"
    )
    measured = json.loads(_python_line(code, [str(s) for s in speeds], env, launcher))
    return {
        float(k): EmulatedDevice({n: flops[n] for n in ("float32", TRAIN_FLOPS)}, codec)
        for k, (flops, codec) in measured.items()
    }


def device_now(owner: Host, env: dict[str, str], speed: float) -> float:
    """Training GFLOP/s of the emulated device at ``speed``, measured now (uncached) in the
    data owner's namespace: how far this shared machine has drifted from the profile the
    peers published at start (a VM's speed moves by 1.5x within minutes here)."""
    code = (
        "import sys\n"
        "from fusionp2p.runtime.device_profile import measure_training\n"
        "print(measure_training('cpu', speed=float(sys.argv[1])))"
    )
    return float(_python_line(code, [str(speed)], env, owner.wrap([]))) / 1e9


def train_gflops(devices: dict[float, EmulatedDevice]) -> dict[str, float]:
    """Per emulated speed: its training GFLOP/s (``TRAIN_FLOPS``), keyed as in the JSON."""
    return {str(s): d.flops[TRAIN_FLOPS] / 1e9 for s, d in devices.items()}


def check_wan(testbed: Testbed) -> list[dict[str, Any]]:
    """One TCP flow per WAN direction, first host to first host: shaped vs measured."""
    rows = []
    for link in testbed.topology.wan:
        src, dst = testbed.hosts_of(link.src)[0], testbed.hosts_of(link.dst)[0]
        measured = tcp_rate_mbps(src, dst, seconds=3.0)
        rows.append({"src": link.src, "dst": link.dst, "set_mbps": link.mbps, "tcp_mbps": round(measured, 2)})
        logger.info("WAN %s -> %s: set %.0f Mbit/s, TCP %.1f Mbit/s", link.src, link.dst, link.mbps, measured)
    return rows


def _status(owner: Host, initial: list[str], env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "fusionp2p", "--log-level", "error", "status", "--json", "--swarm", SWARM]
    done = subprocess.run(
        owner.wrap([*argv, "--initial-peers", *initial]), env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode:
        raise RuntimeError(f"fusionp2p status failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def wait_for_links(
    owner: Host, initial: list[str], cluster_of: dict[str, str], env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Polls the swarm until 95% of the ordered pairs of peers are measured (or ``timeout``;
    the coordinator infers the rest, as on any swarm)."""
    n = len(cluster_of)
    deadline, doc = time.monotonic() + timeout, {}
    while True:
        doc = _status(owner, initial, env)
        pairs = {(lk["src"], lk["dst"]) for lk in doc.get("links", []) if lk["src"] in cluster_of}
        pairs = {p for p in pairs if p[1] in cluster_of}
        live = sum(1 for p in doc.get("peers", []) if p["peer_id"] in cluster_of)
        logger.info("%d/%d peers live, %d/%d links measured", live, n, len(pairs), n * (n - 1))
        if (live == n and len(pairs) >= 0.95 * n * (n - 1)) or time.monotonic() > deadline:
            return doc
        time.sleep(10)


def probe_summary(doc: dict[str, Any], cluster_of: dict[str, str], topo: TestbedTopology) -> list[dict]:
    """Median probe-measured rate per ordered cluster pair, next to its setting."""
    by_pair: dict[tuple[str, str], list[float]] = {}
    for lk in doc.get("links", []):
        a, b = cluster_of.get(lk["src"]), cluster_of.get(lk["dst"])
        if a and b:
            by_pair.setdefault((a, b), []).append(lk["bandwidth_bytes_per_s"] * 8 / 1e6)
    rows = []
    for (a, b), rates in sorted(by_pair.items()):
        setting = topo.cluster(a).host_mbps if a == b else topo.rate(a, b)
        rows.append(
            {
                "src": a,
                "dst": b,
                "set_mbps": setting,
                "links": len(rates),
                "probe_mbps": statistics.median(rates),
            }
        )
    return rows


def run_cell(
    planner: str,
    policy: str,
    job: WanJob,
    owner: Host,
    initial: list[str],
    n_peers: int,
    work: Path,
    env: dict[str, str],
    cluster_of: dict[str, str],
    timeout: float,
) -> dict[str, Any]:
    """One ``fusionp2p train`` by the data owner; its metrics and plan, or why it failed."""
    name = f"{planner}-{policy}"
    out_dir = work / "runs"
    config = work / f"{name}.toml"
    config.write_text(job.toml(planner, policy, n_peers=n_peers, out_dir=str(out_dir)))
    log = work / f"{name}.log"
    argv = [sys.executable, "-m", "fusionp2p", "--log-level", "warning", "train", "--no-progress"]
    argv += ["--config", str(config), "--swarm", SWARM, "--site", owner.cluster, "--initial-peers", *initial]
    began = time.monotonic()
    row: dict[str, Any] = {"planner": planner, "compression": policy}
    with log.open("w") as out:
        try:
            done = subprocess.run(
                owner.wrap(argv), env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            )
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    row["wall_s"] = round(time.monotonic() - began, 1)
    runs = sorted((out_dir / f"wan-{name}").glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if code != 0 or not runs:
        row["error"] = (
            f"exit {code}: " + " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])[-600:]
        )
        logger.warning("cell %s failed: %s", name, row["error"])
        return row
    steps = [json.loads(line) for line in runs[-1].read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in (runs[-1].parent / "events.jsonl").read_text().splitlines()]
    planned = next(e for e in events if e.get("event") == "planned")
    calibrated = next((e for e in events if e.get("event") == "calibrated"), {})
    timed_rows = [s for s in steps if s["step"] > job.warmup_steps]
    timed = [s["step_s"] for s in timed_rows]
    row |= {
        "method": planned.get("method"),
        "stages": len(planned.get("peers", [])),
        "clusters": [cluster_of.get(p, "?") for p in planned.get("peers", [])],
        "ratios": planned.get("ratios"),
        "estimate_s": planned.get("estimate_s"),
        "calibrated_s": calibrated.get("estimate_s"),  # after warm-up, from the stages' compute
        "calibrated_at": calibrated.get("step"),
        "step_s": statistics.mean(timed),
        "step_sd": statistics.stdev(timed) if len(timed) > 1 else 0.0,
        "loss": steps[-1]["loss"],
        "losses": [s["loss"] for s in steps],
        "replans": sum(1 for e in events if e.get("event") == "replanned"),
        # per step: the data owner's, then each stage's compute seconds, measured and planned
        "stage_compute_s": [
            round(statistics.mean(c), 3)
            for c in zip(*(s["stage_compute_s"] for s in timed_rows), strict=True)
        ],
        "stage_compute_estimate_s": planned.get("stage_compute_estimate_s"),
    }
    logger.info(
        "cell %s: %.2f s/step (estimate %.2f s, after warm-up %s s), loss %.3f, %d stage(s) on %s",
        name,
        row["step_s"],
        row["estimate_s"],
        f"{row['calibrated_s']:.2f}" if row["calibrated_s"] else "-",
        row["loss"],
        row["stages"],
        "".join(row["clusters"]),
    )
    return row


def _cells(names: list[str] | None) -> list[tuple[str, str]]:
    every = [(p, c) for p in PLANNERS for c in POLICIES]
    if not names:
        return every
    chosen = []
    for name in names:
        planner, _, policy = name.partition("/")
        if (planner, policy) not in every:
            raise SystemExit(
                f"wan: unknown cell {name!r}; cells are PLANNER/COMPRESSION, e.g. op-fence/planned"
            )
        chosen.append((planner, policy))
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default=str(DEFAULT_TOPOLOGY), help="testbed file (default: paper3)")
    parser.add_argument("--model", choices=MODELS, default="gpt2", help="the job every cell trains")
    parser.add_argument("--steps", type=int, default=WanJob.steps, help="steps per cell")
    parser.add_argument("--warmup-steps", type=int, default=WanJob.warmup_steps, help="untimed first steps")
    parser.add_argument("--cells", nargs="+", metavar="PLANNER/COMPRESSION", help="run only these cells")
    parser.add_argument(
        "--replicas",
        default="1",
        help='data-parallel replicas of every cell (op-fence cells only): N or "auto"',
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="plan every cell on nominal rates; build nothing"
    )
    parser.add_argument(
        "--orders", type=int, default=40, help="random PeerID orders the dry run draws for the baselines"
    )
    parser.add_argument("--cell-timeout", type=float, default=1200.0, help="seconds one cell may take")
    parser.add_argument("--out", default="benchmarks/results", help="where wan.json/.md/.png go")
    parser.add_argument("--keep", metavar="DIR", help="keep the peers' and cells' logs and runs in DIR")
    parser.add_argument("--report", metavar="JSON", help="only re-render the table and chart of a wan.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("fusionp2p").setLevel(logging.WARNING)
    if args.report:
        write_report(json.loads(Path(args.report).read_text()), Path(args.out), dry_run=False)
        return 0
    try:
        topo = load_topology(args.topology)  # a bad file stops here, before anything exists
    except TopologyError as e:
        print(f"wan: error: {e}", file=sys.stderr)
        return 2
    replicas: int | str = args.replicas if args.replicas == "auto" else int(args.replicas)
    job = replace(
        WanJob(), model=args.model, steps=args.steps, warmup_steps=args.warmup_steps, replicas=replicas
    )
    if not 0 <= job.warmup_steps < job.steps:
        print("wan: error: --warmup-steps must be below --steps", file=sys.stderr)
        return 2
    cells = _cells(args.cells)
    if replicas != 1 and any(planner != "op-fence" for planner, _ in cells):
        print("wan: error: --replicas needs op-fence cells only (--cells op-fence/none ...)", file=sys.stderr)
        return 2
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="fusionp2p-wan-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        env = _env(work / "cache")
        devices = profile_speeds(topo, env)
        logger.info(
            "emulated devices (training GFLOP/s, one thread; Top-K selection ns/element): %s",
            {
                s: (round(d.flops[TRAIN_FLOPS] / 1e9, 1), round(d.topk_codec_s["send_element_s"] * 1e9, 1))
                for s, d in devices.items()
            },
        )
        peers, links, nominal_clusters = nominal_records(topo, devices)
        dry = plan_cells(job, peers, links, peers[0].peer_id)
        for row in dry:
            row["clusters"] = [nominal_clusters[p] for p in row.pop("peers")]
        spread = order_spread(job, topo, devices, orders=args.orders)
        result: dict[str, Any] = {
            "topology": asdict(topo),
            "job": asdict(job),
            "devices_gflops": train_gflops(devices),
            "devices_matmul_gflops": {str(s): d.flops["float32"] / 1e9 for s, d in devices.items()},
            "devices_topk_codec_s": {str(s): d.topk_codec_s for s, d in devices.items()},
            "nominal": dry,
            "order_spread": spread,
            "machine": f"{os.cpu_count()} cores, emulated device speeds by sleeping (runtime/throttle.py)",
        }
        if args.dry_run:
            write_report(result, out, dry_run=True)
            return 0
        result["cells"] = run_matrix(topo, job, cells, work, env, args.cell_timeout, result)
    write_report(result, out, dry_run=False)
    return 0


def run_matrix(
    topo: TestbedTopology,
    job: WanJob,
    cells: list[tuple[str, str]],
    work: Path,
    env: dict[str, str],
    cell_timeout: float,
    result: dict[str, Any],
) -> list[dict[str, Any]]:
    """Builds the testbed and the swarm, runs ``cells``, tears everything down."""
    from fusionp2p.launch import LocalSwarm

    rows: list[dict[str, Any]] = []
    with Testbed(topo) as testbed:
        result["tcp_check"] = check_wan(testbed)
        owner, hosts = testbed.hosts[0], testbed.hosts[1:]
        speed = {c.name: c.slowdown for c in topo.clusters}
        swarm = LocalSwarm(
            len(hosts),
            swarm=SWARM,
            workdir=str(work / "peers"),
            launchers=[h.wrap([]) for h in hosts],
            host_maddrs=[f"/ip4/{h.ip}/tcp/0" for h in hosts],
            peer_args=[
                [*PEER_ARGS, "--emulated-speed", str(speed[h.cluster]), "--site", h.cluster] for h in hosts
            ],
            log_level="warning",
            env=env,
        )
        with swarm:
            cluster_of = {p.peer_id: hosts[p.index].cluster for p in swarm.peers}
            initial = swarm.initial_peers
            began = time.monotonic()
            doc = wait_for_links(owner, initial, cluster_of, env, timeout=240)
            result["links_measured_s"] = round(time.monotonic() - began, 1)
            result["probes"] = probe_summary(doc, cluster_of, topo)
            # the same profile again, now that the peers, their DHTs and p2pds share the cores
            # (a separate cache: the peers published the quiet one)
            own_cache = {**env, "FUSIONP2P_CACHE": str(work / "cache-in-situ")}
            in_situ = profile_speeds(topo, own_cache, owner.wrap([]))
            result["devices_in_situ_gflops"] = train_gflops(in_situ)
            logger.info(
                "emulated devices inside the idle swarm (training GFLOP/s): %s",
                {s: round(g, 1) for s, g in result["devices_in_situ_gflops"].items()},
            )
            probe_speed = max(c.slowdown for c in topo.clusters)
            result["drift_probe_speed"] = str(probe_speed)
            for planner, policy in cells:
                logger.info("cell %s/%s ...", planner, policy)
                before = device_now(owner, env, probe_speed)
                row = run_cell(
                    planner, policy, job, owner, initial, len(hosts), work, env, cluster_of, cell_timeout
                )
                row["device_gflops"] = [round(before, 2), round(device_now(owner, env, probe_speed), 2)]
                logger.info(
                    "the %gx device measured %s GFLOP/s before and after", probe_speed, row["device_gflops"]
                )
                rows.append(row)
                (work / "partial.json").write_text(json.dumps(rows))
    return rows


if __name__ == "__main__":
    sys.exit(main())
