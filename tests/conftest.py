"""Fixtures shared by the whole suite: the project built as a wheel, the way a user installs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def kvmesh_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kvmesh wheel, built from a copy of the tree (the build leaves build/ and egg-info behind)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("node", "console", "themes"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    # kvmesh/node and kvmesh/console are links to the top-level folders: copied as links, as git keeps them.
    shutil.copytree(REPO / "kvmesh", src / "kvmesh", symlinks=True, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=240)
    (whl,) = out.glob("kvmesh-*.whl")
    return whl
