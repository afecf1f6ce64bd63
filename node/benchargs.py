"""The parsers of `kvmesh bench`'s subcommands beside the core ones in node.cli (transfer, control, engine and
versus, tools, subagents, llamacpp-suite, policies). Each bench's module is imported only when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

Subparsers = argparse._SubParsersAction  # the type argparse gives `add_subparsers`
GGUF_HELP = "a GGUF file or a packaged model's alias (smollm2, gemma3-270m); implies --engine llamacpp"


def add_bench_transfer(bsub: Subparsers) -> None:
    x = bsub.add_parser("transfer", help="kv_share delta vs raw TCP between two node processes")
    x.add_argument("--json", action="store_true")
    x.add_argument("--mib", type=float, default=247.0, help="delta size")
    x.add_argument("--link", choices=["loopback", "1gbit", "10gbit"], default="loopback")
    x.add_argument("--repeat", type=int, default=3)
    x.add_argument("--engine", choices=["sim", "llamacpp"], help="default: llamacpp for a GGUF --model, else sim; "
                   "llamacpp: block export/import rates of the llama.cpp engine for a --tokens session, beside memcpy")
    x.add_argument("--model", type=Path, help=GGUF_HELP + " (default: a generated one)")
    x.add_argument("--block-size", type=int, help="with --engine llamacpp: tokens per KV block (default: from the model's context)")
    x.set_defaults(engine_default="sim")
    x.add_argument("--tokens", type=int, help="with --engine llamacpp: the session's length (default: 16384, or 80%% "
                   "of a shorter model context; a length past the context is refused)")


def add_bench_control(bsub: Subparsers) -> None:
    c = bsub.add_parser("control", help="control-plane bytes per host on a sim mesh: peers' state polled vs pushed")
    c.add_argument("--json", action="store_true")
    c.add_argument("--hosts", type=int, default=3)
    c.add_argument("--sessions", type=int, default=12)
    c.add_argument("--slots", type=int, default=4)
    c.add_argument("--duration", type=float, default=60.0, help="seconds of agent load per mode")
    c.add_argument("--seed", type=int, default=1)
    g = bsub.add_parser("exactness", help="the exactness gate per model kind: a moved turn against the home's")
    g.add_argument("--json", action="store_true")
    g.add_argument("--kinds", help="comma-separated: dense, dense-q8_0, swa-full, swa-window, moe, hybrid, vllm, "
                   "recurrent (default: all)")
    g.add_argument("--steps", type=int, default=64, help="greedy tokens compared")


def add_side_by_side(bsub: Subparsers) -> None:
    """`bench engine`, `bench nodepath` and `bench versus`: kvmesh against llama-server and vLLM on their own."""
    e = bsub.add_parser("engine", help="one host's kvmesh node against llama-server and/or vLLM called directly: "
                        "TTFT, prefill and decode tok/s, inter-token latency, per point with its spread")
    e.add_argument("--json", action="store_true")
    e.add_argument("--against", default="llama-server", help="comma-separated, of llama-server (built by `make "
                   "llama-server`), vllm (a node over vLLM against that vLLM, `make vllm`) and none (kvmesh alone); "
                   "e.g. llama-server,vllm for the whole table")
    e.add_argument("--model", type=Path, help=GGUF_HELP + " (default: smollm2)")
    e.add_argument("--threads", type=int, default=0, help="compute threads of each server, on as many cores (0: all)")
    e.add_argument("--slots", type=int, default=4)
    e.add_argument("--streams", type=_int_list, default=[1, 4], help="concurrent streams per point (comma-separated)")
    e.add_argument("--prompts", type=_int_list, help="prompt tokens per point (comma-separated; default: 1/32 and 1/8 "
                   "of the model's context per slot, 256,1024 on SmolLM2); a size past the context is refused")
    e.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per stream and turn (ignore_eos)")
    _add_repeats(e, budget=210.0)
    e.add_argument("--extra-bufts", choices=["auto", "on", "off"], default="auto",
                   help="llama.cpp's repacked weight buffers on both sides (engine.llamacpp.extra_bufts; "
                   "llama-server's --repack/--no-repack): compare on and off on one host")
    e.add_argument("--gpu-layers", type=int, default=0, help="layers a GPU build offloads, on both sides "
                   "(engine.llamacpp.gpu_layers; llama-server's -ngl); -1: all")
    n = bsub.add_parser("nodepath", help="the node's own path: kvmesh over vLLM against the same vLLM called "
                        "directly, TTFT, decode and inter-token latency at 1, 4 and 16 streams")
    n.add_argument("--json", action="store_true")
    n.add_argument("--model", type=Path, help="what vLLM serves: a packaged GGUF's alias or path (converted once), or a "
                   "checkpoint directory (default: smollm2)")
    n.add_argument("--streams", type=_int_list, default=[1, 4, 16], help="concurrent streams per point (comma-separated)")
    n.add_argument("--tokens", type=int, default=512, help="prompt tokens of every stream's opening")
    n.add_argument("--max-tokens", type=int, default=64, help="tokens decoded per stream and turn (ignore_eos)")
    _add_repeats(n, budget=600.0)
    v = bsub.add_parser("versus", help="two hosts: kvmesh against llama-servers behind nginx (sticky, round robin)")
    v.add_argument("--json", action="store_true")
    v.add_argument("--duration", type=float, default=300.0, help="seconds per arm")
    v.add_argument("--sessions", type=int, default=16)
    v.add_argument("--slots", type=int, default=4, help="slots per host")
    v.add_argument("--max-tokens", type=int, default=64)
    v.add_argument("--time-scale", type=float, default=1.0, help="multiplies think times")
    v.add_argument("--seed", type=int, default=1)
    v.add_argument("--cache-mib", type=int, default=4096, help="prompt cache per host: kvmesh's pool, llama-server's --cache-ram")
    v.add_argument("--model", type=Path, help=GGUF_HELP + " (default: smollm2)")
    v.add_argument("--link", choices=["loopback", "1gbit", "10gbit"], default="loopback",
                   help="1gbit|10gbit: the hosts in network namespaces joined by a tbf-shaped veth (root)")
    v.add_argument("--arms", nargs="+", choices=["kvmesh", "sticky", "round_robin", "kvmesh_no_share"],
                   default=["kvmesh", "sticky", "round_robin", "kvmesh_no_share"])
    v.add_argument("--trace", help="replay an agent trace instead of the synthetic agents: a Claude Code trace "
                   "directory (kv-cache-tester's format, e.g. ../shared/data/claude_code) or a Mooncake one; "
                   "prompts scaled to the model's context, --sessions of its sessions")
    v.add_argument("--span", type=float, help="with --trace: its first SPAN seconds of trace time (default: "
                   "--duration / --time-scale)")


def _add_repeats(p: argparse.ArgumentParser, budget: float) -> None:
    p.add_argument("--repeats", type=int, default=3, help="rounds of every point on every side (a spread: min/median/max)")
    p.add_argument("--budget", type=float, default=budget, help="seconds after which no new repeat starts (at least 2 run)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to serve")


def add_bench_tools(bsub: Subparsers) -> None:
    """`bench tools`'s parser: here, not in node.lab.bench.tools, so `kvmesh --help` imports nothing heavy."""
    t = bsub.add_parser("tools", help="tool_choice=required on real models: valid calls and decode tok/s, "
                        "constrained vs unconstrained")
    t.add_argument("--json", action="store_true")
    t.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated GGUF aliases or paths")
    t.add_argument("--requests", type=int, default=20, help="requests per model and arm")
    t.add_argument("--max-tokens", type=int, default=128, help="reply tokens at most")
    t.add_argument("--threads", type=int, default=0, help="llama.cpp compute threads (0: all cores)")


