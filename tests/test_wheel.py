"""The package as a user installs it: the sdist builds, a wheel built from it installs in a
fresh venv and runs the CLI and a tiny local job from ``/``, and the code parses on the
oldest Python that pyproject.toml declares (issue 34)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from process_helpers import run_grouped

ROOT = Path(__file__).resolve().parents[1]
TINY_JOB = """name = "wheel"
[model.config]
vocab_size = 256
n_positions = 16
n_embd = 16
n_layer = 1
n_head = 2
[data]
seq_len = 16
max_bytes = 20000
[train]
steps = 2
batch_size = 2
micro_batch_size = 1
min_peers = 2
[output]
dir = "{runs}"
"""


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{args}: {done.stderr[-2000:]}"
    return done.stdout


def _sdist(out: Path) -> Path:
    """The sdist of the clone, built into ``out`` (nothing is built inside the clone)."""
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    name = _run(sys.executable, "-c", build, out, cwd=ROOT).strip().splitlines()[-1]
    assert name.startswith("fusionp2p-") and (out / name).is_file()
    return out / name


def test_a_wheel_built_from_the_sdist_runs_from_a_fresh_venv_outside_the_clone(tmp_path: Path) -> None:
    wheels, venv, runs = tmp_path / "wheels", tmp_path / "venv", tmp_path / "runs"
    sdist = _sdist(tmp_path)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, sdist, cwd=tmp_path)
    (wheel,) = wheels.glob("fusionp2p-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fusionp2p").rglob("__init__.py")}
    assert packages <= shipped, sorted(packages - shipped)  # every subpackage, not a stale list
    # a fresh venv; its dependencies (torch, hivemind, ...) are this venv's, read through a
    # .pth file (not a site directory: this venv's editable install of the clone stays out)
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (site / "dependencies.pth").write_text("\n".join(deps) + "\n")
    python, cli = venv / "bin" / "python", venv / "bin" / "fusionp2p"
    _run(*pip, "--python", python, "install", "--no-deps", "--no-compile", wheel, cwd=tmp_path)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    where = _run(python, "-c", "import fusionp2p; print(fusionp2p.__file__)", cwd=Path("/"), env=env)
    assert Path(where.strip()).is_relative_to(site)  # the wheel, not the clone
    source = "from fusionp2p.kernels import cuda_source; print(cuda_source('select_above.cu'))"
    assert "void select_above(" in _run(python, "-c", source, cwd=Path("/"), env=env)  # package data
    assert "fusionp2p" in _run(cli, "--help", cwd=Path("/"), env=env)
    example = _run(cli, "train", "--example-config", cwd=Path("/"), env=env)
    assert tomllib.loads(example)  # a job file a user can start from
    config = tmp_path / "job.toml"
    config.write_text(TINY_JOB.format(runs=runs))
    done, left = run_grouped(
        [str(cli), "--log-level", "error", "train", "--local", "2", "--config", str(config), "--no-progress"],
        timeout=300,
        env=env,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained 2 steps" in done.stdout and not left


def test_the_cuda_sources_live_in_kernels_and_never_shadow_the_hubs_kernels_package() -> None:
    from fusionp2p.kernels import cuda_source

    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert cuda_source("select_above.cu") == (ROOT / "kernels" / "select_above.cu").read_text()
    probe = (
        "import importlib.util as u; s = u.find_spec('kernels')\n"
        "print(*([s.origin or '', *(s.submodule_search_locations or [])] if s else []), sep='\\n')"
    )
    found = _run(sys.executable, "-c", probe, cwd=ROOT).split()  # the clone is on sys.path here
    assert not any(Path(p).is_relative_to(ROOT / "kernels") for p in found), found


def test_the_code_parses_on_the_oldest_python_it_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = tuple(int(part) for part in declared.removeprefix(">=").split("."))
    assert oldest == (3, 11)  # asyncio.timeout, tomllib and except* need it
    for path in [*(ROOT / "fusionp2p").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        ast.parse(path.read_text(), str(path), feature_version=oldest)  # type: ignore[arg-type]
