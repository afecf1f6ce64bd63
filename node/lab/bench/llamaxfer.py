"""`kvmesh bench transfer --engine llamacpp`: block export and import rates of the llama.cpp engine.

One engine (the generated GGUF with a real model's proportions, or `--model X.gguf`) prefills a
16k-token session; then, on its compute thread, each way of moving its blocks is timed:
- export by scratch sequence (what the engine does): `seq_cp` of a block's positions to a scratch
  sequence, `llama_state_seq_get_data` straight into the pool block;
- export by parsing: one `get_data` of the whole sequence, then each block re-cut by position
  (node.engine.llamastate.cut);
- import by scratch sequence (what the engine does): per block `set_data` into the scratch
  sequence, `seq_cp` to the slot's sequence;
- import by re-composing: the blocks joined into one blob (llamastate.join), one `set_data`;
beside a plain memory copy of the same bytes. Rates are GB/s of block bytes; each figure is
the best of `--repeat` rounds (the box is shared). Each import is checked: the slot's sequence
ends holding every position of the session.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine, GenerateRequest
from kvmesh.node.engine.gguf_gen import ensure_model, spec_for
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.lab.bench.common import emit

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
    bids, bs, lay = seq.block_ids[:n_blocks], engine.block_size, r.layout
    nbytes = n_blocks * r.block_bytes
    held = r.held[0].tokens.copy()
    out = np.empty(r.block_bytes, dtype=np.uint8)

    def export_scratch() -> None:
        for j, bid in enumerate(bids):
            r._store(0, bid, j)

    def export_parse() -> None:
        size = r.lib.llama_state_seq_get_size(r.ctx, 0)
        whole = (ctypes.c_uint8 * size)()
        r.lib.llama_state_seq_get_data(r.ctx, whole, size, 0)
        for j in range(n_blocks):
            llamastate.cut(memoryview(whole), lay, j * bs, (j + 1) * bs, out)

    def import_scratch() -> None:
        r._erase(0)
        r._load(0, bids, held[: n_blocks * bs])

    joined = np.empty(lay.size(n_blocks * bs), dtype=np.uint8)

    def import_join() -> None:
        r._erase(0)
        views = [engine.pool.read_bytes(b) for b in bids]
        n = llamastate.join(views, lay, [bs] * n_blocks, joined)
        ptr = ctypes.cast(joined.ctypes.data, ctypes.POINTER(ctypes.c_uint8))
        if r.lib.llama_state_seq_set_data(r.ctx, ptr, n, 0) != n:
            raise RuntimeError("the re-composed blob did not restore")

    src = np.frombuffer(engine.pool.raw.numpy(), dtype=np.uint8)[: nbytes]
    dst = np.empty_like(src)
    res = {
        "export_scratch_s": _best(export_scratch, repeat), "export_parse_s": _best(export_parse, repeat),
        "import_scratch_s": _best(import_scratch, repeat), "import_join_s": _best(import_join, repeat),
        "memcpy_s": _best(lambda: np.copyto(dst, src), repeat),
    }
    if r.lib.llama_memory_seq_pos_max(r.mem, 0) != n_blocks * bs - 1:
        raise RuntimeError("an import left the sequence short of the session's positions")
    r.held[0].set(held[: n_blocks * bs])
    out_d: dict[str, float] = {k.removesuffix("_s") + "_gbps": round(nbytes / v / 1e9, 3) for k, v in res.items()}
    out_d.update({k: round(v * 1000, 3) for k, v in {f"{k.removesuffix('_s')}_ms": v for k, v in res.items()}.items()})
    out_d.update(blocks=n_blocks, block_bytes=r.block_bytes, bytes=nbytes)
    return out_d


def run_llama_transfer(args: argparse.Namespace) -> int:
    tokens = int(getattr(args, "tokens", 16384))
    model = getattr(args, "model", None) or ensure_model(spec_for("bench"))
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
    faster_export = "scratch" if res["export_scratch_gbps"] >= res["export_parse_gbps"] else "parse"
    faster_import = "scratch" if res["import_scratch_gbps"] >= res["import_join_gbps"] else "join"
    return emit({"engine": "llamacpp", "model": cfg.served_model, "session_tokens": tokens,
                 "prefill_s": round(prefill_s, 2), **res, "faster_export": faster_export, "faster_import": faster_import,
                 "errors": 0, "error_samples": []}, args)
