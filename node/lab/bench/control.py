"""`kvmesh bench control`: control-plane bytes per host on a real sim mesh, peers' state polled against pushed.

Three (`--hosts`) sim nodes on loopback run the same agent load twice: once with `mesh.push_state =
false` (every node polls every peer's whole status every `poll_interval_s`, 0.5 s: the default
before state was pushed), once pushed (node.mesh.statefeed: deltas at most every 0.25 s and a
heartbeat a second). Bytes are each node's own count of its peer-status traffic, both ways
(node.mesh.wirecount; websocket frames for the stream), over the load's run; per host per second.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.bench.common import emit, start_mesh
from kvmesh.node.lab.launcher import NodeProcess, wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape


def _status_bytes(nodes: list[NodeProcess]) -> int:
    total = 0
    for n in nodes:
        for per in httpx.get(f"{n.api}/v1/stats", headers=n.key_headers, timeout=10).json()["peer_wire"].values():
            total += per["in"].get("peer_status", 0) + per["out"].get("peer_status", 0)
    return total


def _run(work: Path, args: argparse.Namespace, push: bool) -> dict[str, Any]:
    names = [f"node-{chr(97 + i)}" for i in range(args.hosts)]
    nodes = start_mesh(work, names, slots=args.slots, kv_scale=0.05, cache_bytes=1 << 30,
                       extra={"mesh": {"push_state": push, "poll_interval_s": 0.5}})
    try:
        wait_peers(nodes)
        time.sleep(1.0)  # every stream (or first poll) up
        b0, t0 = _status_bytes(nodes), time.monotonic()
        runner = LoadRunner([n.api for n in nodes], LoadShape(sessions=args.sessions, seed=args.seed))
        stats = asyncio.run(runner.run(args.duration)).summary()
        secs = time.monotonic() - t0
        sessions = len(httpx.get(f"{nodes[0].api}/v1/cluster", headers=nodes[0].key_headers, timeout=10).json()["sessions"])
        rate = (_status_bytes(nodes) - b0) / secs / len(nodes)
    finally:
        for n in nodes:
            n.stop()
    return {"bytes_per_host_s": round(rate, 1), "turns": stats["turns"], "errors": stats["errors"],
            "error_samples": stats["error_samples"], "sessions_held": sessions}


def run_control(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-control-") as tmp:
        polled = _run(Path(tmp) / "polled", args, push=False)
        pushed = _run(Path(tmp) / "pushed", args, push=True)
    result = {
        "hosts": args.hosts, "sessions": args.sessions, "duration_s": args.duration,
        "polled_bytes_per_host_s": polled["bytes_per_host_s"], "pushed_bytes_per_host_s": pushed["bytes_per_host_s"],
        "pushed_over_polled": round(pushed["bytes_per_host_s"] / max(polled["bytes_per_host_s"], 1e-9), 4),
        "sessions_held": {"polled": polled["sessions_held"], "pushed": pushed["sessions_held"]},
        "turns": polled["turns"] + pushed["turns"], "errors": polled["errors"] + pushed["errors"],
        "error_samples": polled["error_samples"] + pushed["error_samples"],
    }
    return emit(result, args)
