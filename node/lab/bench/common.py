"""What every `kvmesh bench ...` shares: the JSON output, the exit status, and a local sim mesh.

A leaf module: the benchmarks import it, it imports none of them (node.bench's
dispatcher imports the benchmarks, so helpers living there made a cycle).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from kvmesh.node.engine.repack import Setting
from kvmesh.node.lab.launcher import NodeProcess, merge_config, write_mesh
from kvmesh.node.lab.workload import text


def failures(result: dict[str, Any]) -> list[str]:
    """Why a benchmark's run failed (empty when it did not): any error it counted, or no work done.

    A figure measured over a run that lost turns or rounds is not the figure the run claims, so
    such a run must not exit 0 (scripts and CI read the exit status, not the JSON)."""
    why: list[str] = []
    errors = result.get("errors", 0)
    if errors:
        why.append(f"{errors} error(s): {'; '.join(map(str, result.get('error_samples', [])[:3])) or 'see the JSON'}")
    if "turns" in result and not result["turns"]:
        why.append("no turn completed")
    if "rounds" in result and not result["rounds"]:
        why.append("no round completed")
    return why


def emit(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Human lines first (unless --json), then the JSON object as the very last stdout line.

    Returns the exit status: 0 only when `failures(result)` is empty (each reason goes to stderr)."""
    if not getattr(args, "json", False):
        for k, v in result.items():
            print(f"{k:>28}: {v}")
    print(json.dumps(result), flush=True)
    why = failures(result)
    for w in why:
        print(f"kvmesh bench: FAILED: {w}", file=sys.stderr)
    return 1 if why else 0


def start_mesh(work: Path, names: list[str], *, slots: int, kv_scale: float, cache_bytes: int,
               extra: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
               overrides: dict[str, dict[str, Any]] | None = None, ready_timeout: float = 60.0) -> list[NodeProcess]:
    """The benchmarks' mesh on loopback (`launcher.write_mesh`), started: every node ready.

    The sim engine unless `engine` names another (its keys replace the sim's)."""
    if engine is None:
        engine = {"kind": "sim", "sim": {"kv_scale": kv_scale}}
    engine = {"slots": slots, "cache_bytes": cache_bytes, "queue_timeout_s": 600.0, **engine}
    base: dict[str, Any] = {"kvshare": {"fsync": "never", "store_budget_bytes": 4 * cache_bytes},
                            "mesh": {"poll_interval_s": 0.25}}
    merge_config(base, extra or {})
    mesh = write_mesh(work, names, engine=engine, extra=base, overrides=overrides)
    return list(mesh.start(ready_timeout, peers_timeout=None).nodes.values())


def llamacpp_engine(args: argparse.Namespace, max_context: int | None) -> dict[str, Any] | None:
    """`--engine llamacpp`: the engine config every node of a local mesh runs, serving --model or the
    generated tiny GGUF (node.lab.testmodels); None for the sim. max_context None: the model's own."""
    if getattr(args, "engine", "sim") != "llamacpp":
        return None
    from kvmesh.node.lab.testmodels import ensure_model, spec_for

    model = getattr(args, "model", None) or ensure_model(spec_for("tiny"))
    # The nodes share the box's cores: one thread each.
    context = {} if max_context is None else {"max_context": max_context}
    return {"kind": "llamacpp", "model": str(model), **context, "llamacpp": {"threads": 1}}


def vllm_engine(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
    """`--engine vllm`: every node's engine config (--model, default smollm2) and each node's own core
    (one vLLM per node, pinned: two hosts on this box buy no capacity unless each has its core)."""
    if getattr(args, "engine", "sim") != "vllm":
        return None
    engine = {"kind": "vllm", "model": str(getattr(args, "model", None) or "smollm2"), "vllm": {"kvcache_gib": 1}}
    cores = os.cpu_count() or 1
    return engine, {n: {"engine": {"vllm": {"cpu_cores": str(i % cores)}}} for i, n in enumerate(names)}


# `--extra-bufts` of the llama.cpp benches: engine.llamacpp.extra_bufts's values (node.engine.repack).
EXTRA_BUFTS: dict[str, Setting] = {"auto": "auto", "on": True, "off": False}

# With llama.cpp the context is the model's trained one, capped here: 4 slots of a long-context
# model on a CPU would take GBs of KV per node for turns a bench or demo never reaches.
LLAMA_CONTEXT_CAP = 16384


def chars_per_token(model: str | Path) -> tuple[float, int]:
    """Characters per token of the workload's text in a GGUF model's own tokenizer, and the
    model's trained context: the benches size their prompts in the model's tokens from these."""
    from kvmesh.node.config import LlamaCppConfig
    from kvmesh.node.engine.llamamodel import LlamaModel

    m = LlamaModel.open(model, LlamaCppConfig())
    try:
        sample = text(random.Random(0), 20_000)
        return len(sample) / len(m.tokenizer.encode(sample)), m.n_ctx_train
    finally:
        m.close()


def llama_shape(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """LoadShape's overrides for a GGUF model, sized to its context, and the shape as a JSON states it.

    Conversations open at 25-30% of the context and grow in small steps (0.5-2% a turn), so a
    turn's new tokens stay under a tenth of its prompt (a move is warm only from 90% reuse), and
    end at 80% of it, so no prompt passes the context. Openings are real prefill here (2-3k
    tokens on an 8k model: 10-30 s on a shared CPU core), so they are kept as short as that
    allows. The workload counts characters; the model's own tokenizer gives characters per
    token on the workload's text. The sim keeps LoadShape's shape."""
    per_token, trained = chars_per_token(model)
    context = min(trained, LLAMA_CONTEXT_CAP)

    def chars(share: float) -> int:
        return int(share * context * per_token)

    opening, tool, end = (0.25, 0.30), (0.005, 0.02), 0.8
    shape = {"system_tokens": (chars(opening[0]), chars(opening[1])), "tool_tokens": (chars(tool[0]), chars(tool[1])),
             "target_tokens": chars(end)}
    said = {"context": context, "chars_per_token": round(per_token, 2), "opening_tokens": [int(x * context) for x in opening],
            "tool_tokens": [int(x * context) for x in tool], "end_tokens": int(end * context)}
    return shape, said
