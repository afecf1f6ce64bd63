"""`kvmesh demo`: a live two-node mesh, a coding-agent workload, and the console on top.

Both nodes run the sim engine (4 slots each) at a pace that keeps them busy (with
`--engine llamacpp`, llama.cpp on `--model X.gguf` or on a generated GGUF),
so sessions move every few seconds and replicas land ahead of them. With
`--headless` the warm/partial/cold counters are printed once a second instead
of opening the console. Ctrl-C (or quitting the console) stops everything this
command started, by PID, and removes its temp directory.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.bench.common import llama_shape, llamacpp_engine, start_mesh
from kvmesh.node.lab.launcher import NodeProcess, client_key_headers, wait_peers
from kvmesh.node.lab.load import LoadRunner, LoadShape


class _Workload:
    """The load generator on a thread of its own, stoppable."""

    def __init__(self, apis: list[str], sessions: int, sized: dict[str, Any]):
        shape = LoadShape(sessions=sessions, max_tokens=48, think_s=(0.3, 1.5), **{"target_tokens": 40_000, **sized})
        self.runner = LoadRunner(apis, shape)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="demo-load", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.runner.run(24 * 3600))
        except Exception:  # noqa: BLE001 - the demo's workload failing must not hide the console
            pass

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.runner._stop.set)
        self.thread.join(timeout=30)


def _print_counters(api: str, stop_after: float | None) -> None:
    t0 = time.monotonic()
    print(f"{'time':>6} {'turns':>6} {'handoffs':>8} {'warm':>5} {'part':>5} {'cold':>5} {'warm%':>6}  hosts")
    with httpx.Client(timeout=5, headers=client_key_headers()) as c:
        while stop_after is None or time.monotonic() - t0 < stop_after:
            time.sleep(1.0)
            try:
                cl = c.get(f"{api}/v1/cluster").json()
            except httpx.HTTPError:
                continue
            k = cl["counters"]
            total = k["warm"] + k["partial"] + k["cold"]
            pct = f"{100 * k['warm'] / total:5.1f}%" if total else "    -"
            turns = sum(s["turns"] for s in cl["sessions"])
            hosts = " ".join(f"{h['name']}:{h['busy']}/{h['slots']}{' DRAIN' if h['draining'] else ''}"
                             for h in cl["hosts"])
            print(f"{time.monotonic() - t0:6.0f} {turns:>6} {total:>8} {k['warm']:>5} {k['partial']:>5} {k['cold']:>5} "
                  f"{pct}  {hosts}", flush=True)


def _interrupt_on(*signums: int) -> None:
    """SIGTERM or a hang-up (the SSH session or tmux window closing) stops the demo like
    Ctrl-C does, so its nodes, which run in sessions of their own, are stopped too."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for s in signums:
        signal.signal(s, handler)


def run_demo(args: argparse.Namespace) -> int:
    _interrupt_on(signal.SIGTERM, signal.SIGHUP)
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        work = Path(tmp)
        engine = llamacpp_engine(args, max_context=None)
        sized: dict[str, Any] = {}
        if engine is not None:  # a GGUF: conversations sized to its context, in its own tokens
            sized, said = llama_shape(engine["model"])
            engine["max_context"] = said["context"]
        print(f"starting a two-node mesh ({engine['kind'] if engine else 'sim'} engine, 4 slots each) ...", flush=True)
        nodes: list[NodeProcess] = start_mesh(
            work, ["gpu-1", "gpu-2"], slots=4, kv_scale=0.05, cache_bytes=768 << 20,
            extra={"kvshare": {"replicate_min_tokens": 4096}, "admin_token": token}, engine=engine,
        )
        load: _Workload | None = None
        try:
            wait_peers(nodes)
            apis = [n.api for n in nodes]
            print("mesh up: " + ", ".join(f"{n.name} {n.api} pid {n.info['pid']}" for n in nodes), flush=True)
            load = _Workload(apis, args.sessions, sized)
            load.start()
            if args.headless:
                _print_counters(apis[0], args.seconds)
            else:
                # The console owns the terminal: log lines go to a file instead of over the screen.
                root = logging.getLogger()
                for h in list(root.handlers):
                    root.removeHandler(h)
                root.addHandler(logging.FileHandler(work / "demo.log"))
                token_file = work / "admin-token"
                token_file.write_text(token)
                os.chmod(token_file, 0o600)
                from kvmesh.console.cli import main as console_main

                console_main([*(f"--node={a}" for a in apis), f"--admin-token-file={token_file}",
                              f"--view={args.view}"])
        except KeyboardInterrupt:
            pass
        finally:
            print("stopping the demo ...", file=sys.stderr, flush=True)
            if load is not None:
                load.stop()
            for n in nodes:
                n.stop()
    return 0

