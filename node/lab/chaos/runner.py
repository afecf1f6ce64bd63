"""Running the drills: each scenario on a fresh mesh, judged; the reference node; `kvmesh chaos`.

The last stdout line is one JSON object: `{"scenarios": N, "passed": N, "failed": N, "not_run": N,
"failed_turns": 0, "corrupt_imports": 0, "details": [...]}`. Exit status 0 only when every scenario
passed; 1 when any failed; 3 when none failed but some could not inject their fault (not run).
Every process, proxy and mount started here is cleaned up on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.chaos.cleanup import CLEANUP
from kvmesh.node.lab.chaos.harness import KV_SCALE, NAMES, Drill, stop_quietly
from kvmesh.node.lab.chaos.invariants import Observed, judge, replay, serving_after
from kvmesh.node.lab.chaos.scenarios import SCENARIOS, Scenario
from kvmesh.node.lab.chaos.verify import temp_files, verify_store
from kvmesh.node.lab.launcher import NodeProcess, free_port, write_toml

EXIT_NOT_RUN = 3


async def _drive(sc: Scenario, d: Drill, obs: Observed) -> None:
    """Start the mesh, run the scenario, check serving; then stop the load and, once kv_share is
    idle, look for live temp files. A drill that breaks is a failed scenario, with the reason."""
    try:
        if sc.env is not None:
            d.env = sc.env(d)
        await d.start()
        await sc.run(d)
        obs.serving = await serving_after(d)
    except Exception as e:  # noqa: BLE001 - the reason goes into the report
        obs.failures.append(f"drill error: {type(e).__name__}: {e}")
    finally:
        if d.load is not None:
            d.load.stop()  # on Ctrl-C too; the turns in flight end on their own
    try:
        await d.stop_load()
    except Exception as e:  # noqa: BLE001
        obs.failures.append(f"load did not stop: {type(e).__name__}: {e}")
    if d.nodes and all(d.alive(n) for n in NAMES):
        if not await d.quiesce(1.0, 30.0):
            obs.failures.append("kv_share never went idle")
        obs.live_temp = {n: t for n in NAMES if (t := temp_files(d.stores[n]))}


async def run_scenario(sc: Scenario, workdir: Path, seed: int, ref_api: str) -> dict[str, Any]:
    """One scenario on a fresh mesh; returns its details (see `invariants.judge`)."""
    d = Drill(workdir, sc.name, seed, overrides=copy.deepcopy(sc.overrides))
    t0 = time.monotonic()
    obs = Observed()
    ctx = contextlib.contextmanager(sc.setup)(d) if sc.setup else contextlib.nullcontext()
    with ctx:  # a mount (disk-full) outlives the nodes and the store check, nothing more
        try:
            await _drive(sc, d, obs)
            await d.stop_nodes()
            obs.stores = [await asyncio.to_thread(verify_store, d.stores[n], n) for n in NAMES]
        finally:
            d.close()  # nodes and proxies gone before the mount is
    try:
        obs.compared, obs.mismatches = await replay(ref_api, d.pairs, d.http)
    except httpx.HTTPError as e:
        obs.failures.append(f"reference replay failed: {type(e).__name__}: {e}")
    await d.http.aclose()
    obs.seconds = time.monotonic() - t0
    return judge(d, sc.name, sc.about, obs)


def _reference(workdir: Path) -> NodeProcess:
    """A single node that never fails: the same model, faster sim rates (they set timing only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = {"name": "reference", "api": {"host": "127.0.0.1", "port": free_port()},
           "engine": {"kind": "sim", "slots": 8, "cache_bytes": 256 << 20, "queue_timeout_s": 300.0,
                      "sim": {"kv_scale": KV_SCALE, "decode_tps": 5000.0, "prefill_tps": 2_000_000.0}},
           "kvshare": {"listen": f"127.0.0.1:{free_port()}", "store_dir": str(workdir / "store-reference"),
                       "replicate_min_tokens": 1 << 30, "persist_own": False, "fsync": "never"}}
    path = workdir / "reference.toml"
    write_toml(path, cfg)
    return NodeProcess("reference", path, workdir)


def line(det: dict[str, Any]) -> str:
    """One scenario's result for a human: a line, then one per failure."""
    t = det["turns"]
    word = {"passed": "PASS", "failed": "FAIL", "not_run": "NOT RUN"}[det["status"]]
    head = (f"{word} {det['name']:<22} {det['seconds']:>6.1f}s  "
            f"turns {t['load']}+{t['drill']}, failed {det['failed_turns']}, 5xx {det['http_5xx']}, "
            f"corrupt {det['corrupt_imports']}/{det['blocks_rehashed']} blocks, "
            f"outputs {det['outputs_compared'] - len(det['output_mismatches'])}/{det['outputs_compared']} same, "
            f"leaked {det['leaked_temp_files']}")
    why = [f"not run: {det['not_run']}"] if det["status"] == "not_run" else det["failures"]
    return head + "".join(f"\n      - {f}" for f in why)


def summarize(details: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The run's JSON summary and exit status: 0 only when every scenario passed (and some ran);
    1 when any failed; EXIT_NOT_RUN when none failed but some could not inject their fault."""
    count = {s: sum(d["status"] == s for d in details) for s in ("passed", "failed", "not_run")}
    result = {"scenarios": len(details), **count,
              "failed_turns": sum(d["failed_turns"] for d in details),
              "corrupt_imports": sum(d["corrupt_imports"] for d in details), "details": details}
    if not details or count["failed"]:
        return result, 1
    return result, EXIT_NOT_RUN if count["not_run"] else 0


async def _run_all(names: list[str], workdir: Path, seed: int) -> list[dict[str, Any]]:
    ref = _reference(workdir / "reference")
    ref.start()
    undo = CLEANUP.push("reference node", lambda: stop_quietly(ref))
    try:
        await asyncio.to_thread(ref.wait_ready, 90.0)
        details = []
        for k, name in enumerate(names):
            sc = next(s for s in SCENARIOS if s.name == name)
            print(f"chaos: {sc.name}: {sc.about} ...", flush=True)
            det = await run_scenario(sc, workdir / sc.name, seed * 1000 + k * 17 + 1, ref.api)
            print(line(det), flush=True)
            details.append(det)
        return details
    finally:
        CLEANUP.discard(undo)
        stop_quietly(ref)


def _chosen(args: argparse.Namespace) -> list[str] | None:
    """The scenarios `--only` names (every one without it); None after reporting unknown names."""
    names = [s.name for s in SCENARIOS]
    only = list(getattr(args, "only", None) or [])
    unknown = [n for n in only if n not in names]
    if unknown:
        print(f"kvmesh chaos: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(names)}", file=sys.stderr)
        return None
    return [n for n in names if not only or n in only]


def run_chaos(args: argparse.Namespace) -> int:
    """`kvmesh chaos`: run the chosen scenarios, print a line each and the JSON summary last."""
    if getattr(args, "list", False):
        for s in SCENARIOS:
            print(f"{s.name:<24} {s.about}")
        return 0
    chosen = _chosen(args)
    if chosen is None:
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    if not getattr(args, "keep", False):
        CLEANUP.push("work directory", lambda: shutil.rmtree(workdir, ignore_errors=True))
    else:
        print(f"chaos: work directory {workdir} (kept)", flush=True)

    async def main() -> list[dict[str, Any]]:
        # SIGTERM ends the run like Ctrl-C does: cancel, then every finally block cleans up.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await _run_all(chosen, workdir, int(getattr(args, "seed", 1)))

    try:
        details = asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("kvmesh chaos: interrupted; everything started was stopped", file=sys.stderr)
        return 130
    finally:
        CLEANUP.run()
    result, rc = summarize(details)
    if not getattr(args, "json", False):
        print(f"chaos: {result['passed']} of {result['scenarios']} scenarios passed, {result['failed']} failed, "
              f"{result['not_run']} not run; {result['failed_turns']} failed turns; "
              f"{result['corrupt_imports']} corrupt imports")
    print(json.dumps(result, default=str), flush=True)
    return rc
