"""The docs are true to the code: the README is short and its runnable blocks (and the
docs pages') run as written, every relative link resolves, and the protocol page names
every record, stream and wire limit as the code defines them.

A block is runnable when the line before its fence is a ``<!-- runnable ... -->`` comment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fusionp2p.records as records
from fusionp2p.records import limits, protocols
from fusionp2p.records.wire import WireRecord

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK_RE = re.compile(r"<!-- runnable[^>]*-->\n```(python|bash)\n(.*?)```", re.S)
BLOCKS = [block for page in PAGES for block in _BLOCK_RE.findall(page.read_text(encoding="utf-8"))]
_LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_marks_blocks_runnable() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert {lang for lang, _ in _BLOCK_RE.findall(text)} == {"python", "bash"}


@pytest.mark.parametrize(("lang", "code"), BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)])
def test_a_runnable_block_runs(lang: str, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (
        f"{code}\n--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in _LINK_RE.findall(text):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


def _records() -> list[type[WireRecord]]:
    seen: list[type[WireRecord]] = []
    todo = [WireRecord]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def test_the_protocol_page_names_every_record_stream_and_limit_as_the_code_does() -> None:
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `(\w+)` \| `(\w+)` \| (\d+) \| (\d+) \|", text, re.M)}
    found = {cls.__name__: (cls.KIND, str(cls.VERSION), str(cls.MAX_BYTES)) for cls in _records()}
    assert found and rows == found  # kind, major version and byte limit of each, and no other
    for name in protocols.__all__:
        value = getattr(protocols, name)
        if isinstance(value, str):
            assert f"`{value}`" in text, value
    for name in limits.__all__:
        assert f"`{name}`" in text, name
    assert f"| `MAX_UNACKED` | {limits.MAX_UNACKED} |" in text and records.MAX_RECORD_BYTES == 2048
