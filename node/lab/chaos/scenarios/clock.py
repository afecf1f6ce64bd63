"""The clock-jump scenario: one host's wall clock jumps +1 h, then -2 h, while the mesh works.

The jump is real in the victim's process: the drill starts it with `clockshim` as its site hook
and rewrites the offset file mid-run, so every time.time() in that node jumps (the monotonic
clocks cannot). The drill proves the jump took effect from the node's own answers: the `created`
stamp of a turn pinned on the victim must be off by the offset. If it is not, the fault was not
injected and the scenario reports "not run", never "passed". After each jump a migration must
still move the session's home (every node agrees), the peers must stay reachable, and turns must
succeed. A static check of which clock the node's code uses for durations runs first.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kvmesh.node.lab.chaos import clockshim
from kvmesh.node.lab.chaos.clocklint import wall_clock_findings
from kvmesh.node.lab.chaos.harness import NAMES, POLL_S, Drill
from kvmesh.node.lab.chaos.scenarios.base import Scenario
from kvmesh.node.lab.chaos.turns import Conv

CLOCK_VICTIM = "node-c"
JUMP_S = 3600.0
# How far the victim's observed clock offset may be from the one written: the answer's `created`
# is whole seconds, stamped while the turn runs (queued behind the load, at worst ~a minute).
OFFSET_TOLERANCE_S = 60.0


def _clock_env(d: Drill) -> dict[str, dict[str, str]]:
    """The victim's site hook and offset file (the offset starts at 0)."""
    shim = d.workdir / "clockshim"
    shim.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(clockshim.__file__, shim / "sitecustomize.py")
    clock = d.workdir / "clock-offset.txt"
    _set_offset(clock, 0.0)
    d.fault["clock_file"] = str(clock)
    path = os.pathsep.join([str(shim), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    return {CLOCK_VICTIM: {"PYTHONPATH": path, clockshim.ENV: str(clock)}}


def _set_offset(clock: Path, seconds: float) -> None:
    tmp = clock.with_name(clock.name + ".tmp")
    tmp.write_text(f"{seconds:+.0f}\n")
    os.replace(tmp, clock)  # the shim never reads half a file


async def _victim_offset(d: Drill, k: int) -> float | None:
    """How far the victim's wall clock is from ours, read from a turn pinned on it (None: no answer)."""
    probe = Conv(f"clock-probe-{k}-{d.seed}", d.seed + 100 + k, 800)
    before = time.time()
    res = await d.turn(CLOCK_VICTIM, probe, pin=True, max_tokens=2)
    after = time.time()
    if not res.ok or res.created is None:
        return None
    return res.created - (before + after) / 2


def _static_check(d: Drill) -> None:
    findings = wall_clock_findings(Path(__file__).resolve().parents[3])
    bad = [f for f in findings if not f["allowed"]]
    d.fault["static_check"] = {"findings": len(findings), "violations": bad,
                               "allowed": [f"{f['file']}:{f['line']} {f['why']}" for f in findings if f["allowed"]]}
    d.checks["durations_use_monotonic_static"] = not bad


async def _after_jump(d: Drill, offset: float, src: str, dst: str, k: int) -> dict[str, Any]:
    """With the victim's clock jumped: a migration moves the home everywhere, peers stay reachable."""
    way = "forward" if offset > 0 else "backward"
    health = await d.get(CLOCK_VICTIM, "/health")
    m = Conv(f"clock-{'fwd' if offset > 0 else 'back'}-{d.seed}", d.seed + k, 5000)
    await d.turn(src, m, pin=True)
    await d.quiesce(0.5, 15.0, session=m.session)
    mig = await d.migrate(m.session, src, dst)
    await asyncio.sleep(4 * POLL_S)
    homes = {e: await d.home(e, m.session) for e in NAMES}
    nxt = await d.turn("node-b", m)
    reach = await d.get("node-a", "/v1/cluster")
    out = {"jump": f"{offset:+.0f} s on {CLOCK_VICTIM}", "migrate": f"{m.session} {src}->{dst}: {mig.get('ok')}",
           "home_seen_by": homes, "next_turn": nxt.brief(), "uptime_s_on_jumped_host": health["uptime_s"],
           "peers_reachable": all(h["reachable"] for h in reach["hosts"])}
    d.checks[f"migrate_moves_home_after_{way}_jump"] = bool(mig.get("ok")) and all(h == dst for h in homes.values())
    d.checks[f"peers_stay_reachable_{way}"] = out["peers_reachable"]
    return out


async def sc_clock_jump(d: Drill) -> None:
    _static_check(d)
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    clock = Path(d.fault["clock_file"])
    jumps: list[dict[str, Any]] = []
    try:
        for offset, src, dst in ((JUMP_S, CLOCK_VICTIM, "node-a"), (-JUMP_S, "node-a", CLOCK_VICTIM)):
            _set_offset(clock, offset)
            seen = await _victim_offset(d, len(jumps))
            if seen is None or abs(seen - offset) > OFFSET_TOLERANCE_S:
                shown = "unreadable" if seen is None else f"{seen:+.0f} s"
                d.cannot_inject(f"the clock shim did not take effect on {CLOCK_VICTIM}: "
                                f"its clock is off by {shown}, not {offset:+.0f} s")
                return
            jumps.append({"victim_clock_offset_s": round(seen, 1), **await _after_jump(d, offset, src, dst, len(jumps))})
    finally:
        _set_offset(clock, 0.0)
        d.fault["jumps"] = jumps
    d.fault["hit"] = len(jumps) == 2
    await asyncio.sleep(2.0)


SCENARIOS = [
    Scenario("clock-jump", "wall clock of one host jumps +1 h then -2 h (clock shim); static check of durations",
             sc_clock_jump, faulted=CLOCK_VICTIM, env=_clock_env),
]
