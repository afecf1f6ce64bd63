"""Tail shapes (node.engine.tailshapes): which of a slot's own cells past its last full block a turn keeps, so it
computes what a host holding only whole blocks computes; the ubatch grid, and what a turn's end settles."""

from __future__ import annotations

import numpy as np

from kvmesh.node.engine.tailshapes import DECODE, LARGE, SMALL, UNKNOWN, Shapes

BS = 64
F16_FLASH = Shapes(BS, 512, 512, 64)  # two prefill kinds: under 64 tokens, and 64 or more
ONE_KIND = Shapes(BS, 512, 512, None)  # a quantized cache: every prefill of 2+ tokens is one kind


def test_the_kind_of_a_ubatch_is_by_its_size() -> None:
    """One token is a decode step; 2-63 SMALL and 64+ LARGE with f16 flash attention; one kind without."""
    assert [F16_FLASH.kind(n) for n in (1, 2, 63, 64, 512)] == [DECODE, SMALL, SMALL, LARGE, LARGE]
    assert [ONE_KIND.kind(n) for n in (1, 2, 64, 512)] == [DECODE, SMALL, SMALL, SMALL]


def test_ubatch_edges_are_on_a_grid_from_the_block_boundary_wherever_the_prefill_starts() -> None:
    """A prefill from 130 and one from the boundary at 128 end their ubatches at the same places past 130 (calls of
    256 cut into ubatches of 100); a ubatch's cells are of its size's kind (the 56- and 60-token ones SMALL)."""
    s = Shapes(BS, 256, 100, 64)
    assert s.edges(128, 700) == [228, 328, 384, 484, 584, 640, 700]
    assert s.edges(130, 700) == s.edges(128, 700)
    assert s.edges(130, 200) == [200] and s.edges(128, 200, mark=192) == [192, 200]
    kinds = s.kinds(128, 700)
    assert len(kinds) == 572 and int((kinds == LARGE).sum()) == 400 and int((kinds == SMALL).sum()) == 172
    assert (kinds[200:256] == SMALL).all() and (kinds[256:456] == LARGE).all()


def test_reuse_keeps_own_cells_only_of_the_kind_a_block_host_computes() -> None:
    """A 40-token tail computed SMALL. A next prompt to 200, whose block host's first ubatch [128, 200) is LARGE: none
    is kept. A prompt to 188 (that ubatch 60 tokens, SMALL): all 40 are kept; to 169, all but one, so the turn's own
    first ubatch is at least 2 tokens (one would be a decode step)."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(40, SMALL)]).astype(np.uint8)
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=200) == 128
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=188) == 168
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=169) == 167  # one new token: the turn recomputes two


def test_reuse_stops_at_the_first_cell_of_another_kind_and_never_below_the_floor() -> None:
    """Decoded cells (a reply) are never kept: reuse stops where they start; a prompt sharing only the blocks keeps
    the floor; restored cells (UNKNOWN) are never kept past it either."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(10, SMALL), np.full(20, DECODE)]).astype(np.uint8)
    assert ONE_KIND.reuse(kinds, common=158, floor=128, end=170) == 138
    assert ONE_KIND.reuse(kinds, common=120, floor=128, end=170) == 128
    restored = np.concatenate([np.full(128, UNKNOWN), np.full(30, UNKNOWN)]).astype(np.uint8)
    assert ONE_KIND.reuse(restored, common=158, floor=128, end=170) == 128


def test_reuse_of_a_large_kind_leaves_the_turns_first_ubatch_large() -> None:
    """A 64-token block host's first ubatch [128, 300) is LARGE: own LARGE cells are kept up to where the turn's own
    first ubatch would still be 64 tokens or more (within the block: at most floor + 63)."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(63, LARGE)]).astype(np.uint8)
    assert F16_FLASH.reuse(kinds, common=191, floor=128, end=300) == 191
    assert F16_FLASH.reuse(kinds, common=191, floor=128, end=230) == 230 - 64


def test_a_turns_end_settles_its_last_blocks_decoded_cells_as_one_batch() -> None:
    """One kind: the last partial block's cells from its first decoded one are recomputed [lo, n) (at least two);
    a block already all SMALL, or ending on a boundary, needs nothing."""
    kinds = np.concatenate([np.full(128, SMALL), np.full(10, SMALL), np.full(15, DECODE)]).astype(np.uint8)
    assert ONE_KIND.settle(kinds, 153, floor=128, fresh=0) == (138, 153)
    assert ONE_KIND.settle(np.full(150, SMALL, dtype=np.uint8), 150, floor=128, fresh=0) is None
    assert ONE_KIND.settle(np.full(128, DECODE, dtype=np.uint8), 128, floor=0, fresh=0) is None


def test_with_two_kinds_the_settle_guesses_the_next_turns_batch_from_this_ones() -> None:
    """25 tail cells: a next turn adding as many as this one (10 fresh: 35 < 64) would compute them SMALL, so they
    are recomputed SMALL; one adding 100 (LARGE) would not keep SMALL cells: nothing is settled."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(10, SMALL), np.full(15, DECODE)]).astype(np.uint8)
    assert F16_FLASH.settle(kinds, 153, floor=128, fresh=10) == (128, 153)
    assert F16_FLASH.settle(kinds, 153, floor=128, fresh=100) is None
