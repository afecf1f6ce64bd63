"""`kvmesh bench ...`: each benchmark prints one JSON object as its last stdout line.

This package's own module only dispatches; what the benchmarks share (output, exit
status, a local mesh) lives in `node.lab.bench.common`, so no benchmark imports this one.
"""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args.bench`; its exit status is non-zero when its run had errors.

    Under `reaper.guarded`: a bench ended by SIGTERM or Ctrl-C stops every process it started first."""
    from kvmesh.node.lab.bench.reaper import guarded

    with guarded(f"kvmesh bench {args.bench}"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.bench == "nodepath":
        from kvmesh.node.lab.bench.nodepath import run_nodepath

        return run_nodepath(args)
    if args.bench == "ttft":
        from kvmesh.node.lab.bench.ttft import run_ttft

        return run_ttft(args)
    if args.bench == "handoff":
        from kvmesh.node.lab.bench.handoff import run_handoff

        return run_handoff(args)
    if args.bench == "agents":
        from kvmesh.node.lab.bench.agents import run_agents

        return run_agents(args)
    if args.bench == "control":
        from kvmesh.node.lab.bench.control import run_control

        return run_control(args)
    if args.bench == "exactness":
        from kvmesh.node.lab.bench.exactness import run_exactness

        return run_exactness(args)
    if args.bench == "policies":
        from kvmesh.node.lab.bench.policies import run_policies

        return run_policies(args)
    if args.bench == "versus":
        from kvmesh.node.lab.bench.versus import run_versus

        return run_versus(args)
    if args.bench == "tools":
        from kvmesh.node.lab.bench.tools import run_tools

        return run_tools(args)
    if args.bench == "engine":
        from kvmesh.node.lab.bench.enginebench import run_engine

        return run_engine(args)
    if args.bench == "transfer" and getattr(args, "engine", "sim") == "llamacpp":
        from kvmesh.node.lab.bench.llamaxfer import run_llama_transfer

        return run_llama_transfer(args)
    if args.bench == "transfer":
        from kvmesh.node.lab.bench.transfer import run_transfer

        return run_transfer(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
