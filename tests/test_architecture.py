"""The code keeps the layering docs/architecture.md draws: every module has one layer, no
import runs up a layer, the import graph has no circle, and the docs name only what exists.

Imports are read from the source (ast), so lazy imports inside functions and imports under
``TYPE_CHECKING`` count like any other; a package's ``__init__`` re-exporting its own
children, and a module importing its own package, are not edges (as ``import-cycles``
counts them); a module importing the top-level package is one (it is the composition layer).
"""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fusionp2p"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
_ROW = re.compile(r"^\| (\d+) \| ([^|]+) \|", re.M)
_NAME = re.compile(r"`([^`]+)`")


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@cache
def layers() -> list[tuple[int, str]]:
    """(layer, module or package prefix) for every name docs/architecture.md's table lists."""
    out = []
    for number, cell in _ROW.findall(ARCHITECTURE.read_text(encoding="utf-8")):
        for name in _NAME.findall(cell):
            if name == "__init__.py":
                out.append((int(number), "fusionp2p"))
            else:
                out.append((int(number), "fusionp2p." + name.removesuffix("/").removesuffix(".py")))
    return out


def layer_of(module: str) -> list[int]:
    """The layers whose entries hold ``module`` (a package entry holds its whole subtree)."""
    found = []
    for number, name in layers():
        whole_package = name != "fusionp2p" and module.startswith(name + ".")
        if module == name or whole_package:
            found.append(number)
    return found


def _resolve(name: str) -> str | None:
    """The longest module ``name`` falls in, or None outside the package."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, anywhere in its source."""
    path = modules()[module]
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    targets: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "fusionp2p"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            elif base.split(".")[0] != "fusionp2p":
                continue
            targets |= {_resolve(f"{base}.{a.name}") for a in node.names} | {_resolve(base)}
    return {
        t
        for t in targets
        if t is not None
        and t != module
        and not (t != "fusionp2p" and module.startswith(t + "."))  # a module and its own package
        and not (is_package and t.startswith(module + "."))  # a package re-exporting its children
    }


def test_every_module_has_exactly_one_layer() -> None:
    assert layers(), "docs/architecture.md has no layer table"
    wrong = {m: layer_of(m) for m in modules() if len(layer_of(m)) != 1}
    assert not wrong, f"modules with no layer or several in docs/architecture.md: {wrong}"


def test_no_import_runs_up_a_layer() -> None:
    upward = [
        f"{m} (layer {layer_of(m)[0]}) imports {t} (layer {layer_of(t)[0]})"
        for m in modules()
        for t in sorted(imports(m))
        if layer_of(t)[0] > layer_of(m)[0]
    ]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_circle() -> None:
    graph = {m: imports(m) for m in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def _named_paths(text: str) -> set[str]:
    """The files and folders a piece of docs names in backticks."""
    return {n for n in _NAME.findall(text) if re.fullmatch(r"[\w./-]+(/|\.py|\.md|\.toml)", n)}


def test_the_docs_name_only_what_exists() -> None:
    architecture = _named_paths(ARCHITECTURE.read_text(encoding="utf-8"))
    assert architecture
    missing = [n for n in sorted(architecture) if not (PACKAGE / n).exists() and not (ROOT / n).exists()]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
    readme = README.read_text(encoding="utf-8")
    layout = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = _named_paths(layout)
    assert "docs/architecture.md" in named
    missing = [n for n in sorted(named) if not (ROOT / n).exists() and not (PACKAGE / n).exists()]
    assert not missing, f"README's layout section names what does not exist: {missing}"


def test_an_upward_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a records module importing training would be reported."""
    bad = tmp_path / "fusionp2p" / "records" / "x.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from fusionp2p.training.job_spec import JobSpec\n")
    fake = {**modules(), "fusionp2p.records.x": bad}
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: fake)
    assert imports("fusionp2p.records.x") == {"fusionp2p.training.job_spec"}
    assert layer_of("fusionp2p.training.job_spec")[0] > layer_of("fusionp2p.records.x")[0]
