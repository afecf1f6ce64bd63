"""The demo view (`v`, `--view demo`): big counters, link sparklines, handoffs as they happen, and the
read-only rules of the demo view and the browser view (`--serve`)."""

from __future__ import annotations

import shlex

import pytest
from kvm_helpers import T0, Clock, FakeAdmin, FakeSource, make_app, make_view, screen_text
from test_snapshots import scenario

from kvmesh.console.cli import _run_parser, build_config
from kvmesh.console.screens.confirm import ConfirmScreen
from kvmesh.console.screens.demo import DemoScreen
from kvmesh.console.screens.main import MainScreen
from kvmesh.console.serve import console_command
from kvmesh.console.theme import THEME_NAMES
from kvmesh.node.protocol import Handoff, ReplicaSent

pytestmark = pytest.mark.anyio


async def settle(pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot.pause()
    pilot.app.refresh_view()
    await pilot.pause()


async def test_demo_view_shows_counters_links_and_handoffs_as_they_happen(clock: Clock) -> None:
    """--view demo opens on the demo view; a live handoff moves the big counter and tops the handoff list."""
    source = FakeSource()
    app, state = make_app(clock, source=source, snapshot=make_view(), view="demo")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, DemoScreen)
        source.push(ReplicaSent(ts=T0 + 9, node="node-1", seq=1, session="s-000", src="node-1", dst="node-2",
                                blocks=40, bytes=300 << 20, seconds=2.5, tokens=40_000),
                    Handoff(ts=T0 + 9.5, node="node-2", seq=2, session="s-004", src="node-3", dst="node-2",
                            cls="cold", prompt_tokens=14_000, reused_tokens=10))
        await source.drained()
        await settle(pilot)
        text = screen_text(app)
        assert "WARM % of 53" in text and "○ COLD" in text
        handoffs = text.split("Handoffs as they happen")[1]
        assert "22:13:29 ○ COLD s-004 node-3→node-2 reused 0%" in handoffs.splitlines()[1]
        links = text.split("Links: replica throughput")[1].splitlines()[1]
        assert "node-1→node-2" in links and "█" in links and "Mb/s" in links
        assert str(app.screen.query_one("#demo-count-cold").value) == "2"  # type: ignore[attr-defined]
        await pilot.press("v")
        await settle(pilot)
        assert isinstance(app.screen, MainScreen)
        assert "COLD 2" in screen_text(app), "the main screen caught up with what arrived while it was hidden"


async def test_demo_view_started_read_only_refuses_mesh_actions(clock: Clock) -> None:
    """A console started in the demo view without --admin is read-only: back on the main view, d is refused."""
    args = _run_parser().parse_args(["--demo", "--view", "demo"])
    cfg = build_config(args)
    assert cfg.readonly and not cfg.admin
    admin = FakeAdmin()
    app, state = make_app(clock, admin=admin, snapshot=make_view(), view="demo", readonly=cfg.readonly)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert "RO" in screen_text(app)
        await pilot.press("v", "h", "d")
        await settle(pilot)
        assert isinstance(app.screen, MainScreen) and admin.calls == []
        app.request_action("drain", ["node-1"])
        await settle(pilot)
        assert not isinstance(app.screen, ConfirmScreen)
        assert any("read-only" in e.text for e in state.log)


async def test_demo_view_with_admin_allows_actions_on_the_main_view(clock: Clock) -> None:
    """--view demo --admin keeps the actions: back on the main view, d opens the confirm modal."""
    cfg = build_config(_run_parser().parse_args(["--demo", "--view", "demo", "--admin"]))
    assert not cfg.readonly
    app, state = make_app(clock, admin=FakeAdmin(), snapshot=make_view(), view="demo", readonly=cfg.readonly)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("v", "h", "d")
        await settle(pilot)
        assert isinstance(app.screen, ConfirmScreen)


def test_browser_view_is_read_only_unless_admin() -> None:
    """--serve binds loopback by default and starts read-only consoles; --admin starts them with actions."""
    argv = ["--serve", "--port", "9001", "--demo", "--view=demo"]
    args = _run_parser().parse_args(argv)
    assert args.host == "127.0.0.1" and args.port == 9001
    cfg = build_config(args)
    assert cfg.readonly
    child = shlex.split(console_command(argv, cfg))
    assert child[0] == "exec" and child[2:] == ["-m", "kvmesh.console", "--demo", "--view=demo", "--readonly"]
    argv = ["--serve", "--host=0.0.0.0", "--demo", "--admin"]
    cfg = build_config(_run_parser().parse_args(argv))
    assert not cfg.readonly
    assert shlex.split(console_command(argv, cfg))[2:] == ["-m", "kvmesh.console", "--demo", "--admin"]
    with pytest.raises(ValueError):
        build_config(_run_parser().parse_args(["--readonly", "--admin"]))


async def _open_demo(pilot) -> None:  # type: ignore[no-untyped-def]
    pilot.app.refresh_view()
    await pilot.pause()
    await pilot.press("v")
    await pilot.pause()
    pilot.app.refresh_view()
    await pilot.pause()
    await pilot.pause()


@pytest.mark.parametrize("theme", THEME_NAMES)
@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_demo_view_snapshot(snap_compare, theme: str, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """The demo view in each theme at 80x24 and 120x40: big counters, a link sparkline, the latest handoff."""
    assert snap_compare(scenario(theme), terminal_size=size, run_before=_open_demo)


def test_demo_view_ascii_snapshot(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """--ascii demo view at 80x24: plain bold numbers, no box drawing."""
    assert snap_compare(scenario(ascii_only=True, readonly=True), terminal_size=(80, 24), run_before=_open_demo)
