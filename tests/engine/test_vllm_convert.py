"""A GGUF's conversion for vLLM (node/engine/vllm/convert.py) when two nodes convert the same file at once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvmesh.node.engine.modelfiles import resolve
from kvmesh.node.engine.vllm.models import CONVERT

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is absent: run `make vllm` (make test does)")
def test_a_conversion_that_loses_the_race_keeps_the_winners_folder(tmp_path: Path) -> None:
    """The folder is already there whole (another node renamed its copy in first): exit 0, that folder untouched,
    no temporary left behind. Two vLLM nodes starting together on a fresh machine once failed here."""
    out = tmp_path / "SmolLM2"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"winner": True}))
    done = subprocess.run([str(VLLM_PYTHON), str(CONVERT), str(resolve("smollm2")), str(out)],
                          capture_output=True, text=True, timeout=600, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2"]
