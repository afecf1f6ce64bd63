"""`kvmesh bench nodepath`: what the node's own path costs a turn, measured apart from the engine.

With `engine.kind = "vllm"` the engine is a server of its own, so the node's cost shows alone: one
kvmesh node over vLLM, and the same vLLM server (the one the node started) called directly, with the
same client, the same prompts and the same streamed chat turns, the two sides taking turns at every
point (node.lab.bench.streams). What differs is only the node's path: its HTTP front (FastAPI, the
dialect's parsing and SSE rendering), the turn path (placement, the session table, the block plan) and
vLLM's completions stream read back through it, plus kvmesh's KV connector storing the turn's blocks.
Per point (1, 4 and 16 streams by default) the cold and warm TTFT, the decode rate and the inter-token
gaps of each side, and kvmesh's over vLLM's; the top-level keys name the issue's targets at the fewest
and the most streams (cold TTFT <= 1.05x, decode >= 0.95x, inter-token p99 at most 2 ms above).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvmesh.node.lab.bench.common import emit
from kvmesh.node.lab.bench.streams import Plan, Side, measure, ratios, say, summarize
from kvmesh.node.lab.launcher import LocalMesh, client_key_headers, write_mesh
from kvmesh.node.lab.streamclient import TurnFailed

# A bench's turns queue for a slot rather than be refused as overloaded (mesh.admit_wait_s): a turn sent as the
# previous one's stream ends can find its slot not yet released, and vLLM called directly never refuses one.
QUEUE_NOT_REFUSE = {"admit_wait_s": 1800.0, "admit_new_wait_s": 1800.0}
TARGETS = {"cold_ttft_ratio_max": 1.05, "decode_ratio_min": 0.95, "itl_p99_delta_ms_max": 2.0}
REPO = Path(__file__).resolve().parents[3]


class VllmMissing(RuntimeError):
    """No Python with vLLM where the node would look for one; the message says how to install it."""


def vllm_ready(python: str = "") -> str:
    """The Python that runs vLLM (as node.engine.vllm.server picks it), checked to import vllm; VllmMissing otherwise."""
    import subprocess

    from kvmesh.node.engine.vllm.server import vllm_python

    py = vllm_python(python)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([py, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise VllmMissing(f"no vLLM in {py}: run `make vllm` (its CPU build into .venv-vllm, ~2 min; on a CUDA host "
                          "`make vllm VLLM_PACKAGE=vllm`)")
    return py


def model_facts(model: str) -> tuple[int, float]:
    """The context of the model vLLM serves for `model` (a packaged GGUF's alias or path, or a checkpoint
    directory), and characters per token of the workload's text in its tokenizer."""
    import random

    from kvmesh.node.engine.ggufmeta import read_facts
    from kvmesh.node.engine.hf import read_json
    from kvmesh.node.engine.modelfiles import resolve
    from kvmesh.node.engine.tokenizer import HFTokenizer
    from kvmesh.node.lab.bench.common import chars_per_token
    from kvmesh.node.lab.workload import text
    from kvmesh.node.modelnames import is_gguf

    if is_gguf(model):
        return int(read_facts(resolve(model)).context), chars_per_token(resolve(model))[0]
    sample = text(random.Random(0), 20_000)
    per_token = len(sample) / len(HFTokenizer.from_dir(Path(model)).encode(sample))
    return int(read_json(Path(model) / "config.json").get("max_position_embeddings") or 4096), per_token


def vllm_of(node_pid: int) -> tuple[str, str]:
    """The URL and served model name of the vLLM server a node process started (found among its children)."""
    for p in psutil.Process(node_pid).children(recursive=True):
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if "vllm.entrypoints.openai.api_server" in argv and "--port" in argv:
            name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else ""
            return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}", name
    raise RuntimeError(f"node {node_pid} has no vLLM server among its processes")


def engine_config(model: str, streams: int, tokens: int, max_tokens: int, context: int) -> dict[str, Any]:
    """One node's vLLM engine: a slot per stream, the context it needs, a pool and a vLLM cache for every stream's turns."""
    per_stream = tokens + 2 * max_tokens + 512  # a warm turn: the opening, the reply, the follow-up, the template
    # A round's sessions and a quarter more, no more: the pool is pre-touched shared memory and vLLM's cache is
    # resident, beside vLLM's ~4.5 GB; twice as much got a bench's node killed by the OOM killer on a shared 24 GB box.
    need = int(1.25 * streams * per_stream)
    kv_gib = max(1, math.ceil(need * 46080 / (1 << 30)))  # fp32 KV of SmolLM2's size per token
    return {"kind": "vllm", "model": model, "slots": streams, "max_context": min(context, per_stream + 512),
            "cache_tokens": need, "queue_timeout_s": 1800.0, "vllm": {"kvcache_gib": kv_gib}}


