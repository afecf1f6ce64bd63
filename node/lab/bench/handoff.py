"""`kvmesh bench handoff`: two sim nodes on loopback, 16 coding-agent sessions, handoffs counted.

The counters are the mesh's own (GET /v1/cluster), not the load generator's
view; decision time is the placement function's, measured inside the nodes.
The exit status is non-zero when any turn failed (or none completed).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.llamacpp import LlamaModel
from kvmesh.node.lab.bench.common import emit, llamacpp_engine, start_mesh
from kvmesh.node.lab.launcher import wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape
from kvmesh.node.lab.workload import text

# With llama.cpp the context is the model's trained one, capped here: 4 slots of a long-context
# model on a CPU would take GBs of KV per node for turns a bench never reaches.
LLAMA_CONTEXT_CAP = 16384


def _llama_shape(args: argparse.Namespace, engine: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """LoadShape's overrides for llama.cpp, sized to the model's context, and the shape as the JSON states it.

    Conversations open at 25-30% of the context and grow in small steps (0.5-2% a turn), so a
    turn's new tokens stay under a tenth of its prompt (a move is warm only from 90% reuse), and
    end at 80% of it, so no prompt passes the context. Openings are real prefill here (2-3k
    tokens on an 8k model: 10-30 s on a shared CPU core), so they are kept as short as that allows. The workload counts characters; the model's
    own tokenizer gives characters per token on the workload's text. The sim keeps LoadShape's shape."""
    model = LlamaModel.open(engine["model"], LlamaCppConfig())
    try:
        sample = text(random.Random(0), 20_000)
        per_token = len(sample) / len(model.tokenizer.encode(sample))
        context = min(model.n_ctx_train, LLAMA_CONTEXT_CAP)
    finally:
        model.close()

    def chars(share: float) -> int:
        return int(share * context * per_token)

    opening, tool, end = (0.25, 0.30), (0.005, 0.02), 0.8
    shape = {"system_tokens": (chars(opening[0]), chars(opening[1])), "tool_tokens": (chars(tool[0]), chars(tool[1])),
             "target_tokens": chars(end)}
    said = {"context": context, "chars_per_token": round(per_token, 2), "opening_tokens": [int(x * context) for x in opening],
            "tool_tokens": [int(x * context) for x in tool], "end_tokens": int(end * context)}
    return shape, said


def run_handoff(args: argparse.Namespace) -> int:
    engine = llamacpp_engine(args, max_context=None)
    overrides: dict[str, Any] = {}
    said: dict[str, Any] = {"target_tokens": args.target_tokens}
    if engine is not None:
        overrides, said = _llama_shape(args, engine)
        engine["max_context"] = said["context"]
    kvshare = {} if args.replicate_min_tokens is None else {"replicate_min_tokens": args.replicate_min_tokens}
    with tempfile.TemporaryDirectory(prefix="kvmesh-handoff-") as tmp:
        nodes = start_mesh(Path(tmp), ["node-a", "node-b"], slots=args.slots, kv_scale=args.kv_scale,
                           cache_bytes=args.cache_bytes, engine=engine,
                           extra={"mesh": {"cold_move_after_s": args.cold_move_after}, "kvshare": kvshare})
        try:
            wait_peers(nodes)
            replicate_from = httpx.get(f"{nodes[0].api}/v1/stats", timeout=10).json().get("replicate_min_tokens")
            shape = LoadShape(sessions=args.sessions, seed=args.seed, max_tokens=args.max_tokens,
                              **{"target_tokens": args.target_tokens, **overrides})
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
        "loop_lag_p99_ms": max(s["loop_lag_p99_ms"] for s in node_stats),  # the worst node's
        "loop_lag_max_ms": max(s["loop_lag_max_ms"] for s in node_stats),
        "loop_lag_cpu_p99_ms": max(s["loop_lag_cpu_p99_ms"] for s in node_stats),
        "turns": load["turns"], "errors": load["errors"], "error_samples": load["error_samples"],
        "status": load["status"], "duration_s": round(elapsed, 1),
        "ttft_p50_s": load["ttft_p50_s"], "ttft_p99_s": load["ttft_p99_s"],
        "sessions": args.sessions, "kv_scale": args.kv_scale, "time_scale": args.time_scale,
        "cold_move_after_s": args.cold_move_after, "replicate_min_tokens": replicate_from,
        "engine": getattr(args, "engine", "sim"), "shape": said,
    }
    return emit(result, args)  # non-zero when a turn failed: its counters describe a run that lost turns
