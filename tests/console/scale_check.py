"""A manual check at scale (not collected by pytest): N real sim nodes on loopback, agent sessions through every
entry, and the real console (headless, Textual and all, started on one node and discovering the rest) holding
every session the nodes hold, then again after a node restarts. Prints one JSON line.

    .venv/bin/python tests/console/scale_check.py --nodes 32 --sessions 64

Past `mesh.directory_after_hosts` (16 by default) no node's snapshot lists every session, so this is the
console's merge of the nodes' parts at work, at a size the test suite does not start (issue 32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvmesh.console.app import KvmeshConsole
from kvmesh.console.config import ConsoleConfig
from kvmesh.console.state import ConsoleState
from kvmesh.node.lab.launcher import LocalMesh, write_mesh
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

SECRET = "msk-" + secrets.token_hex(16)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _turn(http: httpx.AsyncClient, api: str, session: str, n: int) -> None:
    body = {"model": "kvmesh-sim", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": f"agent {session} " * 300},
                         *({"role": "user", "content": f"step {i} of {session}"} for i in range(n + 1))]}
    r = await http.post(f"{api}/v1/chat/completions", json=body, headers={"X-Session-Id": session})
    r.raise_for_status()


async def _load(http: httpx.AsyncClient, apis: list[str], sessions: list[str], turns: range) -> None:
    gate = asyncio.Semaphore(8)

    async def one(i: int, s: str) -> None:
        for n in turns:
            async with gate:
                await _turn(http, apis[(i * 7 + n) % len(apis)], s, n)

    await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))


async def _held(http: httpx.AsyncClient, m: LocalMesh) -> set[str]:
    async def one(n: str) -> set[str]:
        r = await http.get(m.api(n) + "/v1/peer/status", headers={PEER_HEADER: peer_token(SECRET.encode())})
        r.raise_for_status()
        return {s["session"] for s in r.json()["sessions"]}

    return set().union(*await asyncio.gather(*(one(n) for n in m.names)))


async def _converge(http: httpx.AsyncClient, m: LocalMesh, state: ConsoleState, timeout: float) -> tuple[float, set[str], set[str]]:
    """Seconds until the console holds exactly what the nodes hold (or the timeout), and what it lacks / has extra."""
    t0 = time.monotonic()
    while True:
        held = await _held(http, m)
        got = set(state.sessions)
        if got == held or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, held - got, got - held
        await asyncio.sleep(0.5)


async def run(nodes: int, n_sessions: int, workdir: Path) -> dict[str, object]:
    names = [f"h{i:02d}" for i in range(nodes)]
    m = write_mesh(workdir, names, engine={"kind": "sim", "slots": 2, "cache_bytes": 32 << 20,
                                           "sim": {"kv_scale": 0.02, "decode_tps": 400.0, "prefill_tps": 40000.0}},
                   extra={"mesh": {"secret": SECRET}, "kvshare": {"fsync": "never", "replicate_min_tokens": 512}})
    m.start(ready_timeout=120, peers_timeout=180)
    out: dict[str, object] = {"nodes": nodes}
    try:
        apis = [m.api(n) for n in names]
        sessions = [f"agent-{i:03d}" for i in range(n_sessions)]
        async with httpx.AsyncClient(timeout=60.0) as http:
            await _load(http, apis, sessions, range(3))
            state = ConsoleState()
            app = KvmeshConsole(ConsoleConfig(nodes=[apis[0]], readonly=True, refresh_interval=0.5), state=state)
            t_start = time.monotonic()
            async with app.run_test(size=(200, 50), headless=True):
                waited, missing, extra = await _converge(http, m, state, 120)
                out.update(full_view_s=round(time.monotonic() - t_start, 2), streams=len(state.nodes),
                           sessions_held=len(await _held(http, m)), console_sessions=len(state.sessions),
                           missing=len(missing), extra=len(extra))
                own = (await http.get(apis[0] + "/v1/cluster")).json()
                whole = (await http.get(apis[0] + "/v1/cluster", params={"scope": "mesh"})).json()
                out.update(cluster_scope=own["scope"], cluster_sessions=len(own["sessions"]),
                           fan_in_scope=whole["scope"], fan_in_sessions=len(whole["sessions"]))
                victim = m.nodes[names[5]]
                victim.stop()
                victim.start().wait_ready(120)
                await _load(http, apis, sessions[: n_sessions // 4], range(3, 4))
                waited, missing, extra = await _converge(http, m, state, 120)
                out.update(after_restart_s=round(waited, 2), sessions_held_after=len(await _held(http, m)),
                           console_sessions_after=len(state.sessions), missing_after_restart=len(missing),
                           extra_after_restart=len(extra))
                rss = [_rss_mb(p.proc.pid) for p in m.nodes.values() if p.proc is not None]
                out.update(node_rss_mb_median=round(statistics.median(rss), 1), node_rss_mb_max=round(max(rss), 1),
                           console_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    finally:
        m.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--sessions", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvmesh-scale-") as d:
        result = asyncio.run(run(args.nodes, args.sessions, Path(d)))
    print(json.dumps(result), flush=True)
    return 0 if result.get("missing") == 0 and result.get("missing_after_restart") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
