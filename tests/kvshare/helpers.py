"""Helpers for the kv_share tests: synthetic replicas and a small, fast sim engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from kvmesh.node.config import EngineConfig, SimConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest
from kvmesh.node.engine.hashing import block_hashes, chain_seed, payload_digest

FP = "test-fingerprint"


@dataclass
class Replica:
    """Tokens, chain hashes, payloads and digests of a synthetic session."""

    fingerprint: str
    block_size: int
    block_bytes: int
    tokens: np.ndarray
    hashes: list[bytes]
    payloads: list[bytes]
    digests: list[bytes]

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)


def make_replica(n_blocks: int, *, block_size: int = 8, block_bytes: int = 256, seed: int = 0, fingerprint: str = FP) -> Replica:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 256, n_blocks * block_size, dtype=np.int32)
    hashes = block_hashes(chain_seed(fingerprint), toks, block_size)
    payloads = [rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes() for _ in range(n_blocks)]
    return Replica(fingerprint, block_size, block_bytes, toks, hashes, payloads, [payload_digest(p) for p in payloads])


def grow(rep: Replica, more_blocks: int, *, seed: int) -> Replica:
    """The same session a turn later: the old blocks unchanged, `more_blocks` appended."""
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, 256, more_blocks * rep.block_size, dtype=np.int32)
    toks = np.concatenate([rep.tokens, extra])
    hashes = block_hashes(chain_seed(rep.fingerprint), toks, rep.block_size)
    payloads = rep.payloads + [rng.integers(0, 256, rep.block_bytes, dtype=np.uint8).tobytes() for _ in range(more_blocks)]
    return Replica(rep.fingerprint, rep.block_size, rep.block_bytes, toks, hashes, payloads, [payload_digest(p) for p in payloads])


def sim_engine(cache_bytes: int = 8 << 20) -> Engine:
    sim = SimConfig(kv_scale=0.01, prefill_tps=1e7, decode_tps=1e6)
    return Engine(EngineConfig(kind="sim", cache_bytes=cache_bytes, block_size=64, sim=sim))


def run_turn(engine: Engine, session: str, prompt: np.ndarray) -> None:
    async def turn() -> None:
        async for _ in engine.generate(GenerateRequest(session, prompt, max_tokens=2)):
            pass

    asyncio.run(turn())


def prompt_tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.int32)


def prefix(rep: Replica, k: int) -> Replica:
    """The first k blocks of a replica."""
    return Replica(rep.fingerprint, rep.block_size, rep.block_bytes, rep.tokens[: k * rep.block_size], rep.hashes[:k],
                   rep.payloads[:k], rep.digests[:k])
