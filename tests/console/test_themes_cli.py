"""Themes (registered, colour-blind safe, NO_COLOR), formatting helpers, CLI config, discovery, and the bench."""

from __future__ import annotations

import asyncio
import colorsys
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_node import FakeEventsServer
from kvm_helpers import Clock, make_app, make_view, screen_text

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.cli import _run_parser, build_config
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.format import ASCII, UNICODE, fmt_age, fmt_bps, fmt_bytes, fmt_mem, fmt_tokens, slot_bar, sparkline
from kvmesh.console.state import ConsoleState
from kvmesh.console.theme import THEME_NAMES, load_themes

pytestmark = pytest.mark.anyio


def _hue(color: str) -> float:
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return colorsys.rgb_to_hsv(r, g, b)[0] * 360


def test_themes_load_and_colour_blind_theme_has_no_red_green_pair() -> None:
    """themes.toml defines dark, light and colour-blind-safe themes; the last uses no red-versus-green pair."""
    themes = {t.name: t for t in load_themes()}
    assert set(THEME_NAMES) <= set(themes)
    assert themes["kvmesh-dark"].dark and not themes["kvmesh-light"].dark
    cb = themes["kvmesh-cb"].variables
    hues = {k: _hue(cb[k]) for k in ("kvm-warm", "kvm-partial", "kvm-cold")}

    def reddish(h: float) -> bool:
        return h < 20 or h > 340

    def greenish(h: float) -> bool:
        return 75 <= h <= 165

    assert not any(greenish(h) for h in hues.values()), hues
    assert not (any(reddish(h) for h in hues.values()) and any(greenish(h) for h in hues.values()))


