"""The scale simulator (benchmarks/scale_sim.py) at 200 peers: 200 signed identities on 3
real DHT nodes, their bounded probes, the coordinator's view and a plan on inferred links."""

import json
import subprocess
import sys
from pathlib import Path

SIM = Path(__file__).parent.parent / "benchmarks" / "scale_sim.py"


def test_200_simulated_peers_are_read_completely_and_planned_on_inferred_links(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, str(SIM), "--peers", "200", "--plan-peers", "--rounds", "40", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["peers_read"] == 200 and row["links_read"] == row["links"] > 0
    assert row["view_complete"] and row["warm_link_reads"] == 0  # a warm refresh reads no links again
    assert row["largest_key_bytes"] < 64 << 10
    assert row["measured_fraction"] < 0.5  # probes are bounded: most pairs are inferred
    assert row["median_rel_error"] < 0.25
    assert row["gap_vs_true_plan"] < 0.10  # the plan on inferred links vs the plan on the truth
    assert "| 200 |" in (tmp_path / "sim.md").read_text()
