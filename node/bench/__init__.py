"""`kvmesh bench ...`: each benchmark prints one JSON object as its last stdout line."""

from __future__ import annotations

import argparse
import json
from typing import Any


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Human lines first (unless --json), then the JSON object as the very last line."""
    if not getattr(args, "json", False):
        for k, v in result.items():
            print(f"{k:>28}: {v}")
    print(json.dumps(result), flush=True)


def run(args: argparse.Namespace) -> int:
    if args.bench == "ttft":
        from kvmesh.node.bench.ttft import run_ttft

        return run_ttft(args)
    if args.bench == "handoff":
        from kvmesh.node.bench.handoff import run_handoff

        return run_handoff(args)
    if args.bench == "transfer":
        from kvmesh.node.bench.transfer import run_transfer

        return run_transfer(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
