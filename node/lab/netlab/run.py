"""`kvmesh netlab`: the field report's experiment, reproduced on one machine.

Two hosts as network namespaces joined by a veth pair shaped with tc tbf, one
sim node in each (4 slots, kv_share on the data link), the report's workload
(calibrate.py: 16 coding-agent sessions growing to ~50k tokens, at the report's
kv_share traffic) driven from the root namespace, for each link rate. Scale is
stated, never hidden: `--kv-scale` shrinks KV bytes per token AND the link rate
by the same factor, so transfer times match the full-size experiment;
`--time-compress K` runs K times faster (think, prefill and decode times / K,
link rate x K). netem is not in this kernel: no latency or loss is emulated.

Each link's JSON says where the link's bytes went (account.py, beside tc's own
count), how well replicas used it while pushes queued (`useful_util_backlogged`),
and why handoffs reused less than predicted (`shortfall`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from kvmesh.node.config import EngineConfig
from kvmesh.node.lab.bench import rawtcp
from kvmesh.node.lab.launcher import NodeProcess, client_key_headers, wait_peers
from kvmesh.node.lab.load import LoadRunner
from kvmesh.node.lab.netlab.account import account, useful_util_backlogged
from kvmesh.node.lab.netlab.calibrate import SLOTS, Compression, calibrate, load_shape, think_scale_for
from kvmesh.node.lab.netlab.mesh import lab_api, lab_nodes
from kvmesh.node.lab.netlab.netns import TwoHostLab, can_use_netns

# The field report's 16-session table (see shared/reference/field-report.md).
QUICK_COMPRESS, QUICK_S = 6.0, 240.0  # --quick: 24 minutes of the report's run per link (>= 50 handoffs), in 4 minutes
REPORT: dict[str, dict[str, Any]] = {
    "1gbit": {"label": "1 GbE via switch", "delta_mib": 247, "transfer_s": 3.24, "warm_pct": 93.8, "partial_pct": 5.4},
    "10gbit": {"label": "10 GbE direct (VPN bypass)", "delta_mib": 247, "transfer_s": 0.55, "warm_pct": 96.2,
               "partial_pct": None},
}


@dataclass
class LinkRun:
    link: str
    ready: list[dict[str, Any]] = field(default_factory=list)
    imported: list[float] = field(default_factory=list)
    turns: list[tuple[float, int]] = field(default_factory=list)  # (the host's own TTFT, tokens prefilled) per turn
    series: list[tuple[float, float, int]] = field(default_factory=list)  # (t, warm %, handoffs)
    cluster: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> its /v1/stats at the end
    tc: dict[str, tuple[int, int]] = field(default_factory=dict)  # host -> its data-link tbf's (bytes, packets)
    rate_bps: float = 0.0  # the shaped link rate, each way
    duration_s: float = 0.0
    raw_tcp_s: float | None = None
    load: dict[str, Any] = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float | None:
    v = sorted(xs)
    return v[min(len(v) - 1, int(q * len(v)))] if v else None


class _EventTap:
    """Collects replica_ready, replica_imported and turn_finished events from one node's websocket, on a thread."""

    def __init__(self, api: str, run: LinkRun):
        self.url = api.replace("http://", "ws://") + "/v1/events"
        self.run = run
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                with connect(self.url, max_size=None, open_timeout=5, additional_headers=client_key_headers()) as ws:
                    while not self.stop.is_set():
                        try:
                            ev = json.loads(ws.recv(timeout=0.5))
                        except TimeoutError:
                            continue
                        if ev.get("replay"):
                            continue
                        if ev["type"] == "replica_ready":
                            self.run.ready.append(ev)
                        elif ev["type"] == "replica_imported":
                            self.run.imported.append(ev["seconds"])
                        elif ev["type"] == "turn_finished" and ev.get("ok", True):
                            self.run.turns.append((ev["ttft_s"], ev["prompt_tokens"] - ev["cached_tokens"]))
            except Exception:  # noqa: BLE001 - reconnect; the run goes on
                time.sleep(0.5)


