"""A push's acknowledged bytes count as backlogged in the share of each sampled interval the link was backlogged."""

from __future__ import annotations

from kvmesh.node.kvshare.links import _Progress


class _Clocks:
    """A hand-driven monotonic clock and the link's cumulative backlogged seconds."""

    def __init__(self) -> None:
        self.now = 100.0
        self.backlog = 0.0

    def progress(self) -> _Progress:
        """A push starting now, sampling this clock and backlog."""
        return _Progress(lambda: self.backlog, clock=lambda: self.now)


def test_bytes_acked_count_in_the_backlogged_share_of_each_interval() -> None:
    """Half an interval backlogged: half its bytes count; none backlogged: none; all: all."""
    c = _Clocks()
    prog = c.progress()
    c.now, c.backlog = 101.0, 0.5
    prog.acked_to(1000)
    assert prog.backlogged == 500
    c.now = 102.0
    prog.acked_to(3000)
    assert prog.backlogged == 500
    c.now, c.backlog = 103.0, 1.5
    prog.acked_to(4000)
    assert (prog.acked, prog.backlogged) == (4000, 1500)


def test_a_long_verdict_wait_with_a_push_queued_at_its_end_is_not_all_backlogged() -> None:
    """Bytes acked over a 4 s wait for the verdict, a push queued for its last 0.1 s: 2.5% of them count."""
    c = _Clocks()
    prog = c.progress()
    c.now, c.backlog = 104.0, 0.1
    prog.acked_to(8_000_000)
    assert prog.backlogged == 200_000
