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


def test_a_first_ubatch_is_padded_to_the_kind_every_host_computes_it_in() -> None:
    """With f16 flash attention a first ubatch is padded to 64 rows (LARGE), with one kind to 2 rows; a first ubatch
    long enough already, or cut short only by the grid of a longer prefill, is padded by what it lacks."""
    assert (F16_FLASH.least, F16_FLASH.want, ONE_KIND.least, ONE_KIND.want) == (64, LARGE, 2, SMALL)
    assert F16_FLASH.pad(128, 138) == 54 and F16_FLASH.pad(128, 300) == 0 and F16_FLASH.pad(130, 300) == 0
    assert Shapes(BS, 256, 100, 64).pad(620, 700) == 8  # the grid from 576 cuts the first ubatch at 676: 56 rows
    assert ONE_KIND.pad(128, 129) == 1 and ONE_KIND.pad(128, 130) == 0
    assert Shapes(BS, 512, 32, 64).least == 2  # ubatches never reach 64 rows: one prefill kind


def test_reuse_keeps_every_common_token_of_the_kind_a_block_host_computes() -> None:
    """A 40-token tail computed LARGE is kept to the common prefix whatever the next prompt's length, leaving two
    tokens to compute (one would be a decode step); SMALL cells are not kept where a first ubatch is LARGE."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(40, LARGE)]).astype(np.uint8)
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=200) == 168
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=170) == 168
    assert F16_FLASH.reuse(kinds, common=168, floor=128, end=169) == 167
    small = np.concatenate([np.full(128, LARGE), np.full(40, SMALL)]).astype(np.uint8)
    assert F16_FLASH.reuse(small, common=168, floor=128, end=200) == 128
    assert ONE_KIND.reuse(small, common=168, floor=128, end=200) == 168


def test_reuse_stops_at_the_first_cell_of_another_kind_and_never_below_the_floor() -> None:
    """Decoded cells (a reply) are never kept: reuse stops where they start; a prompt sharing only the blocks keeps
    the floor; restored cells (UNKNOWN) are never kept past it either, nor cells past the block's end."""
    kinds = np.concatenate([np.full(128, LARGE), np.full(10, SMALL), np.full(20, DECODE)]).astype(np.uint8)
    assert ONE_KIND.reuse(kinds, common=158, floor=128, end=170) == 138
    assert ONE_KIND.reuse(kinds, common=120, floor=128, end=170) == 128
    restored = np.concatenate([np.full(128, UNKNOWN), np.full(30, UNKNOWN)]).astype(np.uint8)
    assert ONE_KIND.reuse(restored, common=158, floor=128, end=170) == 128
    assert ONE_KIND.reuse(np.full(300, SMALL, dtype=np.uint8), common=290, floor=128, end=300) == 191


def test_a_turns_end_settles_its_last_blocks_cells_of_another_kind_as_one_batch() -> None:
    """The last partial block's cells from its first one not of the wanted kind are recomputed [lo, n): decoded
    ones, and with two kinds SMALL ones too; a block all of that kind, or ending on a boundary, needs nothing."""
    kinds = np.concatenate([np.full(128, SMALL), np.full(10, SMALL), np.full(15, DECODE)]).astype(np.uint8)
    assert ONE_KIND.settle(kinds, 153, floor=128) == (138, 153)
    assert F16_FLASH.settle(kinds, 153, floor=128) == (128, 153)
    assert ONE_KIND.settle(np.full(150, SMALL, dtype=np.uint8), 150, floor=128) is None
    assert F16_FLASH.settle(np.full(150, LARGE, dtype=np.uint8), 150, floor=128) is None
    assert ONE_KIND.settle(np.full(128, DECODE, dtype=np.uint8), 128, floor=0) is None
    assert ONE_KIND.settle(np.full(129, DECODE, dtype=np.uint8), 129, floor=0) == (128, 129)
