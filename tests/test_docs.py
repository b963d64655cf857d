"""The README's runnable blocks run as written (a block is runnable when the line before
its fence is a ``<!-- runnable ... -->`` comment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK_RE = re.compile(r"<!-- runnable[^>]*-->\n```(python|bash)\n(.*?)```", re.S)
BLOCKS = _BLOCK_RE.findall(README.read_text(encoding="utf-8"))


def test_the_readme_marks_blocks_runnable() -> None:
    assert {lang for lang, _ in BLOCKS} == {"python", "bash"}


@pytest.mark.parametrize(("lang", "code"), BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)])
def test_a_runnable_readme_block_runs(lang: str, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{code}\n--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-2000:]}"
    )
