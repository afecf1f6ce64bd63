"""Which of a slot's own cells a turn may keep token by token, so that it computes exactly what a host holding
only the session's whole blocks (a replica, the store) computes.

llama.cpp's CPU kernels give a position's KV cells (and its hidden states) bit for bit the same value whatever
batch computed it, within one *kind* of micro-batch (ubatch): one token (a decode step: a matrix-vector
product, a split-KV attention), fewer than 64 (tinyBLAS matrix products, the one-row flash attention) and 64 or
more (the same products, the tiled flash attention, for an f16/f32/bf16 cache). Measured on SmolLM2: within a
kind, 2..63 and 64..512 tokens give identical cells; across kinds the logits move by up to ~1.2 (of ~35). With a
quantized cache the last two kinds are one. So a turn that keeps cells [B, r) past its last full block B computes
what a host restoring the blocks to B and computing [B, L) computes only if every kept cell is of the kind that
host's first ubatch has, and the turn's own first ubatch [r, ...) is of that kind too, its later ubatches on the
same grid (`Shapes.edges`: a prefill's ubatches are cut from its block boundary, wherever it starts).

A reply's cells are decode steps, a kind no prefill has: `Shapes.settle` says which of the last partial block's
cells a turn's end recomputes as one batch, so the next turn can keep them (the cells a next turn holding only
blocks would recompute anyway: the same work, done before instead of inside the next turn's time to first token).

Pure arithmetic on positions and kinds: `node.engine.llamacpp` (LlamaRunner) and `node.engine.live` (OwnTail)
apply it to a llama.cpp slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DECODE, SMALL, LARGE, UNKNOWN = 0, 1, 2, 3  # how a cell was computed (UNKNOWN: restored, never kept past a block)


@dataclass(frozen=True)
class Shapes:
    """A context's prefill geometry: blocks, `llama_decode` calls, ubatches, and where ubatches turn LARGE."""

    block_size: int
    n_batch: int
    n_ubatch: int
    large_from: int | None  # ubatch size from which cells are of another kind (64 for f16 flash attention), or None

    def kind(self, n: int) -> int:
        """The kind of the cells a ubatch of n tokens computes."""
        if n <= 1:
            return DECODE
        return LARGE if self.large_from is not None and n >= self.large_from else SMALL

    def edges(self, start: int, end: int, mark: int = 0) -> list[int]:
        """The ends of the ubatches a prefill of [start, end) runs as, ascending (the last is `end`).

        Calls of n_batch tokens cut into ubatches of n_ubatch, on a grid from the block boundary at or before
        `start`: a prefill from that boundary and one from a later position share every edge past it. `mark`,
        if inside, is an edge too (a snapshot's block boundary)."""
        origin = start - start % self.block_size
        out: list[int] = []
        call = origin
        while call < end:
            top = min(call + self.n_batch, end)
            e = call
            while e < top:
                e = min(e + self.n_ubatch, top)
                if e > start:
                    out.append(e)
            call += self.n_batch
        if start < mark < end and mark not in out:
            out = sorted([*out, mark])
        return out

    def kinds(self, start: int, end: int, mark: int = 0) -> np.ndarray:
        """The kind of each cell of [start, end) a prefill from `start` computes."""
        out = np.empty(end - start, dtype=np.uint8)
        lo = start
        for e in self.edges(start, end, mark):
            out[lo - start : e - start] = self.kind(e - lo)
            lo = e
        return out

    def reuse(self, kinds: np.ndarray, common: int, floor: int, end: int) -> int:
        """How many leading tokens of a prompt of `end` tokens a turn keeps from a slot whose cells have these
        `kinds` and agree with the prompt on `common` tokens, where a host holding whole blocks starts at
        `floor` (a block boundary). At least `floor`; at most `common`, and less where the kinds ask it."""
        if common <= floor:
            return floor
        first = self.edges(floor, end)[0]  # that host's first ubatch is [floor, first)
        want = self.kind(first - floor)
        if want == DECODE:
            return floor
        r = min(common, floor + self.block_size - 1)  # within the block: the turn's own grid starts at floor too
        bad = np.flatnonzero(kinds[floor:r] != want)
        if len(bad):
            r = floor + int(bad[0])
        # The turn's first ubatch [r, first) must be of that kind as well: >= 2 tokens, >= large_from if LARGE.
        least = self.large_from if want == LARGE and self.large_from is not None else 2
        return max(floor, min(r, first - least))

    def settle(self, kinds: np.ndarray, n: int, floor: int, fresh: int) -> tuple[int, int] | None:
        """The cells [lo, n) a turn's end recomputes as one batch (None: none), so that the next turn keeps them.

        Only the last partial block's, never one before `floor` (blocks the turn reused whole are in the pool
        as they are). With two prefill kinds, the next turn is guessed to add as many tokens as this one
        computed (`fresh`; a first turn's whole prompt): a chat's short messages SMALL, an agent's long tool
        results LARGE. Only a batch of the last block's own cells is
        recomputed, which the next turn would otherwise recompute itself, so cells that would need a longer
        batch (LARGE ones, in 64-token blocks) are left as they are."""
        lo = max(n - n % self.block_size, floor)
        if n - lo < 2:
            return None
        if self.large_from is None:  # one prefill kind: recompute from the first cell not of it
            bad = np.flatnonzero(kinds[lo:n] != SMALL)
            if not len(bad):
                return None
            lo = min(lo + int(bad[0]), n - 2)  # >= 2 tokens; a SMALL cell recomputed comes out the same
            return lo, n
        want = self.kind(min(n - lo + fresh, self.n_ubatch))
        if self.kind(n - lo) != want or bool((kinds[lo:n] == want).all()):
            return None
        return lo, n
