"""`kvmesh bench versus`: kvmesh against what operators would run instead, side by side.

Two "hosts" on this machine, each pinned to its own core with one compute thread (on one
2-core VM both hosts would otherwise share both cores, and a move would buy no capacity); the
load generator and the proxy run beside them, unpinned. The same GGUF, slots and context per
slot on every arm, the same coding-agent workload (node.lab.load, sized to the model's context
by `llama_shape`) and seed, or with `--trace` the same requests of an agent trace (Claude Code's, scaled
to the model's context: `trace_requests`). Arms, one after the other:
- `kvmesh`: two kvmesh nodes, llama.cpp engine, kv_share on; turns enter either node;
- `sticky`: two llama-servers (`--cache-ram`) behind nginx hashing `X-Session-Id`;
- `round_robin`: the same llama-servers behind nginx round robin;
- `kvmesh_no_share`: kvmesh with `kvshare.enabled = false`.
With think times, turns/s mostly measures the think times, so TTFT percentiles and the prompt
tokens each arm recomputed (usage's cached tokens, llama-server's `timings.cache_n`) are the
figures to read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.lab.bench.common import emit, llama_shape
from kvmesh.node.lab.launcher import pinned, wait_peers, write_mesh
from kvmesh.node.lab.llamaserver import LlamaServer
from kvmesh.node.lab.load import LoadRunner, LoadShape
from kvmesh.node.lab.netlab.mesh import lab_api, lab_nodes
from kvmesh.node.lab.netlab.netns import TwoHostLab, can_use_netns
from kvmesh.node.lab.nginx import Proxy
from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, TraceRequest, read_trace

ARMS = ("kvmesh", "sticky", "round_robin", "kvmesh_no_share")


def host_cores() -> tuple[set[int], set[int]]:
    """One core of this process's for each host (the first two it may use)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"kvmesh bench versus: two hosts need two cores, this process may use {len(cores)}")
    return {cores[0]}, {cores[1]}


def _kvmesh(work: Path, model: Path, slots: int, ctx: int, cache_bytes: int, share: bool,
            lab: TwoHostLab | None) -> tuple[list[str], Callable[[], None]]:
    engine = {"kind": "llamacpp", "model": str(model), "slots": slots, "max_context": ctx, "cache_bytes": cache_bytes,
              "queue_timeout_s": 600.0, "llamacpp": {"threads": 1}}
    extra: dict[str, Any] = {"kvshare": {"fsync": "never", "store_budget_bytes": 2 * cache_bytes, "enabled": share},
                             "mesh": {"poll_interval_s": 0.25}}
    if lab is not None:  # each node in its namespace; peers and kv_share over the shaped data link
        nodes = lab_nodes(lab, work, engine=engine, extra=extra, pins=[pinned(c) for c in host_cores()])

        def stop() -> None:
            for n in nodes:
                n.stop()

        try:
            for n in nodes:
                n.wait_ready(300)
                n.info["api"] = lab_api(lab, n.name)
            wait_peers(nodes)
        except BaseException:
            stop()
            raise
        return [n.api for n in nodes], stop
    mesh = write_mesh(work, ["host-a", "host-b"], engine=engine, extra=extra)
    for node, cores in zip(mesh.nodes.values(), host_cores()):
        node.prefix = pinned(cores)
    mesh.start(ready_timeout=300)
    return [mesh.api(n) for n in mesh.names], mesh.stop


def _servers(work: Path, model: Path, slots: int, ctx: int, cache_bytes: int, policy: str,
             lab: TwoHostLab | None) -> tuple[list[str], Callable[[], None]]:
    where: list[dict[str, Any]] = [{}, {}] if lab is None else \
        [{"prefix": h.exec_prefix(), "host": h.mgmt_ip, "bind": "0.0.0.0"} for h in lab.hosts]
    repack = weight_buffers(LlamaCppConfig()).extra_bufts  # the kernels kvmesh's nodes run on this host (auto)
    servers = [LlamaServer(model, slots=slots, ctx_per_slot=ctx, threads=1, cores=cores, cache_ram_mib=cache_bytes >> 20,
                           log=work / f"llama-server-{i}.log", repack=repack, **where[i])
               for i, cores in enumerate(host_cores())]
    proxies: list[Proxy] = []  # made once the servers' ports are known

    def stop() -> None:
        for p in proxies:
            p.stop()
        for s in servers:
            s.stop()

    try:
        for s in servers:
            s.start()
        proxies.append(Proxy(work / "nginx", [s.address for s in servers], policy).start())
    except BaseException:
        stop()
        raise
    return [proxies[0].url], stop


