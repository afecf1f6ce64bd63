"""Which of a slot's own cells a turn may keep token by token, so that it computes exactly what a host holding
only the session's whole blocks (a replica, the store) computes.

llama.cpp's CPU kernels give a position's KV cells (and its hidden states) bit for bit the same value whatever
batch computed it, within one *kind* of micro-batch (ubatch): one token (a decode step: a matrix-vector
product, a split-KV attention), fewer than 64 (tinyBLAS matrix products, the one-row flash attention) and 64 or
more (the same products, the tiled flash attention, for an f16/f32/bf16 cache). Measured on SmolLM2: within a
kind, 2..63 and 64..512 tokens give identical cells; across kinds the logits move by up to ~1.2 (of ~35). With a
quantized cache the last two kinds are one. A row's cells never depend on the rows after it (causal attention),
so rows of padding past a ubatch's last token, dropped once it is computed, give it the kind of a longer one.

So every prefill of an exact-tail engine runs its first ubatch at least `Shapes.least` rows long (padded where
shorter), on a grid from its block boundary (`Shapes.edges`): its first ubatch, the only one whose start differs
between a host starting at the block boundary and one keeping cells past it, is then of the kind `Shapes.want`
on every host, and the later ones are the same ubatches. A turn keeps its slot's cells past the last full block
where they are of that kind (`Shapes.reuse`): every common token, up to the block's end. A reply's cells are decode
steps, another kind: a turn's end recomputes its last partial block's cells not of that kind as one padded batch
(`Shapes.settle`), the work a next turn holding only blocks would do anyway, done before its time to first token.

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

    @property
    def least(self) -> int:
        """The fewest rows of a padded first ubatch: the size from which cells are LARGE where this context has
        that kind within a ubatch, else 2 (one row would be a decode step)."""
        big = self.large_from
        return big if big is not None and big <= self.n_ubatch else 2

    @property
    def want(self) -> int:
        """The kind of every first ubatch's cells (padded to `least`): the only kind a turn keeps past a block."""
        return self.kind(self.least)

    def pad(self, start: int, end: int) -> int:
        """Rows of padding the first ubatch of a prefill of [start, end) takes, to be `least` rows long."""
        return max(0, self.least - (self.edges(start, end)[0] - start))

    def reuse(self, kinds: np.ndarray, common: int, floor: int, end: int) -> int:
        """How many leading tokens of a prompt of `end` tokens a turn keeps from a slot whose cells have these
        `kinds` and agree with the prompt on `common` tokens, where a host holding whole blocks starts at
        `floor` (a block boundary): every common token of the block past it that is of kind `want`, leaving at
        least two tokens to compute (one is a decode step, of another kind than that host's prefill). At least
        `floor`."""
        r = min(common, floor + self.block_size - 1, end - 2)
        if r <= floor:
            return floor
        bad = np.flatnonzero(kinds[floor:r] != self.want)
        return floor + int(bad[0]) if len(bad) else r

    def settle(self, kinds: np.ndarray, n: int, floor: int) -> tuple[int, int] | None:
        """The cells [lo, n) a turn's end recomputes as one (padded) batch, so that the next turn keeps them; None
        when every cell of the last partial block is of kind `want` already. Never one before `floor`: the
        blocks the turn reused whole are in the pool as they are."""
        lo = max(n - n % self.block_size, floor)
        bad = np.flatnonzero(kinds[lo:n] != self.want)
        return (lo + int(bad[0]), n) if len(bad) else None
