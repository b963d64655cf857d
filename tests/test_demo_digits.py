"""The digits demo end to end: a CNN split over real peer processes learns the digits."""

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "demos" / "digits_cnn.py"


def test_digits_demo_trains_over_two_peers() -> None:
    result = subprocess.run(
        [sys.executable, str(DEMO), "--peers", "2", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "stage 2:" in result.stdout  # data owner + 2 peers
    found = re.search(r"test accuracy: ([\d.]+)%", result.stdout)
    assert found, result.stdout[-2000:]
    assert float(found.group(1)) >= 80.0  # chance is 10%; two epochs reach ~95%
    assert "loss=" in result.stderr  # the progress bar with the loss per step
