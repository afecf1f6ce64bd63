"""`kvmesh bench handoff`: two sim nodes on loopback, 16 coding-agent sessions, handoffs counted.

The counters are the mesh's own (GET /v1/cluster), not the load generator's
view; decision time is the placement function's, measured inside the nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.bench import emit
from kvmesh.node.launcher import NodeProcess, merge_config, wait_peers, write_mesh
from kvmesh.node.load import LoadRunner, LoadShape


def start_mesh(work: Path, names: list[str], *, slots: int, kv_scale: float, cache_bytes: int,
               extra: dict[str, Any] | None = None) -> list[NodeProcess]:
    """The benchmarks' sim mesh on loopback (`launcher.write_mesh`), started: every node ready."""
    engine = {"kind": "sim", "slots": slots, "cache_bytes": cache_bytes, "queue_timeout_s": 600.0,
              "sim": {"kv_scale": kv_scale}}
    base: dict[str, Any] = {"kvshare": {"fsync": "never", "store_budget_bytes": 4 * cache_bytes},
                            "mesh": {"poll_interval_s": 0.25}}
    merge_config(base, extra or {})
    return list(write_mesh(work, names, engine=engine, extra=base).start(peers_timeout=None).nodes.values())


def run_handoff(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-handoff-") as tmp:
        nodes = start_mesh(Path(tmp), ["node-a", "node-b"], slots=args.slots, kv_scale=args.kv_scale,
                           cache_bytes=args.cache_bytes,
                           extra={"mesh": {"cold_move_after_s": args.cold_move_after},
                                  "kvshare": {"replicate_min_tokens": args.replicate_min_tokens}})
        try:
            wait_peers(nodes)
            shape = LoadShape(sessions=args.sessions, target_tokens=args.target_tokens, seed=args.seed,
                              max_tokens=args.max_tokens)
            runner = LoadRunner([n.api for n in nodes], shape, time_scale=args.time_scale)
            t0 = time.monotonic()
            stats = asyncio.run(runner.run(args.duration))
            elapsed = time.monotonic() - t0
            time.sleep(1.0)  # two status polls: every node's counters are in the cluster view
            cluster = httpx.get(f"{nodes[0].api}/v1/cluster", timeout=10).json()
            node_stats = [httpx.get(f"{n.api}/v1/stats", timeout=10).json() for n in nodes]
        finally:
            for n in nodes:
                n.stop()
    c = cluster["counters"]
    total = c["warm"] + c["partial"] + c["cold"]

    def pct(x: int) -> float:
        return round(100.0 * x / total, 2) if total else 0.0

    load = stats.summary()
    result = {
        "handoffs": total, "warm": c["warm"], "partial": c["partial"], "cold": c["cold"],
        "warm_pct": pct(c["warm"]), "partial_pct": pct(c["partial"]), "cold_pct": pct(c["cold"]),
        "stale_state_cold": c["stale_state_cold"],
        "decision_p99_ms": max(s["decision_p99_ms"] for s in node_stats),
        "decision_cpu_p99_ms": max(s["decision_cpu_p99_ms"] for s in node_stats),
        "turns": load["turns"], "errors": load["errors"], "duration_s": round(elapsed, 1),
        "ttft_p50_s": load["ttft_p50_s"], "ttft_p99_s": load["ttft_p99_s"],
        "sessions": args.sessions, "kv_scale": args.kv_scale, "time_scale": args.time_scale,
        "cold_move_after_s": args.cold_move_after, "replicate_min_tokens": args.replicate_min_tokens,
    }
    emit(result, args)
    return 0
