"""`kvmesh bench ttft`: cold prefill vs warm continuation from an imported replica file.

Cold: a fresh engine prefills the whole conversation. Warm: the same
conversation's cache is exported to a replica file, a *fresh* engine imports
it, and the conversation continues with one more ~256-token user message.
TTFT is from request to first token; the warm figure includes the import.
With `--model DIR` both engines run a local Hugging Face checkpoint (kind "torch"),
and the conversation is grown until the checkpoint's tokenizer counts ~--tokens.
With `--engine llamacpp` both run llama.cpp on `--model X.gguf`, or without it on the
generated GGUF with a real model's proportions (node.lab.testmodels preset "bench"). With
`--engine vllm` each side is a fresh vLLM server (node.engine.vllm) on `--model` (default smollm2).
Exit status non-zero when the warm turn reused none of the imported replica.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvmesh.node.config import EngineConfig, LlamaCppConfig, SimConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta, TurnDone
from kvmesh.node.engine.ggufmeta import read_facts
from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.engine.hf import open_checkpoint
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.engine.llamamodel import LlamaModel
from kvmesh.node.engine.modelfiles import resolve as resolve_model
from kvmesh.node.engine.snapshots import Snapshot
from kvmesh.node.engine.tokenizer import HFTokenizer, Tokenizer
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.engine.vllm.models import served_checkpoint
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.lab.bench.common import emit
from kvmesh.node.lab.testmodels import ensure_model, spec_for
from kvmesh.node.lab.workload import grow_conversation, text

SESSION = "bench-ttft"

def _open(cfg: EngineConfig) -> Engine | VllmEngine:
    return VllmEngine(cfg) if cfg.kind == "vllm" else Engine(cfg)


async def _ttft(engine: Engine | VllmEngine, prompt: list[int], max_tokens: int = 1) -> tuple[float, str]:
    """Request to first token, as the engine measured it (queue + reuse + prefill + first sample)."""
    out = []
    ttft = None
    async for ev in engine.generate(GenerateRequest(SESSION, prompt, max_tokens=max_tokens, temperature=0.0)):
        if isinstance(ev, TextDelta):
            out.append(ev.text)
        elif isinstance(ev, TurnDone):
            ttft = ev.stats.ttft_s
    assert ttft is not None
    return ttft, "".join(out)


def _engine_cfg(kind: str, tokens: int, model: Path | None = None, block_size: int | None = None,
                swa: str = "full") -> EngineConfig:
    ctx = max(4096, tokens + 2048)
    if kind == "vllm":  # a fresh vLLM each side (its own prefix cache empty): --model a checkpoint or an alias
        return EngineConfig(kind="vllm", model=str(model or "smollm2"), slots=1, max_context=ctx, cache_tokens=ctx + 1024,
                            **({"block_size": block_size} if block_size else {}))  # type: ignore[arg-type]
    if kind == "llamacpp":
        # --model: a GGUF file; without it, the generated GGUF with a real model's proportions.
        gguf = model if model is not None else ensure_model(spec_for("bench"))
        block = {"block_size": block_size} if block_size else {}  # unset: chosen from the model's context
        try:  # within the model's trained context when the conversation fits it
            trained = read_facts(resolve_model(gguf)).context
            ctx = trained if ctx > trained >= tokens + 512 else ctx
        except (OSError, ValueError):
            pass  # a file whose metadata says less: the context as computed
        return EngineConfig(kind="llamacpp", model=str(gguf), slots=1, max_context=ctx, cache_tokens=ctx + 1024,
                            llamacpp=LlamaCppConfig(swa=swa), **block)  # type: ignore[arg-type]
    if model is not None:
        # KV bytes per token at fp32 bound the bf16 a GPU would use; the context is capped
        # by the checkpoint's max_position_embeddings.
        m = open_checkpoint(model, max_context=ctx).config
        return EngineConfig(kind="torch", model=str(model), slots=1, max_context=m.max_context,
                            cache_tokens=m.max_context + 1024)
    return EngineConfig(kind=kind, slots=1, max_context=ctx, cache_tokens=ctx + 1024,  # type: ignore[arg-type]
                        sim=SimConfig(max_context=ctx))


def _swa_facts(engine: Engine | VllmEngine, tokens: int) -> dict[str, object]:
    """A sliding-window model's mode and what its replica costs against the windowed cache llama.cpp would keep."""
    runner = getattr(engine, "runner", None)
    if not isinstance(runner, LlamaRunner) or not runner.model.n_swa:
        return {"swa_mode": None}
    full, *window = runner.layout.sections
    per_cell = [sec.section_size(1) - sec.section_size(0) for sec in (full, *window)]
    windowed = tokens * per_cell[0] + min(tokens, runner.model.n_swa) * sum(per_cell[1:])
    return {"swa_mode": runner.cfg.swa, "swa_window": runner.model.n_swa, "windowed_kv_bytes": windowed}


