"""A llama.cpp context made, and learned from at start by computing a few tokens in it (compute thread only):
its per-sequence state layout, the bytes a position adds to it, and whether a slot's own cells past its last
full block may be kept token by token (node.engine.tailshapes).

Each works on `LlamaRunner` (node.engine.llamacpp) through `ProbeHost`; a probe uses a spare sequence and
leaves it empty.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import numpy as np

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.llamamodel import LlamaModel, llama_error
from kvmesh.node.engine.tailshapes import LARGE, SMALL, Shapes
from kvmesh.node.errors import CheckpointError

_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}

_PREFIX = 24  # tokens before the probed ones (one ubatch), so their attention has something to read


class ProbeHost(Protocol):
    """What these use of the runner: its settings, its context, its sequences, one llama_decode, a sequence's state."""

    lib: Any
    mem: Any
    model: LlamaModel
    cfg: LlamaCppConfig
    slots: int
    max_context: int
    block_size: int
    streams: bool
    snapshotted: bool
    scratch: int

    def _decode(self, tokens: list[int] | np.ndarray, seqs: list[int], pos: list[int] | np.ndarray, *,
                logits_last: bool, logits_all: bool = False) -> None: ...

    def _state(self, seq: int) -> np.ndarray: ...


def new_context(r: ProbeHost) -> Any:
    """The runner's llama.cpp context: a KV stream per slot (or one unified stream and a scratch sequence),
    flash attention, cache types and batch sizes as configured."""
    lib, cfg = r.lib, r.cfg
    cp = lib.llama_context_default_params()
    # One unified stream: room for the scratch sequence's block and a padded ubatch's padding (tailshapes) too.
    cp.n_ctx = r.slots * r.max_context + (0 if r.streams else r.block_size + (large_from(cfg.flash_attn, cfg.type_k, cfg.type_v) or 2))
    cp.n_batch = cfg.n_batch
    cp.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
    cp.n_seq_max = r.slots if r.streams else r.slots + 1
    threads = cfg.threads or len(os.sched_getaffinity(0))
    cp.n_threads = threads
    cp.n_threads_batch = cfg.threads_batch or threads
    cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = _GGML_TYPES[cfg.type_k]
    cp.type_v = _GGML_TYPES[cfg.type_v]
    cp.kv_unified = not r.streams  # unified: one cell pool, so seq_cp shares cells instead of copying
    # Sliding-window layers keep every position, not the last window: a block then restores exactly,
    # at the memory of a full-attention cache for those layers (llama-server's --swa-full). Window mode
    # keeps llama.cpp's windowed cache, and its window travels as snapshots (node.engine.snapshots).
    cp.swa_full = r.model.n_swa > 0 and not r.snapshotted
    cp.no_perf = True
    ctx = lib.llama_init_from_model(r.model.handle, cp)
    if not ctx:
        raise CheckpointError(f"llama.cpp could not create a context for {r.model.path} ({r.slots} slots x "
                              f"{r.max_context} tokens, K {cfg.type_k}, V {cfg.type_v}): "
                              f"{llama_error('see the log')}", path=str(r.model.path))
    return ctx



def layout(r: ProbeHost) -> llamastate.Layout:
    """Decode one token into a spare sequence and learn the state layout from its blob (and, for bare
    blocks, the other caches' sections from an empty sequence's)."""
    seq = 0 if r.streams else r.scratch
    empty = r._state(seq) if r.snapshotted else None
    r._decode([1 % r.model.n_vocab], [seq], [0], logits_last=False)
    blob = r._state(seq)
    r.lib.llama_memory_seq_rm(r.mem, seq, -1, -1)
    lay = llamastate.learn(blob.data, r.model.n_layer, recurrent=r.model.recurrent)
    # An empty sequence's blob: magic, seq id, the attention cache's section (n_stream 1, 0 cells) if
    # there is one, then the others' (the window cache's, the recurrent state's) with no cell.
    if empty is None:
        return lay
    return dataclasses.replace(lay, bare=True, tail=bytes(empty[16:] if lay.n_layer else empty[8:]))


def growth(r: ProbeHost, ctx: Any) -> int:
    """Bytes a position adds to a sequence's state (its attention KV; the recurrent state is per sequence)."""
    r._decode([1 % r.model.n_vocab], [0], [0], logits_last=False)
    one = r.lib.llama_state_seq_get_size(ctx, 0)
    r._decode([1 % r.model.n_vocab], [0], [1], logits_last=False)
    two = r.lib.llama_state_seq_get_size(ctx, 0)
    r.lib.llama_memory_seq_rm(r.mem, 0, -1, -1)
    return max(1, int(two - one))


def large_from(flash_attn: bool, type_k: str, type_v: str) -> int | None:
    """The ubatch size from which llama.cpp's CPU flash attention takes its tiled path (GGML_FA_TILE_Q, for an
    f16/f32/bf16 cache), whose cells differ from the one-row path's; None where one path serves every size."""
    return 64 if flash_attn and type_k == type_v and type_k in ("f16", "f32", "bf16") else None


def tail_reason(r: ProbeHost, shapes: Shapes) -> str | None:
    """Why a slot's own cells past its last full block cannot be kept token by token here (None: they can).

    A span of positions computed as one ubatch and as several, every piece of one kind (`tailshapes`), the last
    one padded past the span or not, must give bit-identical cells: where it does, no cell depends on its batch
    beyond that kind (not on the batch's size, nor on the cell's place in it), and a turn keeping them computes
    what a host restoring whole blocks computes. A GPU build is not probed: its kernels change at more batch sizes than two."""
    if r.lib.llama_supports_gpu_offload():
        return "a GPU build: its kernels change with the batch size at more sizes than kvmesh tells apart"
    ub, big = shapes.n_ubatch, shapes.large_from
    small = min(ub, 40 if big is None else big - 1)
    # The last piece of a case may run past the compared span: rows past it are padding (trimmed before comparing).
    spans = {SMALL: [[small], [2, small - 2], [small - 5, 5], [small - 1, 2]]}
    if big is not None and 2 * big + 3 <= ub:
        spans[LARGE] = [[2 * big + 3], [big + 3, big], [2 * big - 4, big]]
    elif big is None and ub >= 80:
        spans[SMALL].append([80, 3])  # one kind for every size: the other variants' pieces are a prefix of 83
    toks = (np.arange(_PREFIX + max(sum(c) for cases in spans.values() for c in cases)) * 7919 + 17) % r.model.n_vocab
    seq = 0
    try:
        r._decode(toks[:_PREFIX], [seq], np.arange(_PREFIX), logits_last=False)
        for kind, cases in spans.items():
            seen = set()
            top = _PREFIX + min(sum(c) for c in cases)
            for pieces in cases:
                r.lib.llama_memory_seq_rm(r.mem, seq, _PREFIX, -1)
                lo = _PREFIX
                for n in pieces:
                    r._decode(toks[lo : lo + n], [seq], np.arange(lo, lo + n), logits_last=False)
                    lo += n
                r.lib.llama_memory_seq_rm(r.mem, seq, top, -1)
                seen.add(r._state(seq).tobytes())
            if len(seen) > 1:
                return (f"its cells differ with the batches that computed them within one kind of batch "
                        f"({'small' if kind == SMALL else 'large'}: {cases} tokens)")
    finally:
        r.lib.llama_memory_seq_rm(r.mem, seq, -1, -1)
    return None
