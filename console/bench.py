"""`kvmesh-console bench`: the real app, headless, against a synthetic busy mesh.

Defaults: 2,000 sessions on 4 hosts, 200 events/s, 30 s, a 120x40 screen (every
panel on screen). `--hosts 256 --sessions 20000`: a mesh past the directory threshold, one
stream per host, each cluster view only that host's part (console.synthetic), so startup_s is the
time until every part is merged into the full view (all sessions, all hosts). `--ended N`: N of the sessions finished long ago (a long run's history);
the sessions table lists live ones only, so `rows_on_screen_table` is the live count. `--threads N`: each
client session is a main conversation and N threads of it (the table reads each group as one). Events go through the same path as the wire (JSON -> parse_event ->
ConsoleState) and the same timer-driven patching; only the terminal write is
skipped (headless driver), the rendering into screen lines is not.

Measured over the steady state, after the first cluster view is on screen:
cpu_core_fraction = process CPU seconds / wall seconds; p95_refresh_ms = 95th
percentile of refresh tick start -> screen repainted (wall clock, so it includes
waiting for a core on a busy machine; p95_refresh_cpu_ms is the same interval in
this thread's CPU time, and loadavg_1m says how busy the machine was);
max_rss_mb = peak RSS.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from typing import Any

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.state import ConsoleState
from kvmesh.console.synthetic import SyntheticMesh, run_synthetic, view_frames

WARMUP_S = 2.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def _run(
    seconds: float, sessions: int, events_per_s: float, size: tuple[int, int], warmup: float, ended: int, hosts: int,
    threads: int = 0,
) -> dict[str, Any]:
    # Long: one measured run, from the synthetic mesh to its report, with every clock reading in one place.
    mesh = SyntheticMesh(sessions=sessions, hosts=hosts, ended=ended, threads=threads)
    state = ConsoleState()
    # What the nodes would send is made before the clock starts: the console's cost is parsing it, not this.
    frames = view_frames(mesh, time.time())

    async def source(st: ConsoleState) -> None:
        await run_synthetic(mesh, st.feed_frame, st.node_connected, events_per_s=events_per_s, clock=time.time,
                            frames=frames)

    app = KvmeshConsole(ConsoleConfig(discover=False), state=state, sources=[("synthetic", source)])
    t_start = time.perf_counter()
    cpu_start = time.process_time()
    async with app.run_test(size=size, headless=True) as pilot:
        # Wait for the cluster view to be on screen, then let the first builds settle.
        while len(state.sessions) < sessions or len(state.hosts) < hosts:
            await asyncio.sleep(0.05)
        await pilot.pause()
        startup_s = time.perf_counter() - t_start
        await asyncio.sleep(warmup)
        app.refresh_ms.clear()
        app.refresh_cpu_ms.clear()
        app.patch_ms.clear()
        load0 = os.getloadavg()[0]
        events0 = state.events_total
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        wall1, cpu1 = time.perf_counter(), time.process_time()
        events1 = state.events_total
        refresh = list(app.refresh_ms)
        refresh_cpu = list(app.refresh_cpu_ms)
        patch = list(app.patch_ms)
        load1 = os.getloadavg()[0]
        rows = app.main.query_one("#sessions").row_count  # type: ignore[attr-defined]
    wall = wall1 - wall0
    return {
        "sessions": len(state.sessions),
        "hosts": len(state.hosts),
        "streams": len(state.nodes),
        "ended_sessions": state.lifecycle_counts["ended"],
        "threads_per_group": threads,
        "events_per_s": round((events1 - events0) / wall, 1),
        "cpu_core_fraction": round((cpu1 - cpu0) / wall, 4),
        "p95_refresh_ms": round(percentile(refresh, 95), 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # extra context, not part of the goal
        "seconds": round(wall, 2),
        "refreshes": len(refresh),
        "p50_refresh_ms": round(percentile(refresh, 50), 2),
        "p95_patch_ms": round(percentile(patch, 95), 2),
        "p95_refresh_cpu_ms": round(percentile(refresh_cpu, 95), 2),
        "loadavg_1m": round(max(load0, load1), 2),
        "cpu_cores": os.cpu_count(),
        "max_refresh_ms": round(max(refresh) if refresh else 0.0, 2),
        "startup_s": round(startup_s, 2),
        "startup_cpu_s": round(cpu0 - cpu_start, 2),
        "rows_on_screen_table": rows,
        "size": f"{size[0]}x{size[1]}",
    }


def run_bench(
    seconds: float = 30.0, sessions: int = 2000, events_per_s: float = 200.0, size: tuple[int, int] = (120, 40),
    as_json: bool = False, warmup: float = WARMUP_S, ended: int = 0, hosts: int = 4, threads: int = 0,
) -> dict[str, Any]:
    print(f"kvmesh-console bench: {sessions} sessions ({ended} ended) on {hosts} hosts, {events_per_s:g} events/s,"
          f" {seconds:g} s, {size[0]}x{size[1]}", flush=True)
    result = asyncio.run(_run(seconds, sessions, events_per_s, size, warmup, ended, hosts, threads))
    print(f"  events applied      {result['events_per_s']:.0f}/s")
    print(f"  cpu core fraction   {result['cpu_core_fraction']:.3f}  (goal <= 0.25)")
    print(f"  refresh p50 / p95   {result['p50_refresh_ms']:.1f} / {result['p95_refresh_ms']:.1f} ms  (goal p95 <= 100)")
    print(f"  refresh CPU p95     {result['p95_refresh_cpu_ms']:.1f} ms  (this thread's own cost)")
    print(f"  load average        {result['loadavg_1m']:.1f} on {result['cpu_cores']} cores (other processes)")
    print(f"  max RSS             {result['max_rss_mb']:.0f} MiB")
    print(f"  startup             {result['startup_s']:.2f} s to the full view ({result['streams']} streams)"
          "  (goal <= 5)")
    print(f"  sessions table      {result['rows_on_screen_table']} rows ({result['ended_sessions']} ended not listed)")
    if as_json:
        print(json.dumps(result), flush=True)
    return result
