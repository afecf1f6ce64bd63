"""`kvmesh`: run a node, the demo, and the benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from pathlib import Path

from kvmesh.node.benchargs import (
    GGUF_HELP,
    Subparsers,
    add_bench_control,
    add_bench_llamacpp_suite,
    add_bench_policies,
    add_bench_subagents,
    add_bench_tools,
    add_bench_transfer,
    add_side_by_side,
)
from kvmesh.node.errors import ConfigError
from kvmesh.node.modelnames import is_gguf


def _positive(text: str) -> float:
    """argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _node_overrides(args: argparse.Namespace) -> dict[str, object]:
    o: dict[str, object] = {}
    for flag, key in (("name", "name"), ("engine", "engine.kind"), ("model", "engine.model"), ("slots", "engine.slots"), ("host", "api.host"),
                      ("port", "api.port"), ("cache_bytes", "engine.cache_bytes"), ("kv_scale", "engine.sim.kv_scale")):
        v = getattr(args, flag, None)
        if v is not None:
            o[key] = v
    return o


def cmd_node(args: argparse.Namespace) -> int:
    from kvmesh.node.config import load_config
    from kvmesh.node.server import serve

    cfg = load_config(args.config, _node_overrides(args))
    if cfg.api.event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SystemExit("api.event_loop = \"uvloop\" needs uvloop: pip install 'kvmesh[uvloop]'") from None
        uvloop.install()
    asyncio.run(serve(cfg, ready_file=args.ready_file))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvmesh.node.lab import bench

    return bench.run(args)


