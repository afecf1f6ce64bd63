"""`kvmesh bench engine`: one host's kvmesh node against the server an operator would run without it.

`--against llama-server`: a kvmesh node (llama.cpp engine, kv_share off) and llama.cpp's own
`llama-server` (node.lab.llamaserver) on the same GGUF, threads, cores, slots and context per slot.
`--against vllm`: a kvmesh node over vLLM against the same vLLM server called directly (the node's own
path, node.lab.bench.nodepath). `--against llama-server,vllm` gives both in one table; `none` measures
kvmesh alone. Both servers of a pair stay up, idle while the other is measured; at every point
(`streams` concurrent conversations, prompts of `prompt_tokens`) each side runs the same rounds from
the same client, after the same warm-up round, taking turns, repeated until the spread is known
(node.lab.bench.streams: cold TTFT and prefill tok/s, warm TTFT, decode tok/s, inter-token gaps; each
with min/median/max). Prompts are sized to the model's context (defaults: 1/32 and 1/8 of the context
per slot), and a point that does not fit is refused naming --prompts. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.lab.bench.common import EXTRA_BUFTS, LLAMA_CONTEXT_CAP, chars_per_token, emit
from kvmesh.node.lab.bench.nodepath import QUEUE_NOT_REFUSE, VllmMissing, engine_config, vllm_of, vllm_ready
from kvmesh.node.lab.bench.streams import Plan, Side, measure, ratios, say, summarize
from kvmesh.node.lab.launcher import client_key_headers, pinned, write_mesh
from kvmesh.node.lab.llamaserver import LlamaServer, LlamaServerMissing, find
from kvmesh.node.lab.streamclient import TurnFailed

AGAINST = ("llama-server", "vllm", "none")
HEADROOM = 256  # template and follow-up tokens a warm turn adds beyond the opening and two replies


def default_prompts(ctx: int) -> list[int]:
    """Two prompt sizes from the context per slot (1/32 and 1/8 of it): SmolLM2's 8k gives 256 and 1024."""
    return [max(64, ctx // 32), max(128, ctx // 8)]


def fits(prompts: list[int], max_tokens: int, ctx: int) -> str | None:
    """Why these prompt sizes do not fit a slot's context (a warm turn holds the opening, two replies and a
    follow-up), or None when they do."""
    room = ctx - 2 * max_tokens - HEADROOM
    big = [p for p in prompts if p > room]
    if not big:
        return None
    return (f"--prompts {','.join(map(str, big))} does not fit the {ctx}-token context per slot with --max-tokens "
            f"{max_tokens}: give --prompts of {room} tokens or less")


def _parse_against(v: str | list[str]) -> list[str]:
    got = [a for a in (v.split(",") if isinstance(v, str) else v) if a]
    bad = [a for a in got if a not in AGAINST]
    if bad or not got:
        raise SystemExit(f"kvmesh bench engine: --against takes a comma-separated list of {', '.join(AGAINST)}")
    return got


def run_engine(args: argparse.Namespace) -> int:
    """Check what each comparison needs, size the points, run each pair of servers; one JSON line."""
    from kvmesh.node.engine.modelfiles import resolve

    against = _parse_against(args.against)
    try:
        if "llama-server" in against:
            find()
        if "vllm" in against:
            vllm_ready()
    except (LlamaServerMissing, VllmMissing) as e:
        print(f"kvmesh bench engine: {e}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    model = resolve(args.model or "smollm2")
    per_token, n_ctx_train = chars_per_token(model)
    ctx = min(n_ctx_train, LLAMA_CONTEXT_CAP)  # both servers get the model's own context per slot
    prompts = args.prompts = args.prompts or default_prompts(ctx)
    if (why := fits(prompts, args.max_tokens, ctx)) is not None:
        print(f"kvmesh bench engine: {why}", file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    cores = set(sorted(os.sched_getaffinity(0))[:threads])
    plan = Plan([(s, t) for s in args.streams for t in prompts], args.repeats, args.max_tokens, per_token,
                budget_s=args.budget)
    weights = weight_buffers(LlamaCppConfig(extra_bufts=EXTRA_BUFTS[args.extra_bufts]))  # both sides take it
    result: dict[str, Any] = {"bench": "engine", "model": model.stem, "against": against, "threads": threads,
                              "slots": args.slots, "ctx_per_slot": ctx, "max_tokens": args.max_tokens,
                              "prompts": prompts, "streams": args.streams, "extra_bufts": weights.extra_bufts,
                              "weights_reason": weights.reason, "comparisons": {}, "errors": 0, "error_samples": []}
    for other in [a for a in against if a != "none"] or ["none"]:
        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-engine-") as tmp, contextlib.ExitStack() as stack:
            try:
                sides = _servers(other, stack, Path(tmp), model, args, ctx, threads, cores, weights.extra_bufts)
                rounds = asyncio.run(measure(sides, plan, "bench engine", t_start))
            except (TurnFailed, RuntimeError, TimeoutError, httpx.HTTPError) as e:
                result["errors"] += 1
                result["error_samples"].append(f"{other}: {type(e).__name__}: {e}"[:400])
                continue
        result["comparisons"][other] = _table(plan.points, rounds, [s.name for s in sides])
    rows = [r for c in result["comparisons"].values() for r in c]
    ratios_seen = [r[k] for r in rows for k in ("prefill_ratio", "decode_ratio") if r.get(k) is not None]
    result["ratio_min"] = round(min(ratios_seen), 3) if ratios_seen else None
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    _print_table(result["comparisons"])
    return emit(result, args)


def _servers(other: str, stack: contextlib.ExitStack, work: Path, model: Path, args: argparse.Namespace, ctx: int,
             threads: int, cores: set[int], repack: bool) -> list[Side]:
    """Start kvmesh and the server it is set against (stopped when `stack` closes); the sides to measure."""
    if other == "vllm":
        most = max(args.streams)
        engine = engine_config(str(args.model or "smollm2"), max(most, args.slots), max(args.prompts), args.max_tokens, ctx)
        mesh = write_mesh(work, ["a"], engine=engine, extra={"kvshare": {"enabled": False}, "mesh": QUEUE_NOT_REFUSE})
        say("bench engine", "starting a node over vLLM: a minute or more")
        stack.callback(mesh.stop)
        mesh.start(ready_timeout=args.start_timeout, peers_timeout=None)
        node = mesh.nodes["a"]
        assert node.proc is not None
        url, served = vllm_of(node.proc.pid)
        return [_node_side(node.api), Side("vllm", url, served)]
    engine = {"kind": "llamacpp", "model": str(model), "slots": args.slots, "max_context": ctx,
              "cache_tokens": args.slots * ctx * 2, "queue_timeout_s": 1800.0,
              "llamacpp": {"threads": threads, "extra_bufts": repack, "gpu_layers": args.gpu_layers}}
    mesh = write_mesh(work, ["a"], engine=engine, extra={"kvshare": {"enabled": False}, "mesh": QUEUE_NOT_REFUSE})
    mesh.nodes["a"].prefix = pinned(cores)
    stack.callback(mesh.stop)
    say("bench engine", f"starting a kvmesh node (llama.cpp, {threads} threads, {args.slots} slots x {ctx})")
    mesh.start(ready_timeout=args.start_timeout, peers_timeout=None)
    sides = [_node_side(mesh.api("a"))]
    if other == "llama-server":
        srv = LlamaServer(model, slots=args.slots, ctx_per_slot=ctx, threads=threads, cores=cores,
                          log=work / "llama-server.log", repack=repack, extra=gpu_args(args.gpu_layers))
        stack.callback(srv.stop)
        say("bench engine", "starting llama-server")
        srv.start()
        sides.append(Side("llama-server", srv.url, _served(srv.url)))
    return sides


def gpu_args(layers: int) -> list[str]:
    """llama-server's offload flag for kvmesh's `llamacpp.gpu_layers` (-1: all), so both sides put the same layers
    on a GPU build's device (a CUDA llama-server offloads every layer unless told)."""
    return ["-ngl", "999" if layers < 0 else str(layers)]


def _node_side(url: str) -> Side:
    key = client_key_headers()
    return Side("kvmesh", url, _served(url, key), key)


def _served(url: str, headers: dict[str, str] | None = None) -> str:
    return str(httpx.get(f"{url}/v1/models", headers=headers or {}, timeout=30).json()["data"][0]["id"])


def _table(points: list[tuple[int, int]], rounds: dict[str, list[list[dict[str, Any]]]],
           names: list[str]) -> list[dict[str, Any]]:
    """One row per point: each side's spreads and kvmesh's ratios over the other side (medians)."""
    out = []
    for k, (streams, tokens) in enumerate(points):
        per = {n: summarize(rounds[n][k]) if rounds.get(n) and rounds[n][k] else None for n in names}
        mine = per.get("kvmesh")
        other = next((per[n] for n in names if n != "kvmesh"), None)
        row: dict[str, Any] = {"streams": streams, "prompt_tokens": (mine or other or {}).get("prompt_tokens", tokens),
                               **per, **ratios(mine, other)}
        out.append(row)
    return out


def _print_table(comparisons: dict[str, list[dict[str, Any]]]) -> None:
    """The comparison table on stderr, one line per point: kvmesh's medians over the other side's."""
    for other, rows in comparisons.items():
        say("bench engine", f"kvmesh against {other}: streams x prompt | prefill | decode | cold TTFT | warm TTFT | ITL p99 +ms")
        for r in rows:
            say("bench engine", f"  {r['streams']:>2} x {r['prompt_tokens']:>6} | {r['prefill_ratio']} | {r['decode_ratio']} | "
                f"{r['cold_ttft_ratio']} | {r['warm_ttft_ratio']} | {r['itl_p99_delta_ms']}")
