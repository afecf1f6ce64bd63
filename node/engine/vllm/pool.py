"""The node's side of the shared block pool: a `BlockPool` whose bytes are the shared file, and the
digests ("seals") of blocks the node itself wrote.

The engine's parts (session table, block manager, exports and imports) use it as any pool. A replica
landed by kv_share is sealed on a worker thread after its import commits; a turn waits for the seals
of the blocks it asks vLLM to load, since the connector refuses a block without one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import uuid
from pathlib import Path

import psutil
import torch

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.vllm.layout import EMPTY, SEALED, PoolFile

log = logging.getLogger("kvmesh.engine.vllm")

# The owner's PID and start time (centiseconds since the epoch) end the name: a node killed before it could
# remove its pool (SIGKILL, OOM) leaves the file in /dev/shm, holding memory, until a later node sees it dead.
_OWNER = re.compile(r"\.p(\d+)-(\d+)\.pool$")


def _base() -> Path:
    base = Path("/dev/shm")
    return base if base.is_dir() else Path("/tmp")


def _started(pid: int) -> int:
    return round(psutil.Process(pid).create_time() * 100)


def pool_path(name: str) -> Path:
    """A fresh file under /dev/shm (shared memory) for a node's pool, named with this process as its owner."""
    pid = os.getpid()
    return _base() / f"kvmesh-{name}-{uuid.uuid4().hex[:12]}.p{pid}-{_started(pid)}.pool"


def pool_stem(path: Path) -> str:
    """The pool's name without its owner and suffix (`kvmesh-<name>-<id>`): short, for folders named after it
    (vLLM binds sockets under its run folder, and a socket's path is limited to 107 bytes)."""
    return _OWNER.sub("", path.name).removesuffix(".pool")


def _owner_alive(pid: int, started: int) -> bool:
    try:
        # Within a second: the start time is read from boot time plus ticks, which may round apart between reads.
        return abs(_started(pid) - started) <= 100
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # someone else's live process: not ours to judge


def remove_stale_pools(base: Path | None = None) -> list[Path]:
    """Remove the pool files whose owner is gone (no such PID, or the PID now names a later process); a file
    without an owner in its name (an older node's) is left alone. Returns the files removed."""
    removed = []
    for path in (base or _base()).glob("kvmesh-*.pool"):
        m = _OWNER.search(path.name)
        if m is None or _owner_alive(int(m[1]), int(m[2])):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
        log.warning("removed %s: a pool left by process %s, which is gone", path, m[1])
    return removed


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
