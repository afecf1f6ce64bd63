"""`kvmesh bench transfer --engine llamacpp`: block export and import rates of the llama.cpp engine.

One engine (the generated GGUF with a real model's proportions, or `--model X.gguf`) prefills a
16k-token session; then, on its compute thread, the engine's own block export (every block of
the session into the pool) and import (every block back into the slot) are timed, beside a
plain memory copy of the same bytes. `path` names how the engine moves blocks: `streams` (one
KV stream per slot: one `get_data` of the whole sequence re-cut by position, blocks joined into
one `set_data`) or `scratch` (a sliding-window model's unified cache: each block through a
scratch sequence, `seq_cp`). Rates are GB/s of block bytes; each figure is
the best of `--repeat` rounds (the box is shared). Each import is checked: the slot's sequence
ends holding every position of the session.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest
from kvmesh.node.engine.ggufmeta import read_facts
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.engine.modelfiles import resolve as resolve_model
from kvmesh.node.lab.bench.common import emit
from kvmesh.node.lab.testmodels import ensure_model, spec_for

SESSION = "bench-transfer"


def _best(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


async def _fill(engine: Engine, tokens: int) -> None:
    rng = np.random.default_rng(5)
    allowed = engine.tokenizer.generation_mask()
    ids = np.flatnonzero(allowed) if allowed is not None else np.arange(3, engine.tokenizer.vocab_size)
    prompt = [int(x) for x in rng.choice(ids, tokens)]
    async for _ in engine.generate(GenerateRequest(SESSION, prompt, max_tokens=1)):
        pass


def _measure(engine: Engine, r: LlamaRunner, repeat: int) -> dict[str, float]:
    seq = engine.sessions[SESSION]
    n_blocks = len(seq.hashes)
    bids, bs = seq.block_ids[:n_blocks], engine.block_size
    nbytes = n_blocks * r.block_bytes
    held = r.held[0].tokens.copy()

    def export() -> None:
        r._changed(0)  # every round reads the sequence's state afresh, as a commit does
        for j, bid in enumerate(bids):
            r._store(0, bid, j)

    def restore() -> None:
        r.erase(0)
        r._load(0, bids, held[: n_blocks * bs])

    src = np.frombuffer(engine.pool.raw.numpy(), dtype=np.uint8)[: nbytes]
    dst = np.empty_like(src)
    res = {"export_s": _best(export, repeat), "import_s": _best(restore, repeat),
           "memcpy_s": _best(lambda: np.copyto(dst, src), repeat)}
    if r.lib.llama_memory_seq_pos_max(r.mem, 0) != n_blocks * bs - 1:
        raise RuntimeError("an import left the sequence short of the session's positions")
    out_d: dict[str, float] = {k.removesuffix("_s") + "_gbps": round(nbytes / v / 1e9, 3) for k, v in res.items()}
    out_d.update({f"{k.removesuffix('_s')}_ms": round(v * 1000, 3) for k, v in res.items()})
    out_d.update(blocks=n_blocks, block_bytes=r.block_bytes, bytes=nbytes)
    return out_d


def run_llama_transfer(args: argparse.Namespace) -> int:
    model = getattr(args, "model", None) or ensure_model(spec_for("bench"))
    context = read_facts(resolve_model(model)).context
    asked = getattr(args, "tokens", None)
    if asked is not None and asked + 1024 > context:  # a session past the trained context measures positions no model has
        print(f"kvmesh bench transfer: --tokens {asked} does not fit the model's {context}-token context: give --tokens "
              f"{context - 1024} or less", file=sys.stderr)
        return 2
    tokens = asked if asked is not None else min(16384, int(0.8 * context))
    block = {"block_size": args.block_size} if getattr(args, "block_size", None) else {}  # unset: from the model's context
    cfg = EngineConfig(kind="llamacpp", model=str(Path(model)), slots=1, max_context=tokens + 1024, **block,
                       cache_tokens=tokens + 2048, llamacpp=LlamaCppConfig())
    engine = Engine(cfg)
    try:
        t0 = time.monotonic()
        asyncio.run(_fill(engine, tokens))
        prefill_s = time.monotonic() - t0
        assert isinstance(engine.runner, LlamaRunner)
        fut = engine.runner._exec.submit(_measure, engine, engine.runner, max(1, args.repeat))
        res = fut.result()
    finally:
        engine.close()
    path = "streams" if engine.runner.streams else "scratch"
    return emit({"engine": "llamacpp", "model": cfg.served_model, "session_tokens": tokens, "path": path,
                 "prefill_s": round(prefill_s, 2), **res, "errors": 0, "error_samples": []}, args)