def cmd_bench_subagents(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.bench.subagents import run_subagents

    return run_subagents(args)


def add_bench_subagents(bsub: Subparsers) -> None:
    """`bench subagents`'s parser; its own func (a subcommand's default wins over `bench`'s)."""
    s = bsub.add_parser("subagents", help="Claude Code's subagents under the main's session id: parallel, main's reuse")
    s.add_argument("--json", action="store_true")
    s.add_argument("--engine", choices=["sim", "llamacpp", "smollm2"], help="default: llamacpp for a GGUF --model, "
                   "else sim; llamacpp and smollm2: llama.cpp on --model (default: smollm2)")
    s.add_argument("--model", type=Path, help=GGUF_HELP + " (the same on both nodes)")
    s.add_argument("--main-tokens", type=int, help="the main's first prompt (default: 22000 sim, 2000 llama.cpp)")
    s.add_argument("--subagent-tokens", type=int, help="each subagent's first prompt (default: 14000 sim, 1500 llama.cpp)")
    s.add_argument("--subagents", type=int, default=3)
    s.add_argument("--max-tokens", type=int, default=16, help="reply tokens at most")
    s.add_argument("--cache-tokens", type=int, default=0, help="KV pool per node in tokens (0: 1.3 times one "
                   "variant's prompts, a full node's pool)")
    s.add_argument("--meshes", nargs="+", choices=["one_node", "two_nodes"], default=["one_node", "two_nodes"])
    s.add_argument("--seed", type=int, default=1)
    s.set_defaults(func=cmd_bench_subagents, engine_default="sim")


def cmd_bench_llamacpp_suite(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.llamacpp_suite import run_suite

    return run_suite(args)


def add_bench_llamacpp_suite(bsub: Subparsers) -> None:
    """`bench llamacpp-suite`: llama.cpp's own server tests against a kvmesh node (node.lab.llamacpp_suite)."""
    from kvmesh.node.lab.llamacpp_suite import add_arguments

    s = bsub.add_parser("llamacpp-suite", help="llama.cpp's server tests (response_format, logprobs, n) "
                        "against a kvmesh node on SmolLM2: passed/failed and why")
    add_arguments(s)
    s.set_defaults(func=cmd_bench_llamacpp_suite)


def add_bench_policies(bsub: Subparsers) -> None:
    from kvmesh.node.lab.clientmodel import add_client_args, add_sdk_arg
    from kvmesh.node.lab.sim.params import POLICIES

    b = bsub.add_parser("policies", help="real sim nodes replaying a trace: kvmesh against mesh.policy baselines")
    add_client_args(b)
    add_sdk_arg(b)
    b.add_argument("--json", action="store_true")
    b.add_argument("--trace", default="mooncake", help="as `kvmesh load --trace` takes it (Claude Code traces: a directory)")
    b.add_argument("--hosts", type=int, default=4)
    b.add_argument("--slots", type=int, default=2, help="slots per host")
    b.add_argument("--loads", type=_float_list, default=[0.5, 1.2], help="offered load per host, e.g. 0.5,1.2")
    b.add_argument("--policies", type=lambda v: [p for p in v.split(",") if p], default=["kvmesh", "session_hash"],
                   help=f"comma-separated, of {', '.join(POLICIES)}")
    b.add_argument("--span", type=float, default=None,
                   help="the trace's first SPAN seconds, copied to the load over SPAN (default: --duration, "
                        "so a run replays all it sizes)")
    b.add_argument("--duration", type=float, default=120.0, help="seconds each run sends requests")
    b.add_argument("--block-chars", type=int, default=64, help="prompt characters (sim tokens) per 512-token block")
    b.add_argument("--max-tokens", type=int, default=64, help="reply tokens at most")
    b.add_argument("--prefill-tps", type=float, default=20000.0, help="the sim engine's prefill rate")
    b.add_argument("--decode-tps", type=float, default=60.0, help="the sim engine's decode rate per slot")
    b.add_argument("--kv-scale", type=float, default=0.05)
    b.add_argument("--cache-bytes", type=int, default=512 << 20)
    b.add_argument("--slo", type=float, default=2.0, help="goodput's TTFT bound, seconds")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--chart", metavar="DIR", default=None,
                   help="also draw the runs against load, one SVG per trace and size, into DIR (node/lab/charts.py)")
    b.add_argument("--turns-out", metavar="DIR", type=Path, default=None,
                   help="write every run's turns into DIR/POLICY-LOAD.jsonl (as `kvmesh load --turns-out`)")


def _float_list(v: str) -> list[float]:
    try:
        xs = [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a comma-separated list of numbers") from None
    if not xs or min(xs) <= 0:
        raise argparse.ArgumentTypeError(f"{v!r}: give numbers above 0, e.g. 0.5,1.2")
    return xs


def _int_list(v: str) -> list[int]:
    try:
        xs = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a comma-separated list of integers") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"{v!r}: give positive integers, e.g. 1,4")
    return xs
