"""`kvmesh sim`'s parameters and its command line, importing nothing heavy (`kvmesh --help` builds every
parser, in an install that may lack the sim's dependencies)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from kvmesh.node.lab.clientmodel import ClientModel, add_client_args

POLICIES = ("kvmesh", "session_hash", "kv_overlap", "least_loaded", "round_robin")


@dataclass(frozen=True)
class SimParams:
    hosts: int
    policy: str = "kvmesh"
    slots: int = 8
    prefill_tps: float = 10_000.0
    decode_tps: float = 50.0
    kv_bytes_per_token: int = 131_072  # an 8B-class model's bf16 KV (32 layers x 8 KV heads x 128 x 2 x 2)
    link_gbps: float = 100.0  # an inference cluster's host network (RoCE/InfiniBand)
    import_gbps: float = 200.0  # replica store (host RAM) -> engine
    engine_tokens: int = 400_000
    store_tokens: int = 4_000_000
    replicate_min_tokens: int = 2048  # node.config.REPLICATE_MIN_TOKENS, the node's default (not imported: pydantic)
    rtt_s: float = 0.0002
    heartbeat_s: float = 1.0
    directory_after_hosts: int = 16
    # kvmesh refuses a turn no host can start within these (node.mesh.admission); the client retries after Retry-After.
    admit_wait_s: float = 60.0
    admit_new_wait_s: float = 60.0
    admission: bool = True
    # The clients (node.lab.clientmodel): retries of a refused turn, and how long an attempt may take to its first token.
    client_retries: int = ClientModel.retries
    client_timeout_s: float = ClientModel.timeout_s
    slo_s: float = 2.0  # goodput: turns per second whose TTFT is within this
    until_s: float | None = None  # no turn is sent after this (closed-loop workloads)
    seed: int = 1


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """`kvmesh sim`'s arguments; the caller sets the function it runs."""
    s = sub.add_parser("sim", help="placement at 2-256 hosts in virtual time, on a Mooncake trace or the agent workload")
    s.add_argument("--hosts", type=int, default=8)
    s.add_argument("--policy", choices=POLICIES, default="kvmesh")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids; "
                     "plain or .gz), `mooncake` (the one kvmesh ships), or Claude Code traces: a directory of "
                     "trace_*.json.gz (one conversation each, subagents inside) or one such file")
    src.add_argument("--agents", action="store_true", help="the built-in coding-agent workload (the default)")
    s.add_argument("--load", type=float, default=None, help="offered utilisation per host, above 0 and at most 1.5 (default: the workload once)")
    s.add_argument("--duration", type=float, default=300.0, help="agent workload: seconds of virtual time")
    s.add_argument("--span", type=float, default=None, help="a trace: only the requests it sends in its first SPAN seconds "
                   "(a trace whose think times run to hours needs hundreds of copies to load a mesh over its whole span)")
    s.add_argument("--agents-per-host", type=float, default=None, help="agent workload without --load (default 4)")
    for f in dataclasses.fields(SimParams):
        if f.name in ("hosts", "policy", "until_s", "seed", "admission", "client_retries", "client_timeout_s"):
            continue
        s.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)  # type: ignore[arg-type]
    s.add_argument("--no-admission", dest="admission", action="store_false",
                   help="kvmesh queues every turn instead of refusing what no host can start within --admit-wait-s")
    add_client_args(s.add_argument_group("clients", "how a refused or slow turn is retried or given up (node/lab/clientmodel.py)"))
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--json", action="store_true", help="only the JSON line")
    w = s.add_argument_group("sweep", "--sweep: every policy at every size and load on each trace; a table, then "
                             "whether kvmesh held against the others in every cell (node/lab/sim/sweep.py)")
    w.add_argument("--sweep", action="store_true")
    w.add_argument("--sweep-traces", default="mooncake", help="comma-separated traces (as --trace takes them)")
    w.add_argument("--sweep-hosts", default="2,8,64,256", help="comma-separated host counts")
    w.add_argument("--sweep-loads", default="0.3,0.6,0.9,1.2", help="comma-separated loads (as --load)")
    w.add_argument("--sweep-policies", default=",".join(POLICIES), help="comma-separated policies (kvmesh among them)")
    w.add_argument("--seeds", type=int, default=3, help="runs of each policy per cell, on seeds --seed, --seed+1, ...; "
                   "a cell's row pools them")
    w.add_argument("--jobs", type=int, default=0, help="runs at once (default: the CPUs this process may use)")
    w.add_argument("--chart", metavar="DIR", default=None,
                   help="also draw the rows against load, one SVG per trace and size, into DIR (node/lab/charts.py)")
    return s
