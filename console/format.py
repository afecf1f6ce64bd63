"""Plain-text formatting for the console: sizes, rates, ages, clocks, glyph sets.

No Textual imports: the state model, the widgets and the tests all use these, and
the tests check them without an app. Every glyph that carries meaning has an
ASCII twin (`--ascii`), and every colour the widgets add sits beside a word or a
glyph from here, never alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

HandoffWord = Literal["WARM", "PART", "COLD"]

CLASS_WORDS: dict[str, HandoffWord] = {"warm": "WARM", "partial": "PART", "cold": "COLD"}

# Why a handoff was not warm as predicted, in words (node.protocol.ShortfallReason; "none" has none).
SHORTFALL_WORDS: dict[str, str] = {"prompt_diverged": "diverged", "replica_in_flight": "in flight",
                                   "replica_refused": "refused", "evicted": "evicted", "no_replicas": "no replicas",
                                   "new_input": "new input", "replica_behind": "replica behind",
                                   "unexplained": "unexplained"}
# The reasons a handoff gives when it reused what placement predicted (the prediction itself was short).
PREDICTION_SHORT = frozenset({"new_input", "replica_behind"})


def fmt_shortfall(counts: Mapping[str, int]) -> str:
    """Handoffs that were not warm as predicted, per reason, compactly ("in flight 2, refused 1"):
    only reasons counted at least once, "none" left out; "" when there are none."""
    known = [r for r in SHORTFALL_WORDS if counts.get(r)]
    other = sorted(r for r, n in counts.items() if n and r != "none" and r not in SHORTFALL_WORDS)
    return ", ".join(f"{SHORTFALL_WORDS.get(r, r)} {counts[r]}" for r in known + other)


@dataclass(frozen=True)
class Glyphs:
    """The characters the console draws with; one set for Unicode, one for ASCII."""

    warm: str
    partial: str
    cold: str
    fresh: str  # replica caught up with the home cache
    behind: str  # replica exists but lags
    stale: str  # replica missing whole blocks with no push coming
    inflight: str  # a push of the replica is moving now
    running: str  # session lifecycle: a turn in flight (idle sessions get a blank)
    ended: str  # session lifecycle: no turn for a while, or held nowhere
    none: str  # no replica / no value
    bar_full: str
    bar_empty: str
    spark: str  # low-to-high ramp for sparklines
    arrow: str  # link direction
    mark: str  # row marked for a batch action
    thread: str  # a conversation of a client session listed under its main ("› #a1b2c3d4")
    cursor: str  # current view in the compact view bar
    down: str  # bytes in
    up: str  # bytes out
    ellipsis: str
    dot: str  # separator in titles
    overflow: str  # Rich overflow for lines too long: "ellipsis" draws U+2026, so ASCII crops

    def handoff(self, cls: str | None) -> str:
        if cls == "warm":
            return self.warm
        if cls == "partial":
            return self.partial
        if cls == "cold":
            return self.cold
        return self.none


UNICODE = Glyphs(
    warm="●", partial="◐", cold="○", fresh="●", behind="◐", stale="○", none="—", inflight="⇄", running="▶", ended="×",
    bar_full="█", bar_empty="░", spark="▁▂▃▄▅▆▇█", arrow="→", mark="✓", thread="›", cursor="▸",
    down="↓", up="↑", ellipsis="…", dot="·", overflow="ellipsis",
)
ASCII = Glyphs(
    warm="#", partial="~", cold=".", fresh="#", behind="~", stale=".", none="-", inflight="=", running=">", ended="x",
    bar_full="#", bar_empty=".", spark="_.-=+*#@", arrow=">", mark="*", thread="\\", cursor=">",
    down="v", up="^", ellipsis="~", dot="|", overflow="crop",
)


def glyphs_for(ascii_only: bool) -> Glyphs:
    return ASCII if ascii_only else UNICODE


def fmt_bytes(n: float | None) -> str:
    """Binary units, three significant figures: 512B, 1.5K, 23M, 4.0G."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            if unit == "B":
                return f"{int(n)}B"
            return f"{n:.1f}{unit}" if abs(n) < 10 else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.0f}T"  # pragma: no cover - loop always returns


