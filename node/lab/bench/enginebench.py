"""`kvmesh bench engine --against llama-server`: one host's engine against llama.cpp's own server.

Same GGUF, same threads on the same cores, same slots and context per slot, the same streaming
client and prompts, never both servers at once: a kvmesh node (llama.cpp engine, kv_share off)
first, then `llama-server` (node.lab.llamaserver). At each point (`streams` concurrent
sessions, prompts of `prompt_tokens`):
- prefill: every stream sends its prompt with max_tokens 1; prefill tok/s is the prompt tokens
  of all streams over the time until the last first token;
- decode: the same prompts again (both servers hold them now, so almost nothing is
  recomputed), `max_tokens` tokens each with `ignore_eos`; aggregate decode tok/s counts the
  content chunks of all streams that arrive while every stream is decoding.
Prompts are random text, different at every point, so no point reuses another's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.lab.bench.common import EXTRA_BUFTS, LLAMA_CONTEXT_CAP, chars_per_token, emit
from kvmesh.node.lab.launcher import pinned, write_mesh
from kvmesh.node.lab.llamaserver import LlamaServer
from kvmesh.node.lab.streamclient import StreamedTurn, TurnFailed, stream_chat
from kvmesh.node.lab.workload import text


def _prompts(seed: int, n: int, tokens: int, per_token: float) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    chars = int(tokens * per_token)
    return [[{"role": "system", "content": f"Session {seed}-{i}. " + text(rng, chars)},
             {"role": "user", "content": "Summarise the notes above."}] for i in range(n)]


def _decode_tps(turns: list[StreamedTurn]) -> float:
    """Content chunks per second, over the window in which every stream was decoding."""
    lo, hi = max(t.first_at for t in turns), min(t.last_at for t in turns)
    if hi <= lo:  # one stream, or windows that do not overlap: each stream's own rate, summed
        return sum((len(t.stamps) - 1) / (t.last_at - t.first_at) for t in turns if t.last_at > t.first_at)
    return sum(1 for t in turns for s in t.stamps if lo < s <= hi) / (hi - lo)


async def _point(url: str, model: str, streams: int, prompts: list[list[dict[str, str]]], max_tokens: int,
                 tag: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=10), limits=limits) as client:
        async def one(i: int, n: int) -> StreamedTurn:
            body = {"model": model, "messages": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True}
            return await stream_chat(client, f"{url}/v1/chat/completions", body, {"X-Session-Id": f"{tag}-{i}"})

        t0 = time.monotonic()
        first = await asyncio.gather(*(one(i, 1) for i in range(streams)))
        prefill_s = max(t.first_at for t in first) - t0
        second = await asyncio.gather(*(one(i, max_tokens) for i in range(streams)))
    return {"prompt_tokens": round(sum(t.prompt_tokens for t in first) / streams),
            "prefill_tps": sum(t.prompt_tokens for t in first) / prefill_s,
            "decode_tps": _decode_tps(second),
            "decode_recomputed": sum(t.recomputed_tokens for t in second)}


async def _measure(url: str, model: str, points: list[tuple[int, int]], per_token: float, max_tokens: int,
                   tag: str) -> list[dict[str, float]]:
    # one short turn first: graph allocation and first-touch memory are not a point's cost
    await _point(url, model, 1, _prompts(0, 1, 200, per_token), 8, f"{tag}-warmup")
    return [await _point(url, model, streams, _prompts(1000 * k + streams, streams, tokens, per_token), max_tokens,
                         f"{tag}-{k}") for k, (streams, tokens) in enumerate(points)]


def _start(who: str, work: Path, model: Path, slots: int, ctx: int, threads: int,
           cores: set[int], repack: bool) -> tuple[Callable[[], None], str]:
    """Start one server of the pair on `cores`, weights repacked or not; returns how to stop it and its URL."""
    if who == "server":
        srv = LlamaServer(model, slots=slots, ctx_per_slot=ctx, threads=threads, cores=cores,
                          log=work / "llama-server.log", repack=repack).start()
        return srv.stop, srv.url
    engine = {"kind": "llamacpp", "model": str(model), "slots": slots, "max_context": ctx,
              "cache_tokens": slots * ctx * 2, "queue_timeout_s": 1800.0,
              "llamacpp": {"threads": threads, "extra_bufts": repack}}
    mesh = write_mesh(work, ["a"], engine=engine, extra={"kvshare": {"enabled": False}})
    mesh.nodes["a"].prefix = pinned(cores)
    mesh.start(ready_timeout=300, peers_timeout=None)
    return mesh.stop, mesh.api("a")


def run_engine(args: argparse.Namespace) -> int:
    from kvmesh.node.engine.modelfiles import resolve

    model = resolve(args.model or "smollm2")
    per_token, n_ctx_train = chars_per_token(model)
    threads = args.threads or len(os.sched_getaffinity(0))
    cores = set(sorted(os.sched_getaffinity(0))[:threads])
    points = [(s, t) for s in args.streams for t in args.prompts]
    ctx = min(n_ctx_train, LLAMA_CONTEXT_CAP)  # both servers get the model's own context per slot
    weights = weight_buffers(LlamaCppConfig(extra_bufts=EXTRA_BUFTS[args.extra_bufts]))  # both sides take it
    result: dict[str, Any] = {"model": model.stem, "threads": threads, "slots": args.slots, "ctx_per_slot": ctx,
                              "max_tokens": args.max_tokens, "extra_bufts": weights.extra_bufts,
                              "weights_reason": weights.reason, "errors": 0, "error_samples": []}
    measured: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-engine-") as tmp:
        for who in ("kvmesh", "server") if args.against == "llama-server" else ("kvmesh",):
            stop, url = _start(who, Path(tmp), model, args.slots, ctx, threads, cores, weights.extra_bufts)
            try:
                measured[who] = asyncio.run(_measure(url, _served(url), points, per_token, args.max_tokens, who))
            except TurnFailed as e:
                result["errors"] += 1
                result["error_samples"].append(f"{who}: {e}")
            finally:
                stop()
    result["points"] = _points(points, measured)
    ratios = [p[k] for p in result["points"] for k in ("prefill_ratio", "decode_ratio") if p.get(k) is not None]
    result["ratio_min"] = round(min(ratios), 3) if ratios else None
    return emit(result, args)


def _served(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def _points(points: list[tuple[int, int]], measured: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    out = []
    for k, (streams, tokens) in enumerate(points):
        km = measured.get("kvmesh", [])[k] if len(measured.get("kvmesh", [])) > k else None
        sv = measured.get("server", [])[k] if len(measured.get("server", [])) > k else None
        row: dict[str, Any] = {"streams": streams, "prompt_tokens": (km or sv or {}).get("prompt_tokens", tokens),
                               "kvmesh_prefill_tps": _r(km, "prefill_tps"), "server_prefill_tps": _r(sv, "prefill_tps"),
                               "kvmesh_decode_tps": _r(km, "decode_tps"), "server_decode_tps": _r(sv, "decode_tps")}
        for kind in ("prefill", "decode"):
            a, b = row[f"kvmesh_{kind}_tps"], row[f"server_{kind}_tps"]
            row[f"{kind}_ratio"] = round(a / b, 3) if a and b else None
        out.append(row)
    return out


def _r(m: dict[str, float] | None, key: str) -> float | None:
    return round(m[key], 2) if m else None
