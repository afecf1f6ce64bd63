"""Back-end construction: what each engine kind is, and the runner that computes under the
engine's block bookkeeping.

`open_backend` runs before the pool exists (its geometry sizes the pool), `make_runner` after
(runners write into the pool). Kinds: "sim" (the cost model), "llamacpp" (a GGUF model in
llama.cpp), "torch" (a Hugging Face checkpoint) and the presets ("tiny", ...) on our decoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.decoder import ModelConfig, fingerprint, preset
from kvmesh.node.engine.hf import Checkpoint, load_decoder, open_checkpoint
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.engine.llamamodel import LlamaModel
from kvmesh.node.engine.llamamodel import fingerprint as llama_fingerprint
from kvmesh.node.engine.repack import WeightBuffers
from kvmesh.node.engine.runner import Runner, SimCost, SimRunner, TorchRunner
from kvmesh.node.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvmesh.node.modelnames import gguf_name

log = logging.getLogger("kvmesh.engine")


@dataclass
class Backend:
    """One engine kind, opened: its tokenizer, KV geometry and fingerprint, and what its runner
    is built from once the pool exists."""

    tokenizer: Tokenizer
    model_cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    block_shape: tuple[int, ...]  # one block of the pool
    block_bytes: int
    kv_bytes_per_token: int
    fingerprint: str
    block_size: int  # tokens per block: engine.block_size, or for llama.cpp one chosen from the context
    checkpoint: Checkpoint | None = None  # kind "torch": the checkpoint its weights load from
    llama: LlamaRunner | None = None  # kind "llamacpp": the runner, its model loaded
    inexact_reason: str | None = None  # why its cache cannot be cut into blocks: live caches only (node.engine.live)
    weights: WeightBuffers | None = None  # kind "llamacpp": repacked weight buffers or not, and why


def _pick_device(want: str) -> torch.device:
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _pick_dtype(want: str, device: torch.device) -> torch.dtype:
    if want == "auto":
        # fp32 is faster than bf16 on these CPUs (machine-facts); bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, want)


def open_backend(cfg: EngineConfig, model_cfg: ModelConfig | None = None) -> Backend:
    """Open the kind `cfg` names; `model_cfg` overrides the preset's or checkpoint's (not llama.cpp's)."""
    if cfg.kind == "llamacpp":
        return _open_llamacpp(cfg)
    if cfg.kind == "sim":
        return _open_sim(cfg, model_cfg)
    return _open_decoder(cfg, model_cfg)


def _open_decoder(cfg: EngineConfig, model_cfg: ModelConfig | None) -> Backend:
    """Our decoder on torch: a preset's seeded weights, or a checkpoint's."""
    checkpoint: Checkpoint | None = None
    tokenizer: Tokenizer
    if cfg.kind == "torch":
        checkpoint = open_checkpoint(cfg.model, max_context=cfg.max_context)
        tokenizer = HFTokenizer.from_dir(checkpoint.path, extra_eos_ids=checkpoint.config.eos_ids)
    else:
        tokenizer = ByteTokenizer()
    device = _pick_device(cfg.device)
    dtype = _pick_dtype(cfg.dtype, device)
    if checkpoint is not None:
        m = model_cfg or checkpoint.config
    else:
        m = model_cfg or preset(cfg.kind, max_context=cfg.max_context)
    kv_bytes_per_token = m.kv_bytes_per_token(dtype)
    return Backend(tokenizer, m, dtype, device, (m.n_layers, 2, m.n_kv_heads, cfg.block_size, m.head_dim),
                   kv_bytes_per_token * cfg.block_size, kv_bytes_per_token, fingerprint(m, dtype, cfg.block_size),
                   cfg.block_size, checkpoint=checkpoint)


def _open_sim(cfg: EngineConfig, model_cfg: ModelConfig | None) -> Backend:
    """The cost model: bytes per token from the sim's config; the fingerprint names that size."""
    kv_bytes_per_token = cfg.sim.scaled_kv_bytes_per_token()
    fp_cfg = ModelConfig(name=f"sim-{kv_bytes_per_token}", max_context=cfg.sim.max_context)
    block_bytes = kv_bytes_per_token * cfg.block_size
    return Backend(ByteTokenizer(), model_cfg or preset("tiny", max_context=cfg.sim.max_context), torch.uint8,
                   torch.device("cpu"), (block_bytes,), block_bytes, kv_bytes_per_token,
                   fingerprint(fp_cfg, torch.uint8, cfg.block_size), cfg.block_size)


def llama_context(cfg: EngineConfig, trained: int) -> int:
    """The context per slot: engine.max_context as set, else the model's trained context; past it, a warning."""
    if "max_context" not in cfg.model_fields_set:
        return trained
    if cfg.max_context > trained:
        log.warning("engine.max_context = %d is past %s's trained context of %d tokens: answers past it may degrade",
                    cfg.max_context, gguf_name(cfg.model), trained)
    return cfg.max_context


def llama_block_size(cfg: EngineConfig, context: int) -> int:
    """engine.block_size as set, else a power of two from 32 to 256 that cuts the trained context into >= 128 blocks.

    The partial last block never moves between hosts: on an 8k-context model a 256-token tail is
    a large share of a short prompt (a 2k-token prompt would reuse 89% at best after a move)."""
    if "block_size" in cfg.model_fields_set:
        return cfg.block_size
    size = 256
    while size > 32 and context // size < 128:
        size //= 2
    return size


def _open_llamacpp(cfg: EngineConfig) -> Backend:
    """Load the GGUF model and its context; its tokenizer comes with the model.

    A block's bytes are llama.cpp's per-sequence state of its positions (node.engine.llamacpp):
    the pool holds raw bytes, block_bytes is the state size of a full block."""
    model = LlamaModel.open(cfg.model, cfg.llamacpp)
    ctx = llama_context(cfg, model.n_ctx_train)
    bs = llama_block_size(cfg, model.n_ctx_train)  # the file's, so every host of a mesh agrees
    try:
        runner = LlamaRunner(model, cfg.llamacpp, slots=cfg.slots, max_context=ctx, block_size=bs,
                             exact_tail=cfg.reuse_tail is None)
    except BaseException:
        model.close()
        raise
    return Backend(model.tokenizer, ModelConfig(name=model.path.stem, vocab_size=model.n_vocab, max_context=ctx),
                   torch.uint8, torch.device("cpu"), (runner.block_bytes,), runner.block_bytes,
                   runner.kv_bytes_per_token, llama_fingerprint(model, cfg.llamacpp, None if runner.inexact else runner.layout, bs),
                   bs, llama=runner, inexact_reason=runner.inexact, weights=model.weights)


def make_runner(cfg: EngineConfig, backend: Backend, pool: BlockPool, seed_hash: bytes) -> Runner:
    """The back end under the bookkeeping, once the pool exists (runners write into it)."""
    if backend.llama is not None:
        backend.llama.attach(pool)
        return backend.llama
    if cfg.kind == "sim":
        return SimRunner(pool, SimCost(cfg.sim.prefill_tps, cfg.sim.decode_tps), backend.tokenizer.vocab_size,
                         seed=seed_hash, block_size=cfg.block_size, slots=cfg.slots)
    ckpt = backend.checkpoint
    weights = load_decoder(ckpt, backend.dtype, backend.device) if ckpt is not None else None
    return TorchRunner(backend.model_cfg, pool, cfg.slots, prefill_chunk=cfg.prefill_chunk,
                       first_chunk=cfg.first_chunk, model=weights)
