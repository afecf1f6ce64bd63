"""The lab lives apart: the agent's runtime never imports it, and `kvmesh.node.cli` reaches it only lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvmesh.node

NODE_DIR = Path(kvmesh.node.__file__).resolve().parent
# What tests, measures or demonstrates the mesh; none of it may sit beside the agent's rooms.
CLI_FILES = ("cli.py", "benchargs.py")  # the command line: it reaches the lab, lazily
LAB_NAMES = ("bench", "chaos", "netlab", "soak", "load", "demo", "launcher", "workload", "sim",
             "inprocess", "testmodels", "checkpoints")  # what tests build on: in-process nodes, random models


def _imports(tree: ast.AST) -> set[str]:
    """Every module a tree imports, at the top, under TYPE_CHECKING or inside a function."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
    return out


def _runtime_files() -> list[Path]:
    return [p for p in sorted(NODE_DIR.rglob("*.py")) if p.relative_to(NODE_DIR).parts[0] not in ("lab", *CLI_FILES)]


def _is_lab(module: str) -> bool:
    return module == "kvmesh.node.lab" or module.startswith("kvmesh.node.lab.")


def test_lab_modules_live_under_lab() -> None:
    """Benches, drills, netlab, soak, load, demo, launcher, the workload and the test helpers are under node/lab/, not beside the agent."""
    assert (NODE_DIR / "lab" / "__init__.py").is_file()
    beside = [name for name in LAB_NAMES if (NODE_DIR / name).is_dir() or (NODE_DIR / f"{name}.py").is_file()]
    assert beside == []
    assert (NODE_DIR / "lab" / "workload.py").is_file()


def test_runtime_never_imports_the_lab() -> None:
    """No module of the engine, kvshare, mesh, api, protocol, events, config, node or server imports kvmesh.node.lab."""
    files = _runtime_files()
    assert len(files) > 40
    offenders = sorted(f"{f.relative_to(NODE_DIR).as_posix()}: {m}" for f in files
                       for m in _imports(ast.parse(f.read_text())) if _is_lab(m))
    assert offenders == []


@pytest.mark.parametrize("name", CLI_FILES)
def test_cli_imports_the_lab_only_inside_commands(name: str) -> None:
    """The CLI's modules (cli.py, benchargs.py) import nothing of the lab at module level; each lab command
    imports its module when it runs."""
    tree = ast.parse((NODE_DIR / name).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any(_is_lab(m) for m in _imports(ast.Module(body=top, type_ignores=[])))
    assert any(_is_lab(m) for m in _imports(tree))  # the lab commands are still there, lazily


def test_running_a_node_loads_no_lab_module() -> None:
    """Importing the node, its server and the CLI (as `kvmesh node` does) leaves sys.modules free of the lab."""
    code = ("import sys, kvmesh.node.node, kvmesh.node.server, kvmesh.node.api.app, kvmesh.node.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('kvmesh.node.lab')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
