"""`kvmesh soak --minutes M`: 64 coding-agent sessions on a three-node sim mesh, for M minutes.

Three `kvmesh node` processes on loopback (sim engine, kv_scale 0.02) take the
`node.lab.load` workload through every node as an entry. Reported, as one JSON
object on the last stdout line:

- errors: failed turns as the load generator counts them (non-200 answers,
  in-band stream errors, transport errors), with the status counts;
- p50/p99 turn latency (and time to first token), from the client's side;
- per node: RSS at start and at end, its growth, the highest RSS seen, open
  file descriptors and threads at start and at end (psutil on the node PIDs);
- replica store bytes per node (the store's own count and the bytes on disk);
- the mesh's handoff counters (GET /v1/cluster).

"Start" is the steady state: after a warm-up (10% of the run, 5 to 60 s) AND
once every node's replica store has filled to 90% of its byte budget (capped at
half the run). Until then memory grows by design: the first turns fill the KV
pool's bookkeeping and import lazy modules, and the store's in-memory index
(tokens and hashes of every replica it holds) grows with the replicas until the
budget bounds it. Growth after that is what a week-long run would accumulate.
Growth from the warm-up alone is reported too (`rss_growth_from_warmup_pct`),
with each node's anonymous RSS and store bytes per minute (`per_minute`).
RSS includes the store's mapped segment pages (file-backed, reclaimable); the
`shared` figure is that part.

A run passes when every rule below holds; `failed_rules` names each one that did
not, and the exit status says so:

- errors: 0 failed turns, and at least one turn completed;
- latency: client-side p99 turn latency at most `--max-p99-s` (30 s);
- fds: on every node, open file descriptors at the end at most `--max-fd-growth`
  (96) above the steady state ("start" above). At the end the load has stopped,
  so the clients' connections are closed; 96 leaves room for the replica store's
  segment mappings (at most 64 open store-wide, by design) and for the peers'
  keep-alive and kv_share connections opened after the start. A leak of one fd
  per turn or per transfer is far above it within a minute;
- RSS, when the run lasts 10 minutes or more: growth under `--max-rss-growth-pct`
  (5%) on every node (shorter runs are dominated by warm-up: reported, not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvmesh.node.lab.bench.common import start_mesh
from kvmesh.node.lab.launcher import NodeProcess, wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape

NAMES = ["node-a", "node-b", "node-c"]
MIB = 1 << 20
GROWTH_MIN_MINUTES = 10.0  # shorter runs are dominated by warm-up; their growth is reported, not judged
STORE_FULL = 0.9  # a store at this share of its byte budget is full: its index stops growing
MAX_P99_S = 30.0  # default bound on the client-side p99 turn latency
MAX_FD_GROWTH = 96  # default bound on a node's open fds at the end above the steady state (see the docstring)


def _sample(p: NodeProcess) -> dict[str, float]:
    """RSS (and its file-backed part), open fds and threads of one node process."""
    assert p.proc is not None
    ps = psutil.Process(p.proc.pid)
    with ps.oneshot():
        mem = ps.memory_info()
        return {"rss": float(mem.rss), "shared": float(mem.shared), "fds": float(ps.num_fds()),
                "threads": float(ps.num_threads())}


def _dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.nodes: list[NodeProcess] = []
        self.samples: dict[str, dict[str, dict[str, float]]] = {}  # node -> phase -> sample
        self.rss_max: dict[str, float] = {}
        self.series: dict[str, list[tuple[float, float, float]]] = {}  # node -> (t, anon RSS, fds)
        self.store_series: dict[str, list[tuple[float, int]]] = {}  # node -> (t, replica store bytes)
        self.steady_at: float | None = None  # when every store reached STORE_FULL of its budget
        self.t0 = time.monotonic()

    def take(self, phase: str) -> None:
        for p in self.nodes:
            s = _sample(p)
            self.samples.setdefault(p.name, {})[phase] = s
            self.rss_max[p.name] = max(self.rss_max.get(p.name, 0.0), s["rss"])
            self.series.setdefault(p.name, []).append((time.monotonic() - self.t0, s["rss"] - s["shared"], s["fds"]))

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait (at most timeout_s) until no node has a replica push in flight or queued, then half a second for
        receivers to close: the end sample is of idle nodes, whose threads and fds only a leak still holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                pending = sum(httpx.get(f"{p.api}/v1/stats", headers=p.key_headers, timeout=5.0).json()["kvshare"]["pushes_pending"]
                              for p in self.nodes)
            except (httpx.HTTPError, ValueError, KeyError):
                return
            if not pending:
                break
            time.sleep(0.2)
        time.sleep(0.5)

    def stores_full(self) -> bool:
        """Sample every node's store bytes; True when each is at STORE_FULL of its budget."""
        full = True
        for p in self.nodes:
            try:
                kv = httpx.get(f"{p.api}/v1/stats", headers=p.key_headers, timeout=5.0).json()["kvshare"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            self.store_series.setdefault(p.name, []).append((time.monotonic() - self.t0, int(kv["store_bytes"])))
            full = full and kv["store_bytes"] >= STORE_FULL * kv["store_budget_bytes"]
        return full

    async def _watch(self, every_s: float, stop: asyncio.Event, steady_after: float, steady_by: float) -> None:
        """Sample periodically, so a peak between start and end is seen too; take the "steady"
        sample once past the warm-up with every store full (or at steady_by, whichever first)."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(every_s):  # not wait_for: see node.mesh.statestream
                    await stop.wait()
            except TimeoutError:
                await asyncio.to_thread(self.take, "latest")
                full = await asyncio.to_thread(self.stores_full)
                t = time.monotonic() - self.t0
                if self.steady_at is None and t >= steady_after and (full or t >= steady_by):
                    self.steady_at = t
                    self.steady_reason = "stores full" if full else "stores not full by half the run"
                    await asyncio.to_thread(self.take, "steady")

    async def run(self) -> dict[str, Any]:
        a = self.args
        duration = a.minutes * 60.0
        warmup = min(60.0, max(5.0, 0.1 * duration))
        # Started in this thread, not a worker: Ctrl-C cancels at the next await, by which time
        # self.nodes names every process (start_mesh stops its own nodes if one fails to start).
        self.nodes = start_mesh(self.work, NAMES, slots=a.slots, kv_scale=a.kv_scale, cache_bytes=a.cache_mib * MIB,
                                extra={"kvshare": {"replicate_min_tokens": 4096}})
        wait_peers(self.nodes)
        self.take("ready")
        shape = LoadShape(sessions=a.sessions, target_tokens=a.target_tokens, max_tokens=a.max_tokens, seed=a.seed)
        runner = LoadRunner([n.api for n in self.nodes], shape, time_scale=a.time_scale)
        stop = asyncio.Event()
        t0 = self.t0 = time.monotonic()
        self.series.clear()
        load = asyncio.ensure_future(runner.run(duration))
        watch = asyncio.ensure_future(self._watch(10.0, stop, warmup, duration / 2))
        try:
            done, _ = await asyncio.wait({load}, timeout=warmup)
            if not done:
                await asyncio.to_thread(self.take, "start")
            stats = await load  # the load stops itself at `duration` and lets turns in flight finish
        finally:
            stop.set()
            await asyncio.gather(watch, return_exceptions=True)
            if not load.done():
                load.cancel()
        elapsed = time.monotonic() - t0
        await asyncio.to_thread(self.settle)
        await asyncio.to_thread(self.take, "end")
        async with httpx.AsyncClient(timeout=10.0, headers=self.nodes[0].key_headers) as http:
            node_stats = {p.name: (await http.get(f"{p.api}/v1/stats")).json() for p in self.nodes}
            await asyncio.sleep(1.0)  # a couple of status polls: every node's counters are in the view
            cluster = (await http.get(f"{self.nodes[0].api}/v1/cluster")).json()
        return self.report(stats.summary(), elapsed, node_stats, cluster)

    def _trend(self, name: str) -> dict[str, Any]:
        return _trend_of(self.series.get(name, []))

    def _per_minute(self, name: str) -> list[list[float]]:
        """[minute, anonymous RSS MiB, store MiB], one row a minute: does memory follow the store's fill?"""
        rows: list[list[float]] = []
        stores = self.store_series.get(name, [])
        for t, anon, _ in self.series.get(name, []):
            if not rows or t >= 60.0 * len(rows):
                st = min(stores, key=lambda x: abs(x[0] - t))[1] if stores else 0
                rows.append([round(t / 60, 1), round(anon / MIB, 1), round(st / MIB, 1)])
        return rows

    def report(self, load: dict[str, Any], elapsed: float, node_stats: dict[str, Any],
               cluster: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        nodes: dict[str, Any] = {}
        for p in self.nodes:
            s = self.samples[p.name]
            warm, end = s.get("start", s["ready"]), s["end"]
            start = s.get("steady", warm)
            nodes[p.name] = {
                "pid": p.proc.pid if p.proc else None,
                "rss_ready_mib": round(s["ready"]["rss"] / MIB, 1),
                "rss_start_mib": round(start["rss"] / MIB, 1), "rss_end_mib": round(end["rss"] / MIB, 1),
                "rss_max_mib": round(self.rss_max[p.name] / MIB, 1),
                "rss_growth_pct": round(100.0 * (end["rss"] - start["rss"]) / start["rss"], 2),
                "rss_growth_from_warmup_pct": round(100.0 * (end["rss"] - warm["rss"]) / warm["rss"], 2),
                "rss_shared_end_mib": round(end["shared"] / MIB, 1),
                # Anonymous memory (RSS less file-backed pages such as mapped store segments): a leak shows here.
                "rss_anon_start_mib": round((start["rss"] - start["shared"]) / MIB, 1),
                "rss_anon_end_mib": round((end["rss"] - end["shared"]) / MIB, 1),
                "rss_anon_growth_pct": round(100.0 * ((end["rss"] - end["shared"]) - (start["rss"] - start["shared"]))
                                             / (start["rss"] - start["shared"]), 2),
                "fds_start": int(start["fds"]), "fds_end": int(end["fds"]),
                "threads_start": int(start["threads"]), "threads_end": int(end["threads"]),
                "store_bytes": int(node_stats[p.name]["kvshare"]["store_bytes"]),
                "store_disk_bytes": _dir_bytes(self.work / f"store-{p.name}"),
                "engine_turns": int(node_stats[p.name]["engine"]["turns"]),
                **self._trend(p.name),
                "per_minute": self._per_minute(p.name),
            }
        growth = max(n["rss_growth_pct"] for n in nodes.values())
        judged = a.minutes >= GROWTH_MIN_MINUTES
        c = cluster["counters"]
        result: dict[str, Any] = {
            "minutes": a.minutes, "duration_s": round(elapsed, 1), "sessions": a.sessions, "slots": a.slots,
            "turns": load["turns"], "errors": load["errors"], "status": load["status"],
            "error_samples": load["error_samples"], "conversations": load["conversations"],
            "latency_p50_s": load["latency_p50_s"], "latency_p99_s": load["latency_p99_s"],
            "ttft_p50_s": load["ttft_p50_s"], "ttft_p99_s": load["ttft_p99_s"],
            "handoffs": {k: c[k] for k in ("warm", "partial", "cold", "stale_state_cold")},
            "nodes": nodes, "store_bytes_total": sum(n["store_bytes"] for n in nodes.values()),
            "rss_growth_max_pct": growth, "rss_anon_growth_max_pct": max(n["rss_anon_growth_pct"] for n in nodes.values()),
            "rss_growth_judged": judged,
            "steady_after_s": round(self.steady_at, 1) if self.steady_at is not None else None,
            "steady_reason": getattr(self, "steady_reason", "run too short"),
        }
        result["failed_rules"] = failed_rules(result, a)
        result["passed"] = not result["failed_rules"]
        return result


def failed_rules(r: dict[str, Any], limits: argparse.Namespace) -> list[str]:
    """Each pass rule (module docstring) this soak result breaks, as `rule: what was seen`."""
    out: list[str] = []
    if r["errors"] or not r["turns"]:
        out.append(f"errors: {r['errors']} failed of {r['turns']} turns")
    p99 = r["latency_p99_s"]
    if p99 is None or p99 > limits.max_p99_s:
        out.append(f"latency: p99 {p99}s over the {limits.max_p99_s:g}s bound")
    for name, n in r["nodes"].items():
        if n["fds_end"] - n["fds_start"] > limits.max_fd_growth:
            out.append(f"fds: {name} {n['fds_start']} -> {n['fds_end']} (+{n['fds_end'] - n['fds_start']}, "
                       f"bound +{limits.max_fd_growth})")
    if r["rss_growth_judged"] and r["rss_growth_max_pct"] >= limits.max_rss_growth_pct:
        out.append(f"rss: growth {r['rss_growth_max_pct']}% not under {limits.max_rss_growth_pct:g}%")
    return out


def _human(r: dict[str, Any]) -> None:
    print(f"soak: {r['duration_s']:.0f}s, {r['sessions']} sessions, {r['turns']} turns, {r['errors']} errors; "
          f"latency p50 {r['latency_p50_s']}s p99 {r['latency_p99_s']}s; handoffs {r['handoffs']}")
    for name, n in r["nodes"].items():
        print(f"  {name}: RSS {n['rss_start_mib']} -> {n['rss_end_mib']} MiB ({n['rss_growth_pct']:+.2f}%, max "
              f"{n['rss_max_mib']}; anon {n['rss_anon_growth_pct']:+.2f}%), fds {n['fds_start']} -> {n['fds_end']}, threads {n['threads_start']} -> "
              f"{n['threads_end']}, store {n['store_bytes'] / MIB:.1f} MiB")
    print(f"soak: {'PASS' if r['passed'] else 'FAIL: ' + '; '.join(r['failed_rules'])}"
          + ("" if r["rss_growth_judged"] else f" (RSS growth judged only for runs of {GROWTH_MIN_MINUTES:g}+ minutes)"))


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points (0 with fewer than 3)."""
    if len(points) < 3:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def _trend_of(series: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Anonymous RSS and fds at each quarter of the run, and their slope over its second half:
    a leak keeps climbing there, a warm-up has flattened out."""
    if not series:
        return {}
    end = series[-1][0]
    quarters = [min(series, key=lambda s: abs(s[0] - end * q / 4)) for q in (1, 2, 3, 4)]
    half = [s for s in series if s[0] >= end / 2]
    return {"rss_anon_quarters_mib": [round(s[1] / MIB, 1) for s in quarters],
            "fds_quarters": [int(s[2]) for s in quarters],
            "rss_anon_slope_second_half_mib_per_min": round(_slope([(t / 60, a / MIB) for t, a, _ in half]), 3),
            "fds_slope_second_half_per_min": round(_slope([(t / 60, f) for t, _, f in half]), 2)}


def run_soak(args: argparse.Namespace) -> int:
    for k, v in {"slots": 8, "kv_scale": 0.02, "cache_mib": 256, "target_tokens": 50_000, "max_tokens": 64,
                 "time_scale": 1.0, "max_rss_growth_pct": 5.0, "max_p99_s": MAX_P99_S,
                 "max_fd_growth": MAX_FD_GROWTH}.items():
        if not hasattr(args, k):
            setattr(args, k, v)  # the CLI sets the common ones; these have fixed defaults

    async def main(work: Path) -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None
        # SIGTERM ends the run like Ctrl-C: cancel, and the finally below stops every node.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        soak = Soak(args, work)
        try:
            return await soak.run()
        finally:
            for p in soak.nodes:
                p.stop()

    with tempfile.TemporaryDirectory(prefix="kvmesh-soak-") as tmp:
        try:
            result = asyncio.run(main(Path(tmp)))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("kvmesh soak: interrupted; every node was stopped", file=sys.stderr)
            return 130
    if not args.json:
        _human(result)
    print(json.dumps(result), flush=True)
    return 0 if result["passed"] else 1
