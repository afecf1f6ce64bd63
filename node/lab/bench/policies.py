"""`kvmesh bench policies`: real sim-engine nodes replaying an agent trace, kvmesh against `mesh.policy` baselines.

For each load and each policy a fresh mesh of `--hosts` nodes on loopback (sim engine, `mesh.policy`
set) replays the same requests: the trace's first `--span` seconds, its sessions copied (as `kvmesh
sim --load` does) so that each host is offered `load` of its busier resource by the sim engine's
own rates, prompts scaled to `--block-chars` characters (tokens, on the byte tokenizer) per 512-token
block. The client is `kvmesh load`'s (node.lab.clientmodel: `--client`, `--client-retries`,
`--client-timeout-s`; with `--sdk anthropic` every turn goes through the official Anthropic SDK, which
retries it itself): a refused turn (429/529) is retried after its Retry-After until its retries run
out, and a turn that runs out of retries or time fails, counted apart from errors. Per run: turns,
errors, refusals, failed turns, TTFT p50/p99 (and from a served turn's first attempt), goodput (turns
per second with TTFT within `--slo`), the prompt tokens the mesh recomputed, and its handoff
counters, and how busy the box's CPUs were (nodes and client share them: a run near 100% measured the box);
with `--turns-out DIR` each run's turns, one JSON line each, in DIR/POLICY-LOAD.jsonl (which turns
make a tail). The last line is one JSON object; the exit status is non-zero if any run had an error
other than a refusal or a failed turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvmesh.node.lab.bench.common import emit, start_mesh
from kvmesh.node.lab.charts import POLICIES_METRICS, ChartsUnavailable, policies_rows, require_matplotlib, write_charts
from kvmesh.node.lab.clientmodel import check_client_args, client_from_args
from kvmesh.node.lab.launcher import client_key_headers, wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape
from kvmesh.node.lab.sim.params import POLICIES
from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, TraceRequest, read_trace, scale_trace


def offered_per_host(reqs: list[TraceRequest], args: argparse.Namespace, span_s: float) -> float:
    """What the requests offer one host over `span_s`, of its busier resource (as `kvmesh sim` counts it):
    its prefill engine (new tokens, at the sim engine's prefill rate) or its slots (prefill and decode)."""
    scale = args.block_chars / TRACE_BLOCK_TOKENS
    prefill = sum(max(0, r.input_length - r.shared) * scale for r in reqs) / args.prefill_tps
    decode = sum(max(1, min(r.output_length, args.max_tokens)) for r in reqs) / args.decode_tps
    return max(prefill, (prefill + decode) / args.slots) / span_s


async def _mesh_figures(apis: list[str]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10, headers=client_key_headers()) as c:
        stats = [(await c.get(f"{a}/v1/stats")).json() for a in apis]
        counters = (await c.get(f"{apis[0]}/v1/cluster")).json()["counters"]
    refused: dict[str, int] = {}
    for s in stats:
        for k, v in (s.get("admission") or {}).get("refused", {}).items():
            refused[k] = refused.get(k, 0) + v
    return {"prefill_tokens": sum(s["engine"]["prefill_tokens"] for s in stats),
            "handoffs": {k: counters.get(k, 0) for k in ("warm", "partial", "cold")}, "refused_by_mesh": refused}


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system) the processes have used so far; one already gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _one(args: argparse.Namespace, reqs: list[TraceRequest], policy: str, load: float, work: Path) -> dict[str, Any]:
    names = [f"h{i}" for i in range(args.hosts)]
    sim = {"kv_scale": args.kv_scale, "prefill_tps": args.prefill_tps, "decode_tps": args.decode_tps}
    nodes = start_mesh(work, names, slots=args.slots, kv_scale=args.kv_scale, cache_bytes=args.cache_bytes,
                       engine={"kind": "sim", "sim": sim}, extra={"mesh": {"policy": policy}})
    try:
        wait_peers(nodes)
        shape = LoadShape(max_tokens=args.max_tokens, seed=args.seed)
        out_dir = getattr(args, "turns_out", None)
        with open(out_dir / f"{policy}-{load}.jsonl", "w") if out_dir else contextlib.nullcontext() as turns:
            runner = LoadRunner([n.api for n in nodes], shape, time_scale=1.0, client=client_from_args(args),
                                sdk=getattr(args, "sdk", None), turns=turns)
            runner.stats.slo_s = args.slo
            pids = [os.getpid(), *(n.proc.pid for n in nodes if n.proc is not None)]
            t0, cpu0 = time.monotonic(), _cpu_s(pids)
            stats = asyncio.run(runner.replay_requests(reqs, block_chars=args.block_chars, until_s=args.duration))
            wall, cpu = time.monotonic() - t0, _cpu_s(pids) - cpu0
        out = stats.summary()
        out.update(asyncio.run(_mesh_figures([n.api for n in nodes])))
        # The nodes and the client share this box: past about 90% its cores, not the sim engine's rates, set the
        # figures, and a policy that spends more CPU (kvmesh's replica pushes) pays for it in TTFT.
        out.update(policy=policy, load=load, wall_s=round(wall, 1),
                   cpu_busy_pct=round(100 * cpu / (wall * len(os.sched_getaffinity(0))), 1))
        return out
    finally:
        for n in nodes:
            n.stop()


