"""`kvmesh load --mooncake`: a Mooncake-format trace replayed as chat turns against a real node, its prefixes shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvmesh.node.lab.launcher import write_mesh


def test_a_trace_replays_with_its_shared_prefix_cached(tmp_path: Path) -> None:
    """Two conversations, three requests: all answered, and the follow-up reuses its conversation's prefix."""
    rows = [{"timestamp": 0, "input_length": 3 * 512 - 10, "output_length": 4, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": 2 * 512, "output_length": 4, "hash_ids": [7, 8]},
            {"timestamp": 300, "input_length": 5 * 512 - 3, "output_length": 4, "hash_ids": [1, 2, 3, 4, 5]}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mesh = write_mesh(tmp_path / "mesh", ["a"], engine={"kind": "sim", "slots": 2}, extra={"kvshare": {"fsync": "never"}})
    mesh.start(peers_timeout=None)
    try:
        out = subprocess.run([sys.executable, "-m", "kvmesh", "load", "--node", mesh.nodes["a"].api, "--mooncake",
                              str(trace), "--json"], capture_output=True, text=True, timeout=120)
    finally:
        mesh.stop()
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["turns"] == 3 and r["errors"] == 0 and r["conversations"] == 2, r
    # The follow-up's first three blocks' worth came from the cache: well under its whole prompt recomputed.
    assert r["prompt_tokens_recomputed"] <= r["prompt_tokens"] - 1024, r


def test_a_bad_trace_is_refused_with_its_line(tmp_path: Path) -> None:
    """A malformed trace: exit 2 naming the file and line, before any turn is sent."""
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    out = subprocess.run([sys.executable, "-m", "kvmesh", "load", "--node", "http://127.0.0.1:9", "--mooncake",
                          str(trace), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr, out.stderr
