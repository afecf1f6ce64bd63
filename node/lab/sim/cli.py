"""`kvmesh sim`: one policy at N hosts on a trace or the agent workload; the last stdout line is one JSON object.

`--load U` sizes the traffic to the mesh: every host offered about U of its busier resource (its
prefill engine, or its slots' time), counting each turn's new tokens' prefill and its decode as if
every cache hit, by replaying more (or fewer) conversations, never by compressing their think
times: a trace (Mooncake's or Claude Code's) is replayed in copies, each conversation of a copy shifted by its own
random offset within the trace's span (wrapping round, so arrivals stay even over the span), with
its own session ids and blocks, plus a random share of its conversations for a fraction of a copy;
the agent workload gets more agents. Without `--load` the workload runs once, whatever N.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from kvmesh.node.lab.clientmodel import check_client_args, client_from_args
from kvmesh.node.lab.sim.params import SimParams
from kvmesh.node.lab.sim.run import Figures, Simulation
from kvmesh.node.lab.workload import TraceRequest, agent_trace, read_trace, scale_trace

AGENT_SHAPE = {"tool_tokens": (300, 4000), "reply_tokens": 64, "think_s": (0.5, 2.0)}  # agent_trace's defaults


def offered(requests: list[TraceRequest], p: SimParams, span_s: float) -> float:
    """The busier of a host's two resources, as a fraction of one host over `span_s`, if everything a turn
    could reuse were cached: its prefill engine (new tokens) or its slots (prefill and decode)."""
    prefill = sum(r.input_length - r.shared for r in requests) / p.prefill_tps
    slots = (prefill + sum(r.output_length for r in requests) / p.decode_tps) / p.slots
    return max(prefill, slots) / span_s


def workload(args: argparse.Namespace, p: SimParams) -> tuple[list[TraceRequest], float, str, SimParams]:
    rng = random.Random(args.seed)
    if args.trace:
        base = read_trace(args.trace)
        if args.span is not None:
            base = [r for r in base if r.t < args.span]
            if not base:
                raise ValueError(f"{args.trace}: no request in its first {args.span} s")
        span = max(r.t for r in base) or 1.0
        factor = args.load * p.hosts / offered(base, p, span) if args.load else 1.0
        return scale_trace(base, factor, span, rng), span, f"trace:{args.trace} x{factor:.2f}", p
    tools = AGENT_SHAPE["tool_tokens"]
    think = AGENT_SHAPE["think_s"]
    prefill = ((tools[0] + tools[1]) / 2 + 64) / p.prefill_tps  # type: ignore[index, operator]
    turn = prefill + 64 / p.decode_tps
    cycle = turn + (think[0] + think[1]) / 2  # type: ignore[index, operator]
    per_agent = max(prefill / cycle, turn / cycle / p.slots)  # of one host, as `offered` counts it
    per_host = args.load / per_agent if args.load else (args.agents_per_host or 4.0)
    agents = max(1, round(per_host * p.hosts))
    reqs = agent_trace(agents=agents, duration_s=args.duration, seed=args.seed)
    return reqs, args.duration, f"agents:{agents}", dataclasses.replace(p, until_s=args.duration)


def _params_kw(args: argparse.Namespace) -> dict[str, object]:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimParams) if hasattr(args, f.name)}
    client = client_from_args(args)
    return {**kw, "client_retries": client.retries, "client_timeout_s": client.timeout_s}


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with `kvmesh sim`'s arguments, or None."""
    if not 1 <= args.hosts <= 4096:
        return f"--hosts must be 1-4096, got {args.hosts}"
    if args.load is not None and not 0 < args.load <= 1.5:
        return f"--load is a utilisation per host, 0-1.5; got {args.load}"
    kw = _params_kw(args)
    bad = [f"--{k.replace('_', '-')} must be above 0, got {v}" for k, v in kw.items()
           if isinstance(v, int | float) and not isinstance(v, bool) and v <= 0
           and k not in ("replicate_min_tokens", "seed", "client_retries", "client_timeout_s")]
    client = check_client_args(args)
    if client:
        bad.append(client)
    if args.span is not None and args.span <= 0:
        bad.append(f"--span must be above 0, got {args.span}")
    if args.duration <= 0:
        bad.append(f"--duration must be above 0, got {args.duration}")
    return "; ".join(bad) or None


def simulate(args: argparse.Namespace) -> dict[str, object]:
    """One run's figures (OSError or ValueError for a trace that cannot be read)."""
    return run_once(args)[0]


def run_once(args: argparse.Namespace) -> tuple[dict[str, object], Figures]:
    """One run's figures, and what they were computed from (a sweep pools the TTFTs of several seeds)."""
    p = SimParams(**{**_params_kw(args), "hosts": args.hosts, "policy": args.policy})  # type: ignore[arg-type]
    reqs, span, what, p = workload(args, p)
    t0 = time.perf_counter()
    sim = Simulation(p, reqs)
    sim.run()
    return ({**sim.summary(max(span, sim.fig.end)), "workload": what, "load": args.load,
             "wall_s": round(time.perf_counter() - t0, 1)}, sim.fig)


def run_sim(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem:
        print(f"kvmesh sim: {problem}", file=sys.stderr)
        return 2
    try:
        out = simulate(args)
    except (OSError, ValueError) as e:
        print(f"kvmesh sim: {e}", file=sys.stderr)
        return 2
    if not args.json:
        for k, v in out.items():
            print(f"{k:>26}: {v}")
    print(json.dumps(out), flush=True)
    return 0