async def test_no_color_keeps_meaning_in_words(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """NO_COLOR set: Textual drops colour, and every class and state still reads as a word or glyph."""
    monkeypatch.setenv("NO_COLOR", "1")
    app, state = make_app(clock, snapshot=make_view())
    assert app.no_color
    words = ("WARM", "PART", "COLD", "UP")
    async with app.run_test(size=(80, 24)) as pilot:
        # The tables fill over a few refreshes; on a loaded CI machine 0.2 s showed the hosts table's header only.
        for _ in range(50):
            await pilot.pause(0.1)
            text = screen_text(app)
            if all(word in text for word in words):
                break
    for word in words:
        assert word in text, word


def test_format_helpers() -> None:
    """Units and glyphs read the same in Unicode and ASCII, with the numbers beside the bars."""
    assert fmt_bytes(512) == "512B" and fmt_bytes(1536) == "1.5K" and fmt_bytes(300 << 20) == "300M"
    assert fmt_mem(12 << 30, 64 << 30) == "12/64G"
    assert fmt_bps(9.4e9) == "9.4G" and fmt_bps(0) == "0"
    assert fmt_tokens(999) == "999" and fmt_tokens(12_345) == "12k" and fmt_tokens(1_500) == "1.5k"
    assert fmt_age(4) == "4s" and fmt_age(600) == "10m" and fmt_age(1e9) == ">99d"
    assert slot_bar(1, 4, UNICODE) == "█░░░ 1/4" and slot_bar(1, 16, ASCII) == "#... 1/16"
    assert sparkline([0, 1, 2, 4], ASCII, 6) == "   -+@"
    assert all(ord(ch) < 127 for ch in ASCII.__dict__.values() for ch in ch)


def test_cli_config_file_and_flags(tmp_path: Path) -> None:
    """A TOML config supplies nodes and options; flags win; unknown keys (like a token) are rejected."""
    cfg_file = tmp_path / "console.toml"
    cfg_file.write_text('[console]\nnodes = ["http://a:8000", "http://b:8000"]\ntheme = "kvmesh-light"\nreadonly = true\n')
    args = _run_parser().parse_args(["--config", str(cfg_file), "--theme", "kvmesh-cb"])
    cfg = build_config(args)
    assert cfg.nodes == ["http://a:8000", "http://b:8000"] and cfg.theme == "kvmesh-cb" and cfg.readonly
    bad = tmp_path / "bad.toml"
    bad.write_text('admin_token = "oops"\n')
    with pytest.raises(ValueError, match="unknown config keys"):
        build_config(_run_parser().parse_args(["--config", str(bad)]))


async def test_discovers_peers_from_one_node() -> None:
    """Given one node, the console follows every peer listed in its snapshot (hosts[].api)."""
    urls: dict[str, str] = {}

    def view(node: str):  # type: ignore[no-untyped-def]
        snap = make_view(node=node)
        snap.cluster.hosts[0].api = urls["node-1"]
        snap.cluster.hosts[1].api = urls["node-2"]
        snap.cluster.hosts[2].api = ""  # no API advertised: nothing to follow
        return snap

    first = FakeEventsServer(lambda: view("node-1"))
    peer = FakeEventsServer(lambda: view("node-2"))
    urls["node-1"] = first.start()
    urls["node-2"] = peer.start()
    first_url = urls["node-1"]
    try:
        state = ConsoleState()
        app = KvmeshConsole(ConsoleConfig(nodes=[first_url], discover=True, refresh_interval=0.1), state=state)
        async with app.run_test(size=(80, 24)) as pilot:
            for _ in range(100):
                if state.connected_count() == (2, 2):
                    break
                await pilot.pause(0.05)
            assert state.connected_count() == (2, 2)
            assert {c.name for c in state.nodes.values()} == {"node-1", "node-2"}
            assert any("discovered node-2" in e.text for e in state.log)
    finally:
        # Off the event loop: the servers' closing handshakes need the console's sockets answered.
        await asyncio.to_thread(first.stop)
        await asyncio.to_thread(peer.stop)


def test_bench_prints_json_last_line() -> None:
    """`kvmesh-console bench --json --ended N` (shortened) ends with one JSON object: the five figures, the
    ended sessions, and a sessions table that lists the live ones only."""
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.console", "bench", "--json", "--seconds", "1.5", "--sessions", "300",
         "--events-per-s", "100", "--warmup", "0.3", "--ended", "200"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    for key in ("sessions", "events_per_s", "cpu_core_fraction", "p95_refresh_ms", "max_rss_mb"):
        assert key in result
    assert result["sessions"] == 300 and result["events_per_s"] > 50
    assert result["ended_sessions"] == 200 and result["rows_on_screen_table"] == 100
    assert 0 < result["cpu_core_fraction"] < 2 and result["max_rss_mb"] > 10


def test_an_installed_wheel_carries_the_themes_and_finds_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               kvmesh_wheel: Path) -> None:
    """The wheel puts themes/ under <prefix>/share/kvmesh/themes, and the console loads them from there
    when it runs from an installed package (no checkout beside it)."""
    import zipfile

    import kvmesh.console.theme as theme

    repo = Path(__file__).resolve().parents[2]
    whl = kvmesh_wheel
    prefix = tmp_path / "prefix"
    with zipfile.ZipFile(whl) as z:
        names = {n.split(".data/data/", 1)[1]: n for n in z.namelist() if ".data/data/" in n}
        for f in ("kvmesh.tcss", "themes.toml"):
            member = names[f"share/kvmesh/themes/{f}"]
            assert z.read(member) == (repo / "themes" / f).read_bytes()
            (prefix / "share/kvmesh/themes").mkdir(parents=True, exist_ok=True)
            (prefix / "share/kvmesh/themes" / f).write_bytes(z.read(member))
    monkeypatch.delenv("KVMESH_THEMES_DIR", raising=False)
    monkeypatch.setattr(theme, "__file__", str(tmp_path / "site-packages" / "kvmesh" / "console" / "theme.py"))
    monkeypatch.setattr(sys, "prefix", str(prefix))
    assert theme.themes_dir() == prefix / "share/kvmesh/themes"
    assert set(THEME_NAMES) <= {t.name for t in load_themes()}
