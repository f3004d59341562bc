"""The package's shape: one `exlq` package whose client side never imports the server side,
a wire contract that imports neither, no import cycles, and a wheel with nothing but
`exlq` at its top."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Where each installed package's modules live in the repository.
FOLDERS = {
    "exlq.producer": ROOT / "producer",
    "exlq.worker": ROOT / "worker",
    "exlq.ops": ROOT / "ops",
    "exlq": ROOT / "exlq",
}


def _module_name(path: Path) -> str:
    for package, folder in FOLDERS.items():
        if package != "exlq" and folder in path.parents:
            relative = path.relative_to(folder).with_suffix("")
            break
    else:
        package, relative = "exlq", path.relative_to(ROOT / "exlq").with_suffix("")
    parts = [p for p in relative.parts if p != "__init__"]
    return ".".join([package, *parts])


def _modules() -> dict[str, Path]:
    files = [p for folder in FOLDERS.values() for p in folder.rglob("*.py")]
    return {_module_name(p): p for p in files if "__pycache__" not in p.parts}


def _imports_at_load(path: Path) -> set[str]:
    """What a module imports when it is loaded: its top level, not functions (imported
    when called) nor TYPE_CHECKING blocks."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                break
            if isinstance(child, ast.Import):
                found |= {alias.name for alias in child.names}
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found |= {f"{child.module}.{alias.name}" for alias in child.names}
    return {name for name in found if name.startswith("exlq")}


def test_the_sdk_never_imports_the_worker_and_the_protocol_neither_side() -> None:
    for name, path in _modules().items():
        imports = _imports_at_load(path)
        if name.startswith("exlq.producer"):
            assert not {i for i in imports if i.startswith("exlq.worker")}, name
        if name.startswith("exlq.ops"):
            assert not {i for i in imports if i.startswith("exlq.worker")}, name
        if name.startswith("exlq.protocol"):
            assert not {i for i in imports if i.startswith(("exlq.worker", "exlq.producer"))}, name


def test_no_module_imports_itself_through_others() -> None:
    modules = _modules()
    graph = {
        name: {i for i in _imports_at_load(path) if i in modules and i != name}
        for name, path in modules.items()
    }
    # The package root re-exports the SDK and its command assembles both sides: it imports
    # them, they do not import it back (exlq._version and exlq.protocol aside).
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_every_package_folder_is_listed_for_the_build() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found == listed


def test_the_wheel_installs_exlq_alone(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("exlq-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"exlq"}
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("exlq/producer/client.py", "exlq/worker/runner.py", "exlq/py.typed"):
        assert module in names
