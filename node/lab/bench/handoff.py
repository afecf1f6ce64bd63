"""`kvmesh bench handoff`: two sim nodes on loopback, 16 coding-agent sessions, handoffs counted
(`--engine llamacpp` / `vllm`: each node computes with a real model).

The counters are the mesh's own (GET /v1/cluster), not the load generator's
view; decision time is the placement function's, measured inside the nodes.
Turns refused as overloaded (node.mesh.admission) are retried, as agents do,
and counted (`refused`): a refusal is no handoff and no error.
The exit status is non-zero when any turn failed (or none completed).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.bench.common import emit, llama_shape, llamacpp_engine, start_mesh, vllm_engine
from kvmesh.node.lab.launcher import client_key_headers, wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape


def _reached(api: str, want: int) -> Callable[[], Awaitable[bool]]:
    """Whether the mesh's handoff counters (its cluster view) have reached `want`."""
    async def reached() -> bool:
        async with httpx.AsyncClient(timeout=10, headers=client_key_headers()) as c:
            n = (await c.get(f"{api}/v1/cluster")).json()["counters"]
        return int(n["warm"] + n["partial"] + n["cold"]) >= want

    return reached


def _engines(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]] | None,
                                                                 dict[str, Any], dict[str, Any]]:
    """The nodes' engine (None: the sim), each node's own settings, the workload's shape and what the JSON says of it."""
    engine = llamacpp_engine(args, max_context=None)
    per_node: dict[str, dict[str, Any]] | None = None
    if (vllm := vllm_engine(args, names)) is not None:
        engine, per_node = vllm
    overrides: dict[str, Any] = {}
    said: dict[str, Any] = {"target_tokens": args.target_tokens}
    if engine is not None:  # the workload in the model's own tokens (vLLM's: a GGUF's alias, or llama.cpp's tiny)
        overrides, said = llama_shape(engine["model"])
        engine["max_context"] = said["context"]
    return engine, per_node, overrides, said


def run_handoff(args: argparse.Namespace) -> int:
    names = ["node-a", "node-b"]
    engine, per_node, overrides, said = _engines(args, names)
    kvshare = {} if args.replicate_min_tokens is None else {"replicate_min_tokens": args.replicate_min_tokens}
    with tempfile.TemporaryDirectory(prefix="kvmesh-handoff-") as tmp:
        nodes = start_mesh(Path(tmp), names, slots=args.slots, kv_scale=args.kv_scale,
                           cache_bytes=args.cache_bytes, engine=engine, overrides=per_node,
                           ready_timeout=600.0 if per_node else 60.0,
                           extra={"mesh": {"cold_move_after_s": args.cold_move_after}, "kvshare": kvshare,
                                  "api": {"event_loop": getattr(args, "event_loop", "asyncio")}})
        try:
            wait_peers(nodes)
            key = client_key_headers()
            replicate_from = httpx.get(f"{nodes[0].api}/v1/stats", headers=key, timeout=10).json().get("replicate_min_tokens")
            shape = LoadShape(sessions=args.sessions, seed=args.seed, max_tokens=args.max_tokens,
                              **{"target_tokens": args.target_tokens, **overrides})
            runner = LoadRunner([n.api for n in nodes], shape, time_scale=args.time_scale)
            # A real model on a small box moves few sessions a minute: run on until the handoffs asked for.
            want = args.min_handoffs if args.min_handoffs is not None else (20 if engine is not None else 0)
            t0 = time.monotonic()
            stats = asyncio.run(runner.run(args.duration, until=_reached(nodes[0].api, want) if want else None,
                                           max_s=args.max_duration))
            elapsed = time.monotonic() - t0
            time.sleep(1.0)  # two status polls: every node's counters are in the cluster view
            cluster = httpx.get(f"{nodes[0].api}/v1/cluster", headers=key, timeout=10).json()
            node_stats = [httpx.get(f"{n.api}/v1/stats", headers=key, timeout=10).json() for n in nodes]
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
        "loop_lag_p99_ms": max(s["loop_lag_p99_ms"] for s in node_stats),  # the worst node's
        "loop_lag_max_ms": max(s["loop_lag_max_ms"] for s in node_stats),
        "loop_lag_cpu_p99_ms": max(s["loop_lag_cpu_p99_ms"] for s in node_stats),
        "turns": load["turns"], "errors": load["errors"], "error_samples": load["error_samples"],
        "status": load["status"], "duration_s": round(elapsed, 1),
        "ttft_p50_s": load["ttft_p50_s"], "ttft_p99_s": load["ttft_p99_s"],
        "refused": load["refused"], "ttft_with_retries_p99_s": load["ttft_with_retries_p99_s"],
        "sessions": args.sessions, "kv_scale": args.kv_scale, "time_scale": args.time_scale,
        "cold_move_after_s": args.cold_move_after, "replicate_min_tokens": replicate_from,
        "engine": getattr(args, "engine", "sim"), "shape": said, "event_loop": getattr(args, "event_loop", "asyncio"),
        "min_handoffs": want,
    }
    if total < want:  # the run is too short to say what it claims
        result["errors"] += 1
        result["error_samples"] = [*result["error_samples"], f"{total} handoffs in {elapsed:.0f} s, {want} asked for"]
    return emit(result, args)  # non-zero when a turn failed: its counters describe a run that lost turns
