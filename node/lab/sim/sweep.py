"""`kvmesh sim --sweep`: every policy at every size and load on each trace, one table, and whether kvmesh held.

A cell is one (trace, hosts, load); every policy in it replays the same requests on each of `--seeds`
seeds (a seed draws the trace's copies, their offsets and the entry hosts). A policy's row in a cell
pools its runs: TTFT percentiles over all their turns, warm % over all their follow-ups, goodput
over their summed time, refusals over their attempts, failed turns and turns refused over all their
turns, prefill tokens and utilisation their mean.
One seed's p50 moves by a few percent with where a handful of long prompts land, more than the
policies differ at low load, so one seed cannot rank them. In each cell kvmesh is checked against
the others: warm % at least the best other's minus 0.2 points, TTFT p50 and p99 at most every
other's, goodput at least every other's, prefill tokens at most 1.05x session_hash's; and as the clients
lived it (node.lab.clientmodel), failed turns at most every other's and TTFT from the first attempt at p99
over every turn at most every other's. That p99 ranks a failed turn after every served one: over the served turns
alone (`ttft_with_retries_p99_s`, reported too) a policy whose slowest turns time out at 600 s looks faster than
one that serves them at 650 s (a refused turn's attempt after its Retry-After gets its own timeout), the reverse of
what their clients saw. The runs go
to a process pool, the largest first; the table is printed at the end, then the failed checks,
then one JSON line (the rows and the verdict).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from kvmesh.node.lab.charts import SWEEP_METRICS, ChartsUnavailable, require_matplotlib, write_charts
from kvmesh.node.lab.sim.cli import check_args, run_once
from kvmesh.node.lab.sim.params import POLICIES
from kvmesh.node.lab.sim.run import percentile

Row = dict[str, Any]
Run = tuple[Row, list[float], list[float]]  # a run's figures, its TTFTs, and those from first attempts
COLUMNS = (("trace", "trace"), ("hosts", "hosts"), ("load", "load"), ("policy", "policy"), ("requests", "requests"),
           ("warm_pct", "warm %"), ("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"),
           ("goodput_per_s", "goodput/s"), ("refused_pct", "refused %"), ("turns_refused_once_pct", "turns refused %"),
           ("failed_pct", "failed %"), ("ttft_with_retries_p50_s", "with retries p50 s"),
           ("ttft_with_retries_p99_s", "with retries p99 s"), ("ttft_every_turn_p99_s", "every turn p99 s"),
           ("prefill_mtok", "prefill Mtok"), ("utilisation", "slot util"))


def _one(job: tuple[argparse.Namespace, str]) -> Run:
    args, trace = job
    out, fig = run_once(args)
    return {**out, "trace": trace, "seed": args.seed}, fig.ttft, fig.ttft_with_retries  # `pool` sorts them together


def pool(runs: list[Run]) -> Row:
    """One policy's row in a cell from its runs, one per seed (see the module's docstring)."""
    rows = [r for r, _, _ in runs]
    first = rows[0]
    ttft = sorted(x for _, t, _ in runs for x in t)
    follow = sum(r["follow_ups"] for r in rows)
    served, refused = sum(r["requests"] for r in rows), sum(r["refused"] for r in rows)
    failed, timed_out = sum(r["failed_turns"] for r in rows), sum(r["failed_timeout"] for r in rows)
    turns = served + failed
    once = sum(r["turns_refused"] for r in rows)
    with_retries = sorted(x for _, _, t in runs for x in t)
    prefill = round(sum(r["prefill_tokens"] for r in rows) / len(rows))
    return {
        "trace": first["trace"], "hosts": first["hosts"], "load": first["load"], "policy": first["policy"],
        "seeds": len(rows), "client_retries": first["client_retries"], "requests": served,
        "warm_pct": round(100.0 * sum(r["follow_ups_by_class"].get("warm", 0) for r in rows) / follow, 2) if follow else None,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "goodput_per_s": round(sum(1 for x in ttft if x <= first["slo_s"]) / sum(r["duration_s"] for r in rows), 4),
        "refused_pct": round(100.0 * refused / (served + refused + timed_out), 2) if turns else 0.0,
        "failed_turns": failed, "failed_pct": round(100.0 * failed / turns, 2) if turns else 0.0,
        "turns_refused_once_pct": round(100.0 * once / turns, 2) if turns else 0.0,
        "refusals_per_turn": round(refused / turns, 4) if turns else 0.0,
        "ttft_with_retries_p50_s": percentile(with_retries, 0.5),
        "ttft_with_retries_p99_s": percentile(with_retries, 0.99),
        "ttft_every_turn_p99_s": every_turn_percentile(with_retries, failed, 0.99),
        "prefill_tokens": prefill, "prefill_mtok": round(prefill / 1e6, 1),
        "utilisation": round(sum(r["utilisation"] for r in rows) / len(rows), 4),
        "moves": sum(r["moves"] for r in rows), "wall_s": round(sum(r["wall_s"] for r in rows), 1),
    }


def every_turn_percentile(served: list[float], failed: int, q: float) -> float | None:
    """The q-quantile of sorted `served` TTFTs with `failed` turns ranked after them all (None: that turn failed)."""
    x = percentile(served + [math.inf] * failed, q)
    return None if x is None or math.isinf(x) else x


def _never(x: float | None) -> float:
    return math.inf if x is None else x


def failures(cell: list[Row]) -> list[str]:
    """The checks kvmesh fails against the other policies of one cell (empty: it held)."""
    mine = next((r for r in cell if r["policy"] == "kvmesh"), None)
    others = [r for r in cell if r["policy"] != "kvmesh"]
    if mine is None or not others:
        return []
    out = []
    best_warm = max(r["warm_pct"] or 0.0 for r in others)
    if (mine["warm_pct"] or 0.0) < best_warm - 0.2:
        out.append(f"warm {mine['warm_pct']} < best other {best_warm} - 0.2")
    for key in ("ttft_p50_s", "ttft_p99_s"):
        rival = min(others, key=lambda r: r[key])
        if mine[key] > rival[key]:
            out.append(f"{key} {mine[key]} > {rival['policy']}'s {rival[key]}")
    rival = max(others, key=lambda r: r["goodput_per_s"])
    if mine["goodput_per_s"] < rival["goodput_per_s"]:
        out.append(f"goodput {mine['goodput_per_s']} < {rival['policy']}'s {rival['goodput_per_s']}")
    rival = min(others, key=lambda r: r["failed_turns"])
    if mine["failed_turns"] > rival["failed_turns"]:
        out.append(f"failed turns {mine['failed_turns']} > {rival['policy']}'s {rival['failed_turns']}")
    key = "ttft_every_turn_p99_s"  # None: the p99 turn failed, later than any served one
    rival = min(others, key=lambda r: _never(r[key]))
    if _never(mine[key]) > _never(rival[key]):
        out.append(f"{key} {'failed' if mine[key] is None else mine[key]} > {rival['policy']}'s {rival[key]}")
    sh = next((r for r in others if r["policy"] == "session_hash"), None)
    if sh is not None and mine["prefill_tokens"] > 1.05 * sh["prefill_tokens"]:
        out.append(f"prefill {mine['prefill_mtok']} Mtok > 1.05 x session_hash's {sh['prefill_mtok']}")
    return out


def _jobs(args: argparse.Namespace) -> list[tuple[argparse.Namespace, str]]:
    traces = [t for t in args.sweep_traces.split(",") if t]
    hosts = [int(h) for h in args.sweep_hosts.split(",") if h]
    loads = [float(u) for u in args.sweep_loads.split(",") if u]
    policies = [p for p in args.sweep_policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"--sweep-policies: unknown {', '.join(unknown)}; one of {', '.join(POLICIES)}")
    if not (traces and hosts and loads and policies):
        raise ValueError("--sweep-traces, --sweep-hosts, --sweep-loads and --sweep-policies each need a value")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    jobs = []
    for trace, n, u, pol, k in itertools.product(traces, hosts, loads, policies, range(args.seeds)):
        one = argparse.Namespace(**{**vars(args), "trace": trace, "hosts": n, "load": u, "policy": pol,
                                    "seed": args.seed + k, "sweep": False})
        problem = check_args(one)
        if problem:
            raise ValueError(problem)
        jobs.append((one, trace))
    return sorted(jobs, key=lambda j: -j[0].hosts * j[0].load)


def table(rows: list[Row]) -> list[str]:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [f"**{r[k]}**" if k == "policy" and r[k] == "kvmesh" else str(r[k]) for k, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def run_sweep(args: argparse.Namespace) -> int:
    try:
        jobs = _jobs(args)
        if getattr(args, "chart", None):
            require_matplotlib()  # before an hour of runs, not after
    except (ValueError, ChartsUnavailable) as e:
        print(f"kvmesh sim --sweep: {e}", file=sys.stderr)
        return 2
    workers = args.jobs or len(os.sched_getaffinity(0))
    runs: dict[tuple[str, int, float, str], list[Run]] = {}
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as procs:
            for run in procs.map(_one, jobs):
                row = run[0]
                runs.setdefault((row["trace"], row["hosts"], row["load"], row["policy"]), []).append(run)
                print(f"  {row['trace']} hosts={row['hosts']} load={row['load']} {row['policy']} seed {row['seed']}: "
                      f"{row['requests']} turns in {row['wall_s']} s", file=sys.stderr, flush=True)
    except (OSError, ValueError) as e:
        print(f"kvmesh sim --sweep: {e}", file=sys.stderr)
        return 2
    order = {p: i for i, p in enumerate(POLICIES)}
    rows = sorted((pool(r) for r in runs.values()), key=lambda r: (r["trace"], r["hosts"], r["load"], order[r["policy"]]))
    cells: dict[tuple[str, int, float], list[Row]] = {}
    for r in rows:
        cells.setdefault((r["trace"], r["hosts"], r["load"]), []).append(r)
    failed = {f"{t} hosts={n} load={u}": f for (t, n, u), cell in cells.items() if (f := failures(cell))}
    for line in table(rows):
        print(line)
    for where, checks in failed.items():
        print(f"kvmesh did not hold at {where}: {'; '.join(checks)}")
    drawn = _draw(rows, getattr(args, "chart", None))
    print(json.dumps({"cells": len(cells), "held": len(cells) - len(failed), "failed": failed, "rows": rows}), flush=True)
    return 0 if drawn else 2


def _draw(rows: list[Row], chart: str | None) -> bool:
    """The rows' charts into `chart` (a folder), if asked; False if they could not be written (said on stderr)."""
    if not chart:
        return True
    try:
        for path in write_charts(rows, Path(chart), SWEEP_METRICS, title="kvmesh sim --sweep"):
            print(f"chart: {path}", file=sys.stderr)
    except (ChartsUnavailable, OSError) as e:
        print(f"kvmesh sim --sweep: {e}", file=sys.stderr)
        return False
    return True
