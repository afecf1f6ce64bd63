"""The node's side of the shared block pool: a `BlockPool` whose bytes are the shared file, and the
digests ("seals") of blocks the node itself wrote.

The engine's parts (session table, block manager, exports and imports) use it as any pool. A replica
landed by kv_share is sealed on a worker thread after its import commits; a turn waits for the seals
of the blocks it asks vLLM to load, since the connector refuses a block without one.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import torch

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.vllm.layout import EMPTY, SEALED, PoolFile


def pool_path(name: str) -> Path:
    """A fresh file under /dev/shm (shared memory) for a node's pool."""
    base = Path("/dev/shm")
    return (base if base.is_dir() else Path("/tmp")) / f"kvmesh-{name}-{uuid.uuid4().hex[:12]}.pool"


class ShmPool(BlockPool):
    """`num_blocks` blocks of `block_bytes` raw bytes in the shared file (created, touched once, removed on close)."""

    def __init__(self, path: Path, num_blocks: int, block_bytes: int):
        self.file = PoolFile.create(path, num_blocks, block_bytes)
        self.path = path
        self.num_blocks, self.block_shape = num_blocks, (block_bytes,)
        self.dtype, self.device, self.block_bytes = torch.uint8, torch.device("cpu"), block_bytes
        self.raw = torch.frombuffer(self.file.blocks.reshape(-1), dtype=torch.uint8)  # type: ignore[call-overload]
        self.kv = self.raw.view(num_blocks, block_bytes)
        self._seals: dict[int, asyncio.Future[None]] = {}

    def reset(self, ids: list[int]) -> None:
        """Blocks about to be written by vLLM: not loadable until the connector seals them (the caller
        waited for their pending seals first, so none lands after this)."""
        for bid in ids:
            self.file.states[bid] = EMPTY

    def sealed(self, bid: int) -> bool:
        return int(self.file.states[bid]) == SEALED

    def seal_later(self, ids: list[int]) -> None:
        """Seal blocks the node wrote (a landed replica): on a worker thread when a loop runs, else now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            for bid in ids:
                self.file.seal(bid)
            return
        for bid in ids:
            self._seals[bid] = loop.run_in_executor(None, self.file.seal, bid)

    async def seals(self, ids: list[int]) -> None:
        """Wait until these blocks' seals (if any are pending) are written."""
        for bid in ids:
            if (fut := self._seals.get(bid)) is not None:
                await fut
                if self._seals.get(bid) is fut:
                    del self._seals[bid]

    def close(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)
