"""The wheel installs one top-level package, `kvmesh`, and lives beside PyPI's `node` and `console`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# PyPI's own packages with these names: installing kvmesh beside them must break neither side.
THEIRS = ("console==0.9912", "node==2.0.0")


def test_the_wheel_has_one_top_level_package(kvmesh_wheel: Path) -> None:
    """Every module in the wheel sits under kvmesh/; no top-level node/ or console/."""
    with zipfile.ZipFile(kvmesh_wheel) as z:
        tops = {n.split("/", 1)[0] for n in z.namelist() if not n.startswith("kvmesh-")}
        top_level = next(n for n in z.namelist() if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["kvmesh"]
        assert {"kvmesh/node/cli.py", "kvmesh/console/app.py", "kvmesh/node/kvshare/wire/__init__.py"} <= set(z.namelist())
    assert tops == {"kvmesh"}


def test_kvmesh_installs_beside_pypi_node_and_console(kvmesh_wheel: Path, tmp_path: Path) -> None:
    """In a fresh venv with PyPI's `console` and `node`, `kvmesh --help` runs and `import console, node` gets theirs."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py, env = venv / "bin" / "python", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # kvmesh without its dependencies (torch and the rest are not needed for --help): the point is the names.
    subprocess.run([*pip, "--no-deps", str(kvmesh_wheel)], check=True, timeout=300, env=env, cwd=tmp_path)
    r = subprocess.run([*pip, *THEIRS], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    if r.returncode != 0:
        pytest.fail(f"installing PyPI's {THEIRS} failed: {r.stderr[-2000:]}")
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], check=True,
                          capture_output=True, text=True, env=env, cwd=tmp_path).stdout.strip()
    for cmd in ([str(venv / "bin" / "kvmesh"), "--help"], [str(py), "-m", "kvmesh", "--help"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "usage: kvmesh" in r.stdout
    # PyPI's `node` is a namespace package (no __init__.py): ask for one of its modules.
    probe = ("import console, node.base, kvmesh.node.cli, kvmesh.console;"
             "print(console.__file__); print(node.base.__file__); print(kvmesh.node.cli.__file__)")
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    theirs_console, theirs_node, ours = r.stdout.split()
    assert theirs_console == f"{site}/console/__init__.py" and theirs_node == f"{site}/node/base.py"
    assert ours == f"{site}/kvmesh/node/cli.py"