def _conversation(tokens: int, model: Path | None, kind: str) -> tuple[list[dict[str, str]], random.Random]:
    """The workload's conversation, sized in the model's tokens (the byte tokenizer: 1 char ~ 1 token)."""
    target = tokens
    tok: Tokenizer | None = None
    if model is not None:
        if kind == "vllm":
            tok = HFTokenizer.from_dir(served_checkpoint(EngineConfig(kind="vllm", model=str(model))))
        else:
            tok = LlamaModel.open(model, LlamaCppConfig()).tokenizer if kind == "llamacpp" else HFTokenizer.from_dir(model)
    for _ in range(4):
        rng = random.Random(7)
        msgs = grow_conversation(rng, target)
        if tok is None:
            break
        n = len(tok.apply_chat_template(msgs))
        if abs(n - tokens) <= 0.05 * tokens:
            break
        target = max(64, int(target * tokens / max(1, n)))
    return msgs, rng


def _export(home: Engine | VllmEngine, store: ReplicaStore) -> tuple[np.ndarray, int, Snapshot | None]:
    """The home engine's cache of the conversation to a replica file: (its tokens, whole blocks written, and in
    window mode or with recurrent state the newest snapshot those blocks reach, the rest of the replica:
    node.engine.snapshots)."""
    man_tokens = home.session_tokens(SESSION)
    assert man_tokens is not None
    with home.export(SESSION) as blocks:
        n = len(blocks)
        w = store.begin_write(SESSION, fingerprint=home.fingerprint, block_size=home.block_size,
                              block_bytes=home.block_bytes, tokens=man_tokens[: n * home.block_size],
                              hashes=[b.hash for b in blocks], first_block=0, generation=1)
        with w:
            for b in blocks:
                w.write_block(b.index, b.data, payload_digest(b.data))
            w.commit()
    snapshot = home.snapshots.newest(man_tokens[: n * home.block_size]) if home.snapshots is not None else None
    return man_tokens, n, snapshot


def _no_replicas(cfg: EngineConfig, reason: str) -> dict[str, object]:
    why = (f"{cfg.served_model} has no replicas: {reason}, so kvmesh serves it with live caches only and a turn "
           "that moves host recomputes its prompt")
    return {"engine": cfg.kind, "model": cfg.served_model, "replicas": False, "errors": 1, "error_samples": [why]}


DEFAULT_TOKENS = 16384  # node.cli's --tokens default: sized down for a model whose context is shorter
FOLLOW_ROOM = 512  # what the warm turn adds to the conversation: the reply, a ~256-token message, the template


def model_context(kind: str, model: Path | None) -> int | None:
    """The trained context of the model a run would serve; None where the engine has no such bound (tiny, sim)."""
    from kvmesh.node.engine.hf import read_json
    from kvmesh.node.modelnames import is_gguf

    if kind == "llamacpp" or (kind == "vllm" and is_gguf(str(model))):
        return int(read_facts(resolve_model(model if model is not None else ensure_model(spec_for("bench")))).context)
    if model is not None and (model / "config.json").is_file():
        return int(read_json(model / "config.json").get("max_position_embeddings") or 0) or None
    return None


