"""The vLLM engine (kind "vllm"): kvmesh's block bookkeeping over a vLLM server that does the compute.

The node stays the front door (dialects, sessions, placement, kv_share, events); vLLM holds the live
cache and computes. The host's block pool is shared memory (node.engine.vllm.pool) that vLLM's worker
maps through kvmesh's connector (node.engine.vllm.connector); the node keeps the only index of it, with
the same parts as every engine: the session table, the block manager, the prefix index (whole blocks,
chained hashes as kv_share's), exports and imports, admission and slots. Only the compute differs: a
turn sends the prompt's ids to vLLM with the pool blocks to load and the blocks to fill (node.engine.vllm.turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import AsyncGenerator

import httpx
import numpy as np
import torch

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.admission import SessionLocks
from kvmesh.node.engine.blocks import BlockManager
from kvmesh.node.engine.boundary import (
    Admission,
    EngineCounters,
    TextDelta,
    TurnBegin,
    TurnDone,
)
from kvmesh.node.engine.export_import import BlockTransfers
from kvmesh.node.engine.hashing import chain_seed
from kvmesh.node.engine.hf import open_checkpoint
from kvmesh.node.engine.holding import BlockHolding
from kvmesh.node.engine.prefix import BlockPrefix
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.engine.tokenizer import HFTokenizer, Tokenizer
from kvmesh.node.engine.vllm.layout import kv_bytes_per_token
from kvmesh.node.engine.vllm.models import cache_dir, checkpoint_dir, on_cuda
from kvmesh.node.engine.vllm.pool import ShmPool, pool_path, pool_stem, remove_stale_pools
from kvmesh.node.engine.vllm.server import Launch, VllmServer, vllm_python
from kvmesh.node.engine.vllm.turn import NoRunner, SealedImport, VllmTurn
from kvmesh.node.errors import ConfigError

log = logging.getLogger("kvmesh.engine.vllm")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VllmEngine(BlockHolding):
    """N slots over the shared block pool, vLLM underneath (see the module docstring)."""

    inexact_reason: str | None = None  # whole blocks of attention KV: every model vLLM serves here has replicas
    snapshots = None  # no window or recurrent state travels beside the blocks (hybrid models: refused, node.engine.vllm.recurrent)
    weights = None
    checkpoint = None
    swa = None  # no sliding-window mode to choose

    def __init__(self, cfg: EngineConfig, *, name: str = "node"):
        # Unset, a block is vLLM's own: the partial last block never moves, so the smaller the warmer a move.
        self.block_size = cfg.block_size if "block_size" in cfg.model_fields_set else cfg.vllm.vllm_block
        if self.block_size % cfg.vllm.vllm_block:
            raise ConfigError(f"engine.block_size {self.block_size} is not a multiple of vLLM's block "
                              f"(engine.vllm.vllm_block = {cfg.vllm.vllm_block})")
        self.cfg, self.model_name = cfg, cfg.served_model
        python, cache = vllm_python(cfg.vllm.python), cache_dir(cfg)
        self.device = torch.device("cuda" if on_cuda(cfg) else "cpu")
        model_dir = checkpoint_dir(cfg.model, python=python, cache_dir=cache, cuda=self.device.type == "cuda")
        ckpt = open_checkpoint(model_dir, max_context=cfg.max_context)
        self.model_cfg, self.max_context = ckpt.config, ckpt.config.max_context
        self.tokenizer: Tokenizer = HFTokenizer.from_dir(model_dir, extra_eos_ids=ckpt.config.eos_ids)
        want = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[want]
        self.kv_bytes_per_token = kv_bytes_per_token(ckpt.raw_config, self.dtype.itemsize)
        self.block_bytes = self.kv_bytes_per_token * self.block_size
        num_blocks = max(4, -(-cfg.cache_tokens // self.block_size) if cfg.cache_tokens else cfg.cache_bytes // self.block_bytes)
        remove_stale_pools()  # killed nodes' pools: shared memory nobody will free otherwise
        self.pool = ShmPool(pool_path(name), num_blocks, self.block_bytes)
        run_dir = cache / "run" / pool_stem(self.pool.path)
        self.server = VllmServer(Launch(python, model_dir, self.model_name, want, self.max_context, cfg.slots,
                                        self.pool.path, self.block_size, cfg.vllm.vllm_block, run_dir, cache,
                                        cfg.vllm.kvcache_gib, cfg.vllm.cpu_cores, list(cfg.vllm.extra_args)))
        try:
            self.server.start(cfg.vllm.start_timeout_s)
            self.fingerprint = self._fingerprint(ckpt.config.checkpoint, want)
            self._warm_up()
        except BaseException:
            self.close()
            raise
        self.seed_hash = chain_seed(self.fingerprint)
        self.blocks = BlockManager(num_blocks, self.block_size)
        self.slots = SlotScheduler(cfg.slots, cfg.queue_max, cfg.queue_timeout_s)
        self.counters = EngineCounters()
        self.table = SessionTable(self.blocks, self.counters)
        self.sessions = self.table.seqs  # LRU first
        self.prefix = BlockPrefix(self.table, NoRunner(), self.seed_hash, resumable=None, tail_reused=False)
        self.transfers = BlockTransfers(self.table, self.pool, seed_hash=self.seed_hash, fingerprint=self.fingerprint,
                                        cached_prefix=self.cached_prefix, inexact_reason=None)
        self._locks = SessionLocks()
        self._restart, self.restarts = asyncio.Lock(), 0
        self.turns = VllmTurn(self.table, self.prefix, self.pool, seed_hash=self.seed_hash, model_name=self.model_name,
                              url=self.server.url, tokenizer=self.tokenizer)

    def _fingerprint(self, checkpoint: str, dtype: str) -> str:
        """Model, dtype, vLLM's version, the KV layout its worker reported and the block size."""
        layout = self.pool.file.layout()
        if layout is None:
            raise ConfigError("vLLM started without kvmesh's connector: the pool has no KV layout")
        version = httpx.get(f"{self.server.url}/version", timeout=10.0).json().get("version", "?")
        blob = json.dumps({"arch": "vllm/v1", "checkpoint": checkpoint, "dtype": dtype, "vllm": version,
                           "layout": layout, "block": self.block_size}, sort_keys=True)
        log.info("vLLM %s, KV layout %s", version, layout)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def _warm_up(self) -> None:
        """One small turn before serving: vLLM's first forwards here take seconds (kernels built on first use),
        which would otherwise land on a client's first turn and on every cold-prefill measurement."""
        body = {"model": self.model_name, "prompt": list(range(10, 10 + 2 * self.cfg.vllm.vllm_block + 7)),
                "max_tokens": 4, "temperature": 0.0}
        httpx.post(f"{self.server.url}/v1/completions", json=body, timeout=self.cfg.vllm.start_timeout_s).raise_for_status()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{self.server.url}/reset_prefix_cache", timeout=30.0)

    def evict_all(self) -> int:
        """Every idle session dropped, every unreferenced block forgotten, and vLLM's own prefix cache reset: cold."""
        n = super().evict_all()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{self.server.url}/reset_prefix_cache", timeout=30.0)
        return n

    # ---- turns ---------------------------------------------------------------

    async def _supervise(self) -> None:
        """vLLM exited (crashed, killed): start it again before this turn, one restart at a time. The pool
        and its index outlive it, so sessions stay warm; only vLLM's own prefix cache is gone."""
        async with self._restart:
            if self.server.alive():
                return
            log.warning("vLLM exited (%s); starting it again", self.server.log_tail(3))
            self.restarts += 1
            await asyncio.to_thread(self.server.start, self.cfg.vllm.start_timeout_s)
            await self.turns.moved(self.server.url)

    async def run(self, adm: Admission) -> AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]:
        try:
            if not self.server.alive():
                await self._supervise()
            async with contextlib.aclosing(self.turns.run(adm.req, adm.tokens, adm.t0)) as events:
                async for ev in events:
                    yield ev
        finally:
            adm.release()

    def prefill_backlog(self) -> int:
        return self.turns.prefill_backlog

    def prefill_rate(self) -> float:
        r = self.counters.recent_prefill_tps
        return sorted(r)[len(r) // 2] if r else 2000.0

    # ---- export / import -----------------------------------------------------

    def begin_import(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes]) -> SealedImport:
        """As every engine's, and the landed blocks are sealed (digested) off the loop once committed."""
        return SealedImport(self.transfers.begin_import(session, fingerprint, tokens, hashes), self.pool)

    def close(self) -> None:
        """Stop vLLM (its whole process group), remove the pool's file and the server's run folder (its log)."""
        self.server.stop()
        if not getattr(self, "restarts", 0):  # a vLLM that died leaves its log behind, for whoever asks why
            shutil.rmtree(self.server.launch.run_dir, ignore_errors=True)
        turns = getattr(self, "turns", None)
        if turns is not None:
            with contextlib.suppress(RuntimeError):  # without a running loop, its connections go with it
                asyncio.get_running_loop().create_task(turns.aclose())
        self.pool.close()


__all__ = ["VllmEngine"]
