"""KV block storage: one preallocated, pre-touched pool and its manager.

`BlockPool` owns the bytes: `[num_blocks, layers, 2, kv_heads, block, head_dim]`,
one contiguous block per index so a block exports and imports as one memcpy
(or one `recv_into`). `BlockManager` owns the bookkeeping, as in nano-vllm:
a hash -> block map, ref counts, and a free list kept in LRU order. A freed
block stays addressable by its hash until the free list hands it out again,
so "is it cached?" is always answered from what the pool really holds.
Every capacity check (`can_allocate`) is separate from its action (`allocate`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch


class BlockPool:
    """Raw KV bytes for `num_blocks` blocks; allocated and touched once, at start."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.block_shape = block_shape  # [layers, 2, kv_heads, block, head_dim]
        self.dtype = dtype
        self.device = device
        elems = int(np.prod(block_shape))
        self.block_bytes = elems * torch.empty((), dtype=dtype).element_size()
        # One flat byte buffer, viewed as typed blocks: byte views feed sockets
        # and files, typed views feed attention. Zero-filled = pre-touched.
        self.raw = torch.zeros(num_blocks * self.block_bytes, dtype=torch.uint8, device=device)
        self.kv = self.raw.view(dtype).view(num_blocks, *block_shape)

    def bytes_view(self, block_id: int) -> memoryview:
        """Writable bytes of one block (CPU pools only): recv_into / memcpy target."""
        if self.device.type != "cpu":
            raise RuntimeError("bytes_view needs a CPU pool; use write_bytes on accelerators")
        lo = block_id * self.block_bytes
        return memoryview(self.raw[lo : lo + self.block_bytes].numpy())  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree

    def write_bytes(self, block_id: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy one block's bytes in (host -> device when the pool is on an accelerator)."""
        lo = block_id * self.block_bytes
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        with warnings.catch_warnings():
            # A read-only source (an mmap'd replica) is only read here; torch warns regardless.
            warnings.simplefilter("ignore", UserWarning)
            self.raw[lo : lo + self.block_bytes].copy_(torch.from_numpy(src))

    def read_bytes(self, block_id: int) -> memoryview:
        """One block's bytes for export: a zero-copy view on CPU, a host copy otherwise."""
        lo = block_id * self.block_bytes
        chunk = self.raw[lo : lo + self.block_bytes]
        if self.device.type != "cpu":
            chunk = chunk.cpu()
        return memoryview(chunk.numpy())  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree


@dataclass
class Block:
    block_id: int
    ref: int = 0
    hash: bytes | None = None
    tokens: np.ndarray | None = field(default=None, repr=False)


class BlockManager:
    """Ref counts, the hash map and the LRU free list of a `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.by_hash: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, h: bytes, tokens: np.ndarray) -> int | None:
        """The block holding exactly these tokens under this hash, if the pool still has it."""
        bid = self.by_hash.get(h)
        if bid is None:
            return None
        blk = self.blocks[bid]
        # The token comparison rules out a hash collision.
        if blk.tokens is None or not np.array_equal(blk.tokens, tokens):
            return None
        return bid

    def can_allocate(self, n: int) -> bool:
        return len(self.free) >= n

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the LRU end of the free list; their old hashes are forgotten."""
        if not self.can_allocate(n):
            raise RuntimeError(f"allocate({n}) with only {len(self.free)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            blk = self.blocks[bid]
            if blk.hash is not None and self.by_hash.get(blk.hash) == bid:
                del self.by_hash[blk.hash]
            blk.hash, blk.tokens, blk.ref = None, None, 1
            out.append(bid)
        return out

    def acquire(self, bid: int) -> None:
        """Take a reference on a block (a cached block leaves the free list)."""
        blk = self.blocks[bid]
        if blk.ref == 0:
            del self.free[bid]
        blk.ref += 1

    def release(self, bids: list[int]) -> None:
        """Drop references; a block reaching zero joins the free list, still addressable."""
        for bid in bids:
            blk = self.blocks[bid]
            blk.ref -= 1
            if blk.ref < 0:
                raise RuntimeError(f"block {bid} released more than acquired")
            if blk.ref == 0:
                if blk.hash is None:
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)  # nothing to keep: reuse first
                else:
                    self.free[bid] = None

    def register(self, bid: int, h: bytes, tokens: np.ndarray) -> None:
        """Advertise a block under its hash, once its KV bytes are written."""
        blk = self.blocks[bid]
        blk.hash, blk.tokens = h, tokens.copy()
        self.by_hash.setdefault(h, bid)

    def forget(self, bids: list[int]) -> None:
        """Stop advertising these blocks (their bytes are not to be trusted); refs are unchanged."""
        for bid in bids:
            blk = self.blocks[bid]
            if blk.hash is not None and self.by_hash.get(blk.hash) == bid:
                del self.by_hash[blk.hash]
            blk.hash, blk.tokens = None, None

    def forget_all(self) -> None:
        """Drop every hash of an unreferenced block (a whole-cache eviction)."""
        for bid in list(self.free):
            blk = self.blocks[bid]
            if blk.hash is not None and self.by_hash.get(blk.hash) == bid:
                del self.by_hash[blk.hash]
            blk.hash, blk.tokens = None, None