def sized_tokens(asked: int, context: int | None) -> tuple[int, str | None]:
    """The conversation's length for this run and a note when it was sized down; SystemExit naming --tokens for
    an asked length the model cannot hold. The default (16384) becomes 80% of a shorter context."""
    if context is None or asked + FOLLOW_ROOM <= context:
        return asked, None
    if asked == DEFAULT_TOKENS:
        fit = int(0.8 * context)
        return fit, f"--tokens {asked} (the default) sized down to {fit}: 80% of the model's {context}-token context"
    raise SystemExit(f"kvmesh bench ttft: --tokens {asked} does not fit the model's {context}-token context with "
                     f"the warm turn's ~{FOLLOW_ROOM} more: give --tokens {context - FOLLOW_ROOM} or less")


def run_ttft(args: argparse.Namespace) -> int:
    model = getattr(args, "model", None)
    if args.engine == "vllm" and model is None:
        model = Path("smollm2")
    args.tokens, sized = sized_tokens(args.tokens, model_context(args.engine, model))
    if sized is not None:
        print(f"kvmesh bench ttft: {sized}", file=sys.stderr)
    msgs, rng = _conversation(args.tokens, model, args.engine)
    cfg = _engine_cfg(args.engine, args.tokens, model, getattr(args, "block_size", None), getattr(args, "swa", "full"))
    with tempfile.TemporaryDirectory(prefix="kvmesh-ttft-") as tmp:
        root = Path(args.store_dir or tmp)
        store = ReplicaStore(root, budget_bytes=1 << 40)

        async def scenario() -> dict[str, object]:
            home = _open(cfg)
            if home.inexact_reason is not None:  # nothing to measure, and the JSON says why
                home.close()
                return _no_replicas(cfg, home.inexact_reason)
            prompt = home.tokenizer.apply_chat_template(msgs)
            cold_s, reply = await _ttft(home, prompt, max_tokens=16)
            man_tokens, n, snapshot = _export(home, store)
            swa = _swa_facts(home, n * home.block_size)
            home.close()
            del home
            follow = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": text(rng, 256)}]
            away = _open(cfg)
            prompt2 = away.tokenizer.apply_chat_template(follow)
            t0 = time.monotonic()
            store.import_into(away, SESSION)
            if snapshot is not None and away.snapshots is not None:
                if (why := away.snapshots.put(man_tokens[: snapshot.pos], snapshot.blob, received=True)) is not None:
                    raise RuntimeError(f"the snapshot was refused: {why}")
            import_s = time.monotonic() - t0
            gen_s, _ = await _ttft(away, prompt2)
            warm_s = import_s + gen_s
            cached = away.counters.cached_tokens
            away.close()
            # A warm turn that reused nothing of the imported replica measured a cold prefill: an error.
            errors = [] if cached else ["the warm turn reused none of the imported replica"]
            return {
                "prompt_tokens": len(prompt),
                "cold_ttft_s": round(cold_s, 4),
                "warm_ttft_s": round(warm_s, 4),
                "import_s": round(import_s, 4),
                "ratio": round(warm_s / cold_s, 4),
                "warm_prompt_tokens": len(prompt2),
                "warm_cached_tokens": cached,
                "engine": cfg.kind,
                "block_size": away.block_size, **swa,
                "replica_bytes": n * away.block_bytes + (snapshot.nbytes if snapshot is not None else 0),
                **({"snapshot_bytes": snapshot.nbytes, "snapshot_pos": snapshot.pos} if snapshot is not None else {}),
                "errors": len(errors), "error_samples": errors,
                **({"model": cfg.served_model, "device": str(away.device), "dtype": str(away.dtype).removeprefix("torch.")}
                   if model is not None or cfg.kind in ("llamacpp", "vllm") else {}),
            }

        result = asyncio.run(scenario())
    if sized is not None:
        result["tokens_note"] = sized
    return emit(result, args)