def fmt_mem(used: int, total: int) -> str:
    """'12/64G' style: used over total in the total's unit, so the column stays short."""
    if total <= 0:
        return fmt_bytes(used) if used else "-"
    for unit, div in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if total >= div:
            u, t = used / div, total / div
            us = f"{u:.1f}" if u < 10 else f"{u:.0f}"
            ts = f"{t:.0f}" if t >= 10 else f"{t:.1f}".rstrip("0").rstrip(".")
            return f"{us}/{ts}{unit}"
    return f"{used}/{total}B"


def fmt_bps(bits_per_s: float | None) -> str:
    """Network rates in decimal bits: 0, 850k, 12M, 9.4G (per second implied by the column)."""
    if bits_per_s is None:
        return "-"
    v = float(bits_per_s)
    if v < 1:
        return "0"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= div:
            x = v / div
            return f"{x:.1f}{unit}" if x < 10 else f"{x:.0f}{unit}"
    return f"{v:.0f}"


def fmt_mbps(bits_per_s: float | None) -> str:
    """Throughput in Mb/s, the unit the issue asks the links view to show."""
    if bits_per_s is None:
        return "-"
    x = bits_per_s / 1e6
    if x < 0.05:
        return "0"
    if x < 10:
        return f"{x:.1f}"
    return f"{x:,.0f}"


def fmt_tokens(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1000:
        return str(n)
    if n < 10_000:
        return f"{n / 1000:.1f}k"
    if n < 1_000_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1e6:.1f}M"


def fmt_age(seconds: float | None) -> str:
    """Short age: 4s, 12m, 3h, 2d (the sessions table's replica age)."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.0f}h"
    if s < 100 * 86400:
        return f"{s / 86400:.0f}d"
    return ">99d"  # the column is four wide; anything this old is simply old


def fmt_seconds(seconds: float | None) -> str:
    """Durations of transfers: 0.42s, 12ms, 3.1s."""
    if seconds is None:
        return "-"
    if seconds < 0.1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 10:
        return f"{seconds:.2f}s"
    return f"{seconds:.0f}s"


def fmt_clock(ts: float | None, utc: bool = False) -> str:
    """HH:MM:SS wall time (local unless utc, which the tests use for determinism)."""
    if not ts:
        return "--:--:--"
    t = time.gmtime(ts) if utc else time.localtime(ts)
    return time.strftime("%H:%M:%S", t)


def fmt_pct(value: float) -> str:
    return f"{value:.1f}%"


def slot_bar(busy: int, slots: int, glyphs: Glyphs, width: int = 4) -> str:
    """A fixed-width busy/free bar plus the numbers, so it reads without colour."""
    if slots <= 0:
        return glyphs.bar_empty * width + " -/-"
    filled = min(width, round(width * busy / slots)) if busy else 0
    if busy and filled == 0:
        filled = 1  # one busy slot must never look idle
    return glyphs.bar_full * filled + glyphs.bar_empty * (width - filled) + f" {busy}/{slots}"


def sparkline(values: Iterable[float], glyphs: Glyphs, width: int) -> str:
    """Right-aligned sparkline of the last `width` values, scaled to their own max."""
    vals = list(values)[-width:]
    ramp = glyphs.spark
    if not vals:
        return " " * width
    top = max(vals)
    out = []
    for v in vals:
        if top <= 0 or v <= 0:
            out.append(" ")
        else:
            out.append(ramp[min(len(ramp) - 1, int(v / top * (len(ramp) - 1) + 0.5))] if v > 0 else " ")
            if out[-1] == " ":
                out[-1] = ramp[0]
    return (" " * (width - len(out))) + "".join(out)


def truncate(text: str, width: int, glyphs: Glyphs) -> str:
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    return text[: width - 1] + glyphs.ellipsis


def truncate_middle(text: str, width: int, glyphs: Glyphs) -> str:
    """Keep both ends of a long id ("sess…148"): ids that share a prefix (a kind, a client session) differ at
    the end."""
    if len(text) <= width:
        return text
    if width <= 2:
        return text[:width]
    head = width // 2
    return text[:head] + glyphs.ellipsis + text[len(text) - (width - 1 - head):]