def trace_requests(args: argparse.Namespace, ctx: int, per_token: float) -> tuple[list[TraceRequest], int, dict[str, Any]]:
    """`--trace`: the requests every arm replays, and the prompt characters per 512-token trace block.

    The trace's first `--sessions` sessions (by name), their requests in the first `--span` seconds of
    trace time (default: what --duration covers at --time-scale). Prompts keep the trace's proportions
    (shared prefixes, growth, compaction) scaled so the longest one selected fills 80% of the context
    per slot, in the model's tokens: a real agent's 100k-token prompts become a small model's few thousand."""
    reqs = read_trace(args.trace)
    span = args.span if args.span is not None else args.duration / args.time_scale
    keep = set(sorted({r.session for r in reqs})[: args.sessions])
    sel = [r for r in reqs if r.session in keep and r.t < span]
    if not sel:
        raise SystemExit(f"kvmesh bench versus: no request in {args.trace}'s first {span:g} s of its first "
                         f"{args.sessions} sessions")
    biggest = max(r.input_length for r in sel)
    block_chars = max(1, int(0.8 * ctx * per_token * TRACE_BLOCK_TOKENS / biggest))
    said = {"trace": str(args.trace), "span_s": span, "sessions": len(keep), "clients": len({r.client or r.session for r in sel}),
            "requests": len(sel), "block_chars": block_chars, "scale": round(block_chars / per_token / TRACE_BLOCK_TOKENS, 5),
            "trace_prompt_tokens_max": biggest, "prompt_tokens_max": int(biggest * block_chars / TRACE_BLOCK_TOKENS / per_token)}
    return sel, block_chars, said


def run_versus(args: argparse.Namespace) -> int:
    from kvmesh.node.engine.modelfiles import resolve

    model = resolve(args.model or "smollm2")
    overrides, said = llama_shape(str(model))
    ctx = said["context"]
    cache_bytes = args.cache_mib << 20
    replay = trace_requests(args, ctx, said["chars_per_token"]) if args.trace else None
    if replay is not None:
        said = {**said, "trace": replay[2]}
    arms: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        lab = None if args.link == "loopback" else stack.enter_context(_lab(args.link))
        for arm in args.arms:
            arms[arm] = _arm(arm, args, model, overrides, ctx, cache_bytes, lab, replay)
            print(f"versus: {arm}: {arms[arm]}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"arms": arms, "model": model.stem, "link": args.link, "sessions": args.sessions,
                              "slots_per_host": args.slots, "ctx_per_slot": ctx, "duration_s": args.duration,
                              "hosts": ("2 on loopback" if lab is None else f"2 network namespaces, {args.link} between them")
                              + ", each pinned to its own core, 1 compute thread; client and proxy beside them",
                              "shape": said, "extra_bufts": weight_buffers(LlamaCppConfig()).extra_bufts}
    result.update(summarize(arms))
    return emit(result, args)


def _lab(link: str) -> TwoHostLab:
    ok, why = can_use_netns()
    if not ok:
        raise SystemExit(f"kvmesh bench versus --link {link}: {why}")
    return TwoHostLab(link)


def _arm(arm: str, args: argparse.Namespace, model: Path, overrides: dict[str, Any], ctx: int, cache_bytes: int,
         lab: TwoHostLab | None, replay: tuple[list[TraceRequest], int, dict[str, Any]] | None) -> dict[str, Any]:
    """One arm, started, driven for --duration (the agent workload, or the trace's requests) and stopped; its figures."""
    with tempfile.TemporaryDirectory(prefix=f"kvmesh-versus-{arm}-") as tmp:
        work = Path(tmp)
        if arm.startswith("kvmesh"):
            urls, stop = _kvmesh(work, model, args.slots, ctx, cache_bytes, arm == "kvmesh", lab)
        else:
            urls, stop = _servers(work, model, args.slots, ctx, cache_bytes, arm, lab)
        try:
            shape = LoadShape(sessions=args.sessions, seed=args.seed, max_tokens=args.max_tokens, **overrides)
            runner = LoadRunner(urls, shape, time_scale=args.time_scale)
            t0 = time.monotonic()
            if replay is None:
                load = asyncio.run(runner.run(args.duration)).summary()
            else:
                load = asyncio.run(runner.replay_requests(replay[0], block_chars=replay[1], until_s=args.duration)).summary()
            elapsed = time.monotonic() - t0
        finally:
            stop()
    return {"ttft_p50_s": load["ttft_p50_s"], "ttft_p95_s": load["ttft_p95_s"], "ttft_p99_s": load["ttft_p99_s"],
            "turns_per_s": round(load["turns"] / elapsed, 4), "turns": load["turns"],
            "prompt_tokens": load["prompt_tokens"], "prompt_tokens_recomputed": load["prompt_tokens_recomputed"],
            "latency_p50_s": load["latency_p50_s"], "errors": load["errors"], "error_samples": load["error_samples"],
            "handoffs": load["handoffs"] if arm.startswith("kvmesh") else None, "duration_s": round(elapsed, 1)}


def summarize(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The top-level figures: kvmesh's TTFT p95 and turns/s over the others' (where both arms ran),
    and every arm's errors (a run with any is a failed bench)."""
    out: dict[str, Any] = {}
    k = arms.get("kvmesh")
    for other in ("sticky", "round_robin"):
        o = arms.get(other)
        if k and o and k["ttft_p95_s"] and o["ttft_p95_s"]:
            out[f"ttft_p95_ratio_vs_{other}"] = round(k["ttft_p95_s"] / o["ttft_p95_s"], 3)
        if k and o and o["turns_per_s"]:
            out[f"turns_per_s_ratio_vs_{other}"] = round(k["turns_per_s"] / o["turns_per_s"], 3)
    out["errors"] = sum(a["errors"] for a in arms.values())
    out["error_samples"] = [f"{n}: {e}" for n, a in arms.items() for e in a["error_samples"][:2]]
    if not arms or any(not a["turns"] for a in arms.values()):
        out["errors"] = out["errors"] or 1
        out["error_samples"].append("an arm completed no turn")
    return out