def _progress(api: str, run: LinkRun, duration: float, stop: threading.Event) -> None:
    t0 = time.monotonic()
    with httpx.Client(timeout=5, headers=client_key_headers()) as c:
        while not stop.wait(1.0):
            try:
                k = c.get(f"{api}/v1/cluster").json()["counters"]
            except httpx.HTTPError:
                continue
            total = k["warm"] + k["partial"] + k["cold"]
            el = time.monotonic() - t0
            done = min(1.0, el / duration)
            bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
            if total:
                warm = 100.0 * k["warm"] / total
                run.series.append((el, warm, total))
                said = f"handoffs {total:4d}  warm {warm:5.1f}%"
            else:
                said = "no handoffs yet"
            print(f"\r  {run.link:>6} [{bar}] {el:5.0f}/{duration:.0f}s  {said}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


@dataclass(frozen=True)
class Plan:
    """One netlab run's knobs, resolved from the command line."""

    kv_scale: float
    compress: Compression
    think: float  # think-time multiplier (time compression and --time-scale / --demand together)
    demand: float  # kv_share demand relative to the report's (calibrate)
    kvshare: bool

    @property
    def link_scale(self) -> float:
        return self.compress.link_scale(self.kv_scale)


def plan_of(args: argparse.Namespace) -> Plan:
    if args.demand is not None and args.time_scale != 1.0:
        raise SystemExit("kvmesh netlab: give --demand or --time-scale, not both")
    try:
        time_scale = think_scale_for(args.demand) if args.demand is not None else args.time_scale
    except ValueError as err:
        raise SystemExit(f"kvmesh netlab: --demand: {err}") from None
    demand = calibrate(time_scale).mbps_per_direction / calibrate().mbps_per_direction
    k = Compression(args.time_compress)
    return Plan(args.kv_scale, k, k.think_multiplier(time_scale), round(demand, 3), args.kvshare == "on")


def node_config(plan: Plan, cache_mib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine section, other sections) of each lab node."""
    prefill, decode = plan.compress.engine_rates()
    engine = {"kind": "sim", "slots": SLOTS, "cache_bytes": cache_mib << 20, "queue_timeout_s": 600.0,
              "sim": {"kv_scale": plan.kv_scale, "prefill_tps": prefill, "decode_tps": decode}}
    kvshare: dict[str, Any] = {"fsync": "never", "store_budget_bytes": 4 * (cache_mib << 20), "concurrency": 2}
    if not plan.kvshare:
        kvshare.update(enabled=False, persist_own=False)  # kv_share off: nothing is pushed or accepted
    k = plan.compress.k
    mesh = {"poll_interval_s": max(0.05, min(1.0, 1.0 / k)), "cold_move_after_s": 30.0 / k}
    return engine, {"kvshare": kvshare, "mesh": mesh}


def run_link(link: str, work: Path, args: argparse.Namespace, plan: Plan) -> LinkRun:
    run = LinkRun(link)
    engine, extra = node_config(plan, args.cache_mib)
    with TwoHostLab(link, scale=plan.link_scale) as lab:
        run.rate_bps = lab.rate_mbit * 1e6
        print(f"  {link}: {lab.describe()}", file=sys.stderr)
        (work / link).mkdir(parents=True, exist_ok=True)
        nodes: list[NodeProcess] = lab_nodes(lab, work / link, engine=engine, extra=extra)
        try:
            for n in nodes:
                n.wait_ready()
                n.info["api"] = lab_api(lab, n.name)
            wait_peers(nodes)
            _drive(run, nodes, args, plan)
            run.cluster = httpx.get(f"{nodes[0].api}/v1/cluster", headers=nodes[0].key_headers, timeout=10).json()
            run.stats = {n.name: httpx.get(f"{n.api}/v1/stats", headers=n.key_headers, timeout=10).json() for n in nodes}
            run.tc = lab.qdisc_sent()  # read with the stats: both count from the nodes' start
        finally:
            for n in nodes:
                n.stop()
        sizes = [e["bytes"] for e in run.ready if e["blocks"] > 0]
        if sizes:
            # Raw TCP on the idle link: once the nodes are gone and the link has drained (a backlog of
            # pushes outlives the load, and measured under it raw TCP read up to 4x slow).
            _wait_idle(lab)
            a, b = lab.hosts
            run.raw_tcp_s = rawtcp.measure(int(statistics.median(sizes)), b.exec_prefix(), a.exec_prefix(), b.data_ip)
    return run


def _wait_idle(lab: TwoHostLab, quiet_s: float = 0.3, limit_s: float = 10.0) -> None:
    """Until neither end of the data link sends anything for `quiet_s` (at most `limit_s`)."""
    deadline = time.monotonic() + limit_s
    last = lab.qdisc_sent()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = lab.qdisc_sent()
        if now == last:
            return
        last = now


def _drive(run: LinkRun, nodes: list[NodeProcess], args: argparse.Namespace, plan: Plan) -> None:
    """The report's workload against the lab's two nodes for the run's duration, events tapped."""
    taps = [_EventTap(n.api, run) for n in nodes]
    for t in taps:
        t.thread.start()
    stop = threading.Event()
    prog = threading.Thread(target=_progress, args=(nodes[0].api, run, args.duration, stop), daemon=True)
    prog.start()
    shape = load_shape(args.seed, args.sessions, args.target_tokens)
    t0 = time.monotonic()
    stats = asyncio.run(LoadRunner([n.api for n in nodes], shape, time_scale=plan.think).run(args.duration))
    run.duration_s = time.monotonic() - t0
    stop.set()
    prog.join()
    time.sleep(1.0)
    for t in taps:
        t.stop.set()
    run.load = stats.summary()


def summarize(run: LinkRun, plan: Plan) -> dict[str, Any]:
    k = run.cluster.get("counters", {"warm": 0, "partial": 0, "cold": 0, "stale_state_cold": 0})
    total = k["warm"] + k["partial"] + k["cold"]
    deltas = [e for e in run.ready if e["blocks"] > 0]
    secs = [e["recv_s"] for e in deltas]
    lags = [e["lag_s"] for e in deltas]
    mbps = []
    superseded, in_flight, refused = 0, 0, collections.Counter[str]()
    for st in run.stats.values():
        out = sum(v["bytes"] for v in st["kvshare"]["out"].values())
        mbps.append(round(8 * out / run.duration_s / 1e6, 1) if run.duration_s else 0.0)
        for v in st["kvshare"]["out"].values():
            superseded += v.get("superseded", 0)
            in_flight += v.get("superseded_in_flight", 0)
            refused.update(v.get("refused", {}))
    p50 = _pct(secs, 0.5)
    return {
        "link": run.link,
        "handoffs": total,
        "warm_pct": round(100 * k["warm"] / total, 2) if total else None,
        "partial_pct": round(100 * k["partial"] / total, 2) if total else None,
        "cold_pct": round(100 * k["cold"] / total, 2) if total else None,
        "stale_state_cold": k["stale_state_cold"],
        "shortfall": k.get("shortfall", {}),
        "transfers": len(deltas),
        "delta_mib_p50": round((_pct([e["bytes"] for e in deltas], 0.5) or 0) / 2**20 / plan.kv_scale, 1),
        "transfer_p50_s": round(p50, 4) if p50 is not None else None,
        "transfer_p95_s": round(_pct(secs, 0.95) or 0, 3) if secs else None,
        # Transfers ran under the run's load; raw TCP was measured after it, on the idle link.
        "raw_tcp_idle_s_for_p50_delta": round(run.raw_tcp_s, 4) if run.raw_tcp_s else None,
        "transfer_loaded_over_raw_idle": round(p50 / run.raw_tcp_s, 3) if p50 and run.raw_tcp_s else None,
        "ready_lag_p50_s": round(_pct(lags, 0.5) or 0, 4) if lags else None,
        # A stored replica copied into the engine before a turn (not the receive: that is ready_lag).
        "store_import_p50_s": round(_pct(run.imported, 0.5) or 0, 4) if run.imported else None,
        "mbps_per_direction": mbps,
        "mbps_per_direction_full_scale": [round(m / plan.link_scale, 1) for m in mbps],
        "useful_util_backlogged": useful_util_backlogged(run.stats, run.rate_bps),
        "backlogged_s": round(sum(o.get("backlogged_s", 0.0) for st in run.stats.values()
                                  for o in st["kvshare"]["out"].values()), 2),
        **account(run.stats, run.tc),
        # Pushes that did not land: replaced by a newer replica (queued, or in flight and stalled), or refused.
        "superseded": superseded,
        "superseded_in_flight": in_flight,
        "refused": dict(refused),
        # Deltas that were whole sessions (the receiver held nothing of it): first copies and re-sends.
        "whole_session_transfers": sum(1 for e in deltas if e["blocks"] * EngineConfig().block_size >= e["tokens"]),
        "turns": run.load.get("turns"),
        "errors": run.load.get("errors"),
        "ttft_p50_s": run.load.get("ttft_p50_s"),
        "ttft_p95_s": run.load.get("ttft_p95_s"),
        "latency_p99_s": run.load.get("latency_p99_s"),
        # The serving hosts' view of the same turns: their TTFT (queue + prefill + first token, no HTTP) and
        # the tokens they had to prefill (not reused from any cache).
        "host_ttft_p50_s": _round(_pct([t for t, _ in run.turns], 0.5)),
        "host_ttft_p95_s": _round(_pct([t for t, _ in run.turns], 0.95)),
        "prefilled_tokens_per_turn": round(sum(n for _, n in run.turns) / len(run.turns)) if run.turns else None,
        "hosts": _host_facts(run),
        "duration_s": round(run.duration_s, 1),
    }


def table(rows: list[dict[str, Any]], plan: Plan) -> str:
    out = [f"kv_share field experiment, reproduced: KV bytes scaled by {plan.kv_scale:g}, time compressed "
           f"{plan.compress.k:g}x, link rate x{plan.link_scale:g} (transfer times comparable to full size / "
           f"{plan.compress.k:g}); demand {plan.demand:g}x the report's; kv_share {'on' if plan.kvshare else 'OFF'}; "
           "no latency emulation (no netem).",
           "",
           f"{'':<36}{'delta MiB':>10}{'xfer p50':>9}{'p95':>7}{'raw TCP':>8}{'ready lag':>10}{'warm%':>7}"
           f"{'part%':>7}{'cold%':>7}{'stale':>6}{'Mb/s a>b,b>a':>14}{'useful':>7}{'ttft p95':>9}"]
    for r in rows:
        rep = REPORT.get(r["link"], {})
        out.append(f"{'report: ' + rep.get('label', r['link']):<36}{rep.get('delta_mib', ''):>10}"
                   f"{rep.get('transfer_s', ''):>9}{'':>7}{'':>8}{'':>10}{rep.get('warm_pct', ''):>7}"
                   f"{rep.get('partial_pct') if rep.get('partial_pct') is not None else '':>7}{'':>7}{'':>6}"
                   f"{'320-450':>14}")
        mb = ",".join(f"{m:.0f}" for m in r["mbps_per_direction_full_scale"])
        warm = ("no handoffs", "", "") if not r["handoffs"] else (
            _f(r["warm_pct"]), _f(r["partial_pct"]), _f(r["cold_pct"]))
        out.append(f"{'kvmesh: ' + r['link']:<36}{r['delta_mib_p50']:>10}{_f(r['transfer_p50_s']):>9}"
                   f"{_f(r['transfer_p95_s']):>7}{_f(r['raw_tcp_idle_s_for_p50_delta']):>8}{_f(r['ready_lag_p50_s']):>10}"
                   f"{warm[0]:>7}{warm[1]:>7}{warm[2]:>7}{r['stale_state_cold']:>6}"
                   f"{mb:>14}{_f(r['useful_util_backlogged']):>7}{_f(r['ttft_p95_s']):>9}")
        if r["handoffs"]:
            out.append(f"{'':<36}{r['handoffs']} handoffs; shortfall: "
                       + (", ".join(f"{k} {v}" for k, v in sorted(r["shortfall"].items())) or "-"))
    out.append("")
    out.append("delta MiB and Mb/s are at full scale (measured / scale); times are as measured in the compressed run. "
               "Transfers ran under load, raw TCP on the idle link after it; `useful` is useful_util_backlogged.")
    return "\n".join(out)


def _host_facts(run: LinkRun) -> dict[str, dict[str, Any]]:
    """What each host went through: its event loop's lateness, engine evictions, turns served."""
    return {name: {"loop_lag_p99_ms": st.get("loop_lag_p99_ms"), "turns": st["engine"]["turns"],
                   "evicted_sessions": st["engine"]["evicted_sessions"],
                   "store_evictions": st["kvshare"].get("store_evictions")} for name, st in run.stats.items()}


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` through a temporary file beside it: a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_png(runs: list[LinkRun], rows: list[dict[str, Any]], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvmesh[report]'): no PNG written"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        if not run.series:
            ax1.text(0.5, 0.5 - 0.1 * runs.index(run), f"{run.link}: no handoffs", transform=ax1.transAxes, ha="center")
        else:
            ax1.plot([t for t, _, _ in run.series], [w for _, w, _ in run.series], label=run.link)
        secs = [e["recv_s"] for e in run.ready if e["blocks"] > 0]
        if secs:
            ax2.hist(secs, bins=30, alpha=0.6, label=run.link)
    ax1.set_title("warm handoffs over time")
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("warm %")
    ax1.set_ylim(0, 101)
    if any(run.series for run in runs):
        ax1.legend()
    ax2.set_title("replica delta transfer time")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("transfers")
    if any(run.ready for run in runs):
        ax2.legend()
    fig.tight_layout()
    try:
        _write_whole(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return f"PNG report: {path}"


def run_netlab(args: argparse.Namespace) -> int:
    ok, why = can_use_netns()
    if not ok:
        print(f"kvmesh netlab: {why}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the lab's namespaces and nodes are always removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick and args.time_compress is None:
        args.time_compress = QUICK_COMPRESS
    args.time_compress = args.time_compress or 1.0
    plan = plan_of(args)
    if args.duration is None:
        args.duration = QUICK_S if args.quick else plan.compress.duration_s()
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cal = calibrate(plan.think * plan.compress.k)
    print(f"netlab: links {', '.join(links)}; {args.duration:g}s each (= {plan.compress.full_scale_s(args.duration) / 60:.0f} "
          f"min at full scale); KV x{plan.kv_scale:g}, time compressed {plan.compress.k:g}x; demand {plan.demand:g}x "
          f"the report's ({cal.mbps_per_direction:.0f} Mb/s per direction at full scale); no netem", file=sys.stderr)
    runs: list[LinkRun] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-netlab-") as tmp:
        for link in links:
            runs.append(run_link(link, Path(tmp), args, plan))
    rows = [summarize(r, plan) for r in runs]
    result = {"links": rows, "scale": round(plan.link_scale, 6), "kv_scale": plan.kv_scale, "time_compress": plan.compress.k,
              "think_multiplier": round(plan.think, 4), "demand": plan.demand, "kvshare": plan.kvshare,
              "duration_s": args.duration, "full_scale_minutes": round(plan.compress.full_scale_s(args.duration) / 60, 1),
              "calibration": cal.summary(), "latency_emulation": "none (netem unavailable)"}
    json_path = out_dir / "netlab.json"
    _write_whole(json_path, lambda tmp: tmp.write_text(json.dumps(result, indent=2)))
    note = write_png(runs, rows, out_dir / "netlab.png")
    if not args.json:
        print(table(rows, plan))
        print(f"\nJSON: {json_path}\n{note}")
    print(json.dumps(result), flush=True)
    return 1 if any(r["errors"] or not r["turns"] for r in rows) else 0