def run_nodepath(args: argparse.Namespace) -> int:
    """Start the node (and its vLLM), measure both sides, stop it; the JSON names kvmesh's figures over vLLM's."""
    model = str(args.model or "smollm2")
    try:
        vllm_ready()
    except VllmMissing as e:
        print(f"kvmesh bench nodepath: {e}", file=sys.stderr)
        return 2
    context, per_token = model_facts(model)
    if args.tokens + 2 * args.max_tokens + 256 > context:
        print(f"kvmesh bench nodepath: --tokens {args.tokens} with --max-tokens {args.max_tokens} does not fit "
              f"{model}'s {context}-token context: give --tokens {max(64, context - 2 * args.max_tokens - 512)} or less",
              file=sys.stderr)
        return 2
    t_start = time.monotonic()
    plan = Plan([(s, args.tokens) for s in args.streams], args.repeats, args.max_tokens, per_token=per_token,
                budget_s=args.budget)
    result: dict[str, Any] = {"bench": "nodepath", "model": model, "tokens": args.tokens, "max_tokens": args.max_tokens,
                              "streams": args.streams, "targets": TARGETS, "errors": 0, "error_samples": []}
    rounds: dict[str, list[list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-nodepath-") as tmp:
        engine = engine_config(model, max(args.streams), args.tokens, args.max_tokens, context)
        mesh = write_mesh(Path(tmp), ["a"], engine=engine, extra={"kvshare": {"fsync": "never"}, "mesh": QUEUE_NOT_REFUSE})
        say("nodepath", f"starting a node over vLLM ({model}, {engine['slots']} slots): a minute or more")
        try:
            mesh.start(ready_timeout=args.start_timeout, peers_timeout=None)
            sides = _sides(mesh)
            say("nodepath", f"node {sides[0].url}, its vLLM {sides[1].url} ({time.monotonic() - t_start:.0f} s in)")
            rounds = asyncio.run(measure(sides, plan, "nodepath", t_start))
        except (TurnFailed, RuntimeError, TimeoutError, httpx.HTTPError) as e:
            result["errors"] += 1
            result["error_samples"].append(f"{type(e).__name__}: {e}"[:400])
        finally:
            mesh.stop()
    result.update(report(args.streams, args.tokens, rounds))
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    return emit(result, args)


def _sides(mesh: LocalMesh) -> list[Side]:
    node = mesh.nodes["a"]
    assert node.proc is not None
    url, served = vllm_of(node.proc.pid)
    key = node.key_headers or client_key_headers()
    models = httpx.get(f"{node.api}/v1/models", headers=key, timeout=30).json()["data"]
    return [Side("kvmesh", node.api, str(models[0]["id"]), key), Side("vllm", url, served)]


def report(streams: list[int], tokens: int, rounds: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per point both sides' spreads and kvmesh's ratios; at the fewest and the most streams the target keys
    (`cold_ttft_ratio_1`, `decode_ratio_16`, `itl_p99_delta_ms_16`, ...) and whether every one is met."""
    points: list[dict[str, Any]] = []
    out: dict[str, Any] = {"points": points}
    met = True
    for k, n in enumerate(streams):
        km = summarize(rounds["kvmesh"][k]) if rounds.get("kvmesh") and rounds["kvmesh"][k] else None
        vl = summarize(rounds["vllm"][k]) if rounds.get("vllm") and rounds["vllm"][k] else None
        r = ratios(km, vl)
        points.append({"streams": n, "tokens": tokens, "kvmesh": km, "vllm": vl, **r})
        if n not in (min(streams), max(streams)):
            continue
        cold, decode, itl = r["cold_ttft_ratio"], r["decode_ratio"], r["itl_p99_delta_ms"]
        out[f"cold_ttft_ratio_{n}"], out[f"decode_ratio_{n}"], out[f"itl_p99_delta_ms_{n}"] = cold, decode, itl
        met = met and cold is not None and decode is not None and itl is not None \
            and cold <= TARGETS["cold_ttft_ratio_max"] and decode >= TARGETS["decode_ratio_min"] \
            and itl <= TARGETS["itl_p99_delta_ms_max"]
    out["meets_targets"] = met
    return out