def cmd_netlab(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.netlab.run import run_netlab

    return run_netlab(args)


def cmd_load(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.bench.common import emit
    from kvmesh.node.lab.clientmodel import check_client_args, client_from_args
    from kvmesh.node.lab.load import LoadRunner, LoadShape

    problem = check_client_args(args)
    if problem:
        print(f"kvmesh load: {problem}", file=sys.stderr)
        return 2
    shape = LoadShape(sessions=args.sessions, target_tokens=args.target_tokens, max_tokens=args.max_tokens,
                      seed=args.seed)
    record = open(args.record, "w") if args.record else None
    turns = open(args.turns_out, "w") if args.turns_out else None
    try:
        runner = LoadRunner([u.rstrip("/") for u in args.node], shape, record=record, time_scale=args.time_scale,
                            client=client_from_args(args), sdk=args.sdk, turns=turns)
        if args.trace or args.mooncake:
            from kvmesh.node.lab.workload import read_trace, scale_trace

            try:
                reqs = read_trace(args.trace or args.mooncake)
            except (OSError, ValueError) as e:
                print(f"kvmesh load: {e}", file=sys.stderr)
                return 2
            if args.span is not None:
                reqs = [r for r in reqs if r.t < args.span]
            if not reqs or args.copies <= 0:
                print("kvmesh load: " + ("--copies must be above 0" if reqs else "no request in the trace's first "
                                         f"{args.span} s"), file=sys.stderr)
                return 2
            reqs = scale_trace(reqs, args.copies, max(r.t for r in reqs) or 1.0, random.Random(args.seed))
            stats = asyncio.run(runner.replay_requests(reqs[: args.limit], block_chars=args.block_chars,
                                                       until_s=args.until, one_session_id=args.one_session_id))
        else:
            stats = asyncio.run(runner.replay(args.replay) if args.replay else runner.run(args.duration))
    finally:
        for f in (record, turns):
            if f:
                f.close()
    return emit(stats.summary(), args)


def cmd_chaos(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.chaos import run_chaos

    return run_chaos(args)


def cmd_soak(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.soak import run_soak

    return run_soak(args)


def cmd_init(args: argparse.Namespace) -> int:
    from kvmesh.node.meshinit import cmd_init as run_init

    return run_init(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: keep long LLM conversations warm across hosts")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_add_node, _add_demo, _add_bench, _add_netlab, _add_load, _add_chaos, _add_soak, _add_init, _add_sim,
                _add_docs):
        add(sub)
    return p


def _add_sim(sub: Subparsers) -> None:
    from kvmesh.node.lab.sim.params import add_parser

    add_parser(sub).set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    if args.sweep:
        from kvmesh.node.lab.sim.sweep import run_sweep

        return run_sweep(args)
    from kvmesh.node.lab.sim.cli import run_sim

    return run_sim(args)


def _add_node(sub: Subparsers) -> None:
    n = sub.add_parser("node", help="run a node agent (engine + API)")
    n.add_argument("--config", type=Path, help="TOML config file for this host")
    n.add_argument("--name")
    n.add_argument("--engine", choices=["tiny", "sim", "torch", "llamacpp"])
    n.add_argument("--model", help="with --engine torch: a local Hugging Face checkpoint directory; "
                   "a GGUF file or a packaged model's alias (smollm2, gemma3-270m): llama.cpp")
    n.add_argument("--slots", type=int)
    n.add_argument("--host")
    n.add_argument("--port", type=int)
    n.add_argument("--cache-bytes", type=int)
    n.add_argument("--kv-scale", type=float)
    n.add_argument("--ready-file", type=Path, help="write {name, api, pid} JSON here once listening")
    n.set_defaults(func=cmd_node)


def _add_demo(sub: Subparsers) -> None:
    d = sub.add_parser("demo", help="a live two-node mesh with a coding-agent workload and the console")
    d.add_argument("--headless", action="store_true", help="print the counters once a second instead of the console")
    d.add_argument("--seconds", type=float, default=None, help="with --headless: stop after this long")
    d.add_argument("--sessions", type=int, default=16)
    d.add_argument("--engine", choices=["sim", "llamacpp"], help="default: llamacpp for a GGUF --model, else sim; "
                   "llamacpp: both nodes run llama.cpp on --model (default: a generated GGUF)")
    d.add_argument("--model", type=Path, help=GGUF_HELP)
    d.add_argument("--view", choices=("main", "demo"), default="main",
                   help="the console's first view; 'demo': big counters for a room (read-only)")
    d.set_defaults(func=cmd_demo, engine_default="sim")


def _add_bench(sub: Subparsers) -> None:
    b = sub.add_parser("bench", help="benchmarks; the last stdout line is one JSON object")
    bsub = b.add_subparsers(dest="bench", required=True)
    t = bsub.add_parser("ttft", help="cold vs warm (replica-imported) time to first token")
    t.add_argument("--json", action="store_true")
    t.add_argument("--tokens", type=int, default=16384)
    t.add_argument("--engine", choices=["tiny", "sim", "llamacpp", "vllm"], help="default: llamacpp for a GGUF --model, "
                   "else tiny; vllm: a vLLM server each side on --model (default: smollm2, converted)")
    t.add_argument("--store-dir", type=Path, help="where the replica file goes (default: a temp dir)")
    t.add_argument("--model", type=Path, help="a local Hugging Face checkpoint directory: run the torch engine on it; "
                   "a GGUF file or a packaged model's alias (smollm2, gemma3-270m): llama.cpp (default: a generated GGUF)")
    t.add_argument("--block-size", type=int, help="with llama.cpp: tokens per KV block (default: from the model's context)")
    t.add_argument("--swa", choices=["full", "window"], default="full", help="a sliding-window model's cache: every "
                   "position (full) or the last window, its replica a snapshot of it beside the blocks (window)")
    t.set_defaults(engine_default="tiny")
    h = bsub.add_parser("handoff", help="two sim nodes, 16 agent sessions: warm/partial/cold handoffs")
    h.add_argument("--json", action="store_true")
    h.add_argument("--duration", type=float, default=120.0)
    h.add_argument("--sessions", type=int, default=16)
    h.add_argument("--slots", type=int, default=4)
    h.add_argument("--kv-scale", type=float, default=0.05)
    h.add_argument("--cache-bytes", type=int, default=1 << 30)
    h.add_argument("--target-tokens", type=int, default=50_000, help="the sim's conversation length (llama.cpp: 80%% of the context)")
    h.add_argument("--max-tokens", type=int, default=64)
    h.add_argument("--time-scale", type=float, default=1.0, help="multiplies think times (compression < 1)")
    h.add_argument("--seed", type=int, default=1)
    h.add_argument("--cold-move-after", type=float, default=30.0, help="mesh.cold_move_after_s for both nodes")
    h.add_argument("--min-handoffs", type=int, help="after --duration, run on until this many handoffs "
                   "(default: 20 with llama.cpp, else 0); fewer by --max-duration is an error")
    h.add_argument("--max-duration", type=float, default=1500.0, help="seconds at most, with --min-handoffs")
    h.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio", help="the nodes' api.event_loop")
    h.add_argument("--replicate-min-tokens", type=int, help="kvshare.replicate_min_tokens (default: the node's, from its context)")
    h.add_argument("--engine", choices=["sim", "llamacpp", "vllm"], help="default: llamacpp for a GGUF --model, else "
                   "sim; llamacpp: both nodes run llama.cpp on --model (default: a generated GGUF); vllm: each node "
                   "drives a vLLM pinned to its own core (--model default: smollm2)")
    h.add_argument("--model", type=Path, help=GGUF_HELP + " (the same on both nodes)")
    h.set_defaults(engine_default="sim")
    ag = bsub.add_parser("agents", help="one scripted agent session per API dialect on two nodes: warm moves, reuse")
    ag.add_argument("--json", action="store_true")
    ag.add_argument("--turns", type=int, default=12)
    ag.add_argument("--move-every", type=int, default=3, help="drain the session's home before every Nth turn")
    ag.add_argument("--dialects", nargs="+", choices=["messages", "responses", "chat", "completions"],
                    default=["messages", "responses", "chat", "completions"])
    ag.add_argument("--system-chars", type=int, default=6000)
    ag.add_argument("--tool-chars", type=int, default=300)
    ag.add_argument("--max-tokens", type=int, default=64)
    ag.add_argument("--seed", type=int, default=1)
    ag.add_argument("--model", type=Path, help=GGUF_HELP + " (default: the sim engine, scripted tool calls)")
    for more in (add_bench_transfer, add_side_by_side, add_bench_control, add_bench_policies, add_bench_tools,
                 add_bench_subagents, add_bench_llamacpp_suite):
        more(bsub)
    b.set_defaults(func=cmd_bench)


def _add_netlab(sub: Subparsers) -> None:
    nl = sub.add_parser("netlab", help="the field report's experiment: two namespaces, shaped links (root)")
    nl.add_argument("--quick", action="store_true", help="240 s per link at --time-compress 6 (24 min of the report's run)")
    nl.add_argument("--links", default="1gbit,10gbit")
    nl.add_argument("--duration", type=_positive, default=None, help="seconds per link (default: the report's 90 minutes / K)")
    nl.add_argument("--time-compress", type=_positive, default=None, metavar="K",
                    help="run K times faster: think, prefill and decode times / K, link rates x K, same bytes")
    nl.add_argument("--kv-scale", type=_positive, default=0.05, help="KV bytes per token AND link rate x this")
    nl.add_argument("--time-scale", type=_positive, default=1.0, help="think times x this (heavier or lighter demand)")
    nl.add_argument("--demand", type=_positive, default=None, help="kv_share demand as a multiple of the report's (sets think times)")
    nl.add_argument("--kvshare", choices=["on", "off"], default="on", help="off: no replicas (the baseline to compare)")
    nl.add_argument("--sessions", type=int, default=16)
    nl.add_argument("--target-tokens", type=int, default=50_000, help="a conversation ends at this size")
    nl.add_argument("--cache-mib", type=int, default=1024, help="KV pool per node (MiB)")
    nl.add_argument("--seed", type=int, default=1)
    nl.add_argument("--out", default="netlab-out", help="directory for netlab.json and netlab.png")
    nl.add_argument("--json", action="store_true")
    nl.set_defaults(func=cmd_netlab)


def _add_load(sub: Subparsers) -> None:
    ld = sub.add_parser("load", help="drive a mesh like a fleet of coding agents")
    ld.add_argument("--node", action="append", required=True, help="entry node URL (repeat for several)")
    ld.add_argument("--sessions", type=int, default=16)
    ld.add_argument("--duration", type=float, default=120.0)
    ld.add_argument("--target-tokens", type=int, default=50_000)
    ld.add_argument("--max-tokens", type=int, default=64)
    ld.add_argument("--time-scale", type=float, default=1.0)
    ld.add_argument("--seed", type=int, default=1)
    ld.add_argument("--record", type=Path, help="write a JSONL trace of every turn")
    ld.add_argument("--replay", type=Path, help="replay a JSONL trace instead of generating")
    ld.add_argument("--turns-out", type=Path, help="write one JSON line per turn: when it was sent, session, entry, "
                    "host, handoff, prompt and cached tokens, TTFTs (or why it failed)")
    ld.add_argument("--mooncake", help="the same as --trace (kept for scripts): a Mooncake-format trace, or `mooncake` "
                    "as chat turns, one session per conversation")
    ld.add_argument("--trace", help="replay a trace as chat turns: a Mooncake-format file, `mooncake`, or Claude Code "
                    "traces (a directory of trace_*.json.gz, or one); each conversation a closed loop at its trace times")
    ld.add_argument("--copies", type=float, default=1.0, help="with a trace: its sessions this many times over, each "
                    "copy shifted within the trace's span with ids of its own (as `kvmesh sim --load` scales it)")
    ld.add_argument("--span", type=float, help="with a trace: only the requests it sends in its first SPAN seconds")
    ld.add_argument("--until", type=float, help="with a trace: send no request after this many seconds")
    ld.add_argument("--limit", type=int, help="with a trace: only its first N requests")
    ld.add_argument("--one-session-id", action="store_true", help="with a trace: send a session's subagents under "
                    "its own id, as Claude Code does (each conversation is still told apart by its opening)")
    ld.add_argument("--block-chars", type=int, default=512, help="with a trace: characters of text per 512-token "
                    "block (512 for the sim's byte tokenizer; about 2000 for a BPE model's; less scales prompts down)")
    from kvmesh.node.lab.clientmodel import add_client_args, add_sdk_arg

    add_client_args(ld)
    add_sdk_arg(ld)
    ld.add_argument("--json", action="store_true")
    ld.set_defaults(func=cmd_load)


def _add_chaos(sub: Subparsers) -> None:
    ch = sub.add_parser("chaos", help="fault drills on a local three-node sim mesh; invariants checked after each")
    ch.add_argument("--json", action="store_true")
    ch.add_argument("--only", nargs="+", action="extend", metavar="NAME", help="run only these scenarios (see --list)")
    ch.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ch.add_argument("--seed", type=int, default=1)
    ch.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, stores)")
    ch.set_defaults(func=cmd_chaos)


def _add_soak(sub: Subparsers) -> None:
    so = sub.add_parser("soak", help="64 agent sessions on a three-node sim mesh: errors, latency, RSS, fds, store")
    so.add_argument("--minutes", type=float, default=2.0)
    so.add_argument("--sessions", type=int, default=64)
    so.add_argument("--seed", type=int, default=1)
    so.add_argument("--json", action="store_true")
    # Absent unless given: `run_soak` holds the defaults (30 s, 96 fds) and the reasons for them.
    so.add_argument("--max-p99-s", type=float, default=argparse.SUPPRESS, help="fail when the p99 turn latency is above this (30)")
    so.add_argument("--max-fd-growth", type=int, default=argparse.SUPPRESS,
                    help="fail when a node ends with this many more fds than at steady state (96)")
    so.set_defaults(func=cmd_soak)


def _add_init(sub: Subparsers) -> None:
    i = sub.add_parser("init", help="write one commented TOML config per host of a new mesh",
                       description="Write <name>.toml per host (a fresh mesh secret and admin token), "
                                   "admin-token and console.toml into --out.")
    i.add_argument("--host", action="append", required=True, metavar="NAME=ADDR[,KVSHARE_ADDR]",
                   help="a host of the mesh (repeat); the second address, if given, is where kv_share listens")
    i.add_argument("--out", type=Path, default=Path("kvmesh-mesh"), help="folder for the files (default: kvmesh-mesh)")
    i.add_argument("--engine", choices=["sim", "tiny", "torch", "llamacpp"], help="default: llamacpp for a GGUF --model, else sim")
    i.add_argument("--model", default="", help="with --engine torch: the checkpoint directory on every host; "
                   "a GGUF file on every host or a packaged model's alias (smollm2, gemma3-270m): llama.cpp")
    i.add_argument("--slots", type=int, default=4)
    i.add_argument("--api-port", type=int, default=8000)
    i.add_argument("--kvshare-port", type=int, default=9000)
    i.add_argument("--store-dir", default="/var/lib/kvmesh/store", help="replica store folder on each host")
    i.add_argument("--force", action="store_true", help="overwrite files that exist")
    i.set_defaults(func=cmd_init, engine_default="sim")


def _add_docs(sub: Subparsers) -> None:
    d = sub.add_parser("docs", help="write the manual's generated pages (configuration, CLI, HTTP API, metrics, screenshots)")
    d.add_argument("--root", type=Path, default=Path("."), help="the kvmesh checkout whose docs/ to write (default: here)")
    d.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each page that is out of date")
    d.set_defaults(func=cmd_docs)


def cmd_docs(args: argparse.Namespace) -> int:
    from kvmesh.node.lab.docs import run_docs

    return run_docs(args, build_parser())


def _infer_engine(args: argparse.Namespace) -> None:
    """A GGUF `--model` (a `.gguf` path or a packaged alias) means llama.cpp unless `--engine` says otherwise."""
    default = getattr(args, "engine_default", None)
    if default is None or args.engine is not None:
        return
    model = getattr(args, "model", None)
    args.engine = "llamacpp" if model and is_gguf(model) else default


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _infer_engine(args)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # At DEBUG the websockets library logs every handshake's headers, the mesh's peer token among them.
    for name in ("websockets.client", "websockets.server"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"kvmesh: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