def _requests(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The trace's requests the runs replay, or why there are none to run (a bad flag, an unreadable trace)."""
    unknown = sorted(set(args.policies) - set(POLICIES))
    if args.span is None:
        args.span = args.duration
    client = check_client_args(args)
    if getattr(args, "chart", None) and not client:
        try:
            require_matplotlib()  # before the runs, not after
        except ChartsUnavailable as e:
            client = str(e)
    if unknown or client or not args.policies or args.hosts < 1 or args.span <= 0 or args.duration <= 0:
        return [], f"unknown policy {', '.join(unknown)} (one of {', '.join(POLICIES)})" if unknown else client or \
            "--policies, --hosts, --span and --duration must be given and above 0"
    try:
        base = [r for r in read_trace(args.trace) if r.t < args.span]
        if getattr(args, "turns_out", None):
            args.turns_out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        return [], str(e)
    return base, "" if base else f"no request in {args.trace}'s first {args.span} s"


def run_policies(args: argparse.Namespace) -> int:
    base, why = _requests(args)
    if why:
        print(f"kvmesh bench policies: {why}", file=sys.stderr)
        return 2
    span = max(r.t for r in base) or 1.0
    per_copy = offered_per_host(base, args, span)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-policies-") as tmp:
        for load in args.loads:
            copies = load * args.hosts / per_copy
            reqs = scale_trace(base, copies, span, random.Random(args.seed))
            for policy in args.policies:
                work = Path(tmp) / f"{policy}-{load}"
                work.mkdir()
                run = _one(args, reqs, policy, load, work)
                run["copies"] = round(copies, 2)
                runs.append(run)
                print(f"  load {load} {policy}: {run['turns']} turns, {run['refused']} refused, "
                      f"{run['failed_turns']} failed, {run['errors']} errors, "
                      f"TTFT p50 {run['ttft_p50_s']} p99 {run['ttft_p99_s']} s, goodput {run['goodput_per_s']}/s, "
                      f"CPU {run['cpu_busy_pct']}% busy" + (" (CPU-bound: these figures are this box's)"
                                                            if run["cpu_busy_pct"] >= 90 else ""),
                      file=sys.stderr, flush=True)
    keep = ("policy", "load", "copies", "turns", "errors", "refused", "failed_turns", "failed_pct",
            "turns_refused_once_pct", "refusals_per_turn", "ttft_p50_s", "ttft_p99_s", "goodput_per_s",
            "ttft_with_retries_p50_s", "ttft_with_retries_p99_s", "prompt_tokens", "prompt_tokens_recomputed", "prefill_tokens", "handoffs",
            "refused_by_mesh", "elapsed_s", "cpu_busy_pct", "error_samples")
    result: dict[str, Any] = {
        "bench": "policies", "trace": args.trace, "hosts": args.hosts, "slots": args.slots, "span_s": args.span,
        "client_retries": client_from_args(args).retries, "client_sdk": getattr(args, "sdk", None), "client_timeout_s": client_from_args(args).timeout_s,
        "duration_s": args.duration, "slo_s": args.slo, "runs": [{k: r.get(k) for k in keep} for r in runs],
        "errors": sum(r["errors"] for r in runs), "turns": sum(r["turns"] for r in runs),
        "error_samples": [s for r in runs for s in r.get("error_samples", [])][:5],
    }
    drawn = True
    if getattr(args, "chart", None):
        try:
            for path in write_charts(policies_rows(result), Path(args.chart), POLICIES_METRICS, title="kvmesh bench policies"):
                print(f"chart: {path}", file=sys.stderr)
        except (ChartsUnavailable, OSError) as e:
            print(f"kvmesh bench policies: {e}", file=sys.stderr)
            drawn = False
    return max(emit(result, args), 0 if drawn else 2)

