"""`kvmesh bench transfer`: a 247 MiB kv_share delta vs raw TCP, between the same two hosts.

Two node processes (sim engine at the field report's 20 KiB/token): a session
is replicated once (the base), grows by the delta, and the delta's replica is
measured as the receiver saw it (answer -> last byte), with its ready lag
(last byte -> imported). In the same run, a raw single-stream TCP send of the
same byte count between the same two hosts. On loopback by default; with
`--link 1gbit|10gbit` (root) across a shaped veth pair between two namespaces.
The figures reported are the median round's (by kv_share/raw ratio); a round that
fails is counted in `errors` and makes the exit status non-zero.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from kvmesh.node.lab.bench import rawtcp
from kvmesh.node.lab.bench.common import emit
from kvmesh.node.lab.launcher import NodeProcess, mesh_configs, wait_peers
from kvmesh.node.lab.netlab.mesh import LAB_SECRET
from kvmesh.node.lab.workload import text
from kvmesh.node.mesh.auth import PEER_HEADER, peer_token

BLOCK = 256
_PEER_TOKEN = peer_token(LAB_SECRET.encode())  # the lab's secret; loopback meshes have none and accept any
BASE_BLOCKS = 8


def _engine(delta_mib: float, delta_blocks: int) -> dict[str, Any]:
    per_token = int(delta_mib * 2**20 / (delta_blocks * BLOCK)) // 16 * 16
    pool = (BASE_BLOCKS + delta_blocks) * 2 + 8
    return {"kind": "sim", "slots": 1, "block_size": BLOCK, "cache_bytes": pool * per_token * BLOCK,
            "sim": {"kv_bytes_per_token": per_token, "kv_scale": 1.0, "prefill_tps": 2e6, "decode_tps": 1000.0}}


EXTRA = {"kvshare": {"replicate_min_tokens": 0, "persist_own": False, "fsync": "never"},
         "mesh": {"poll_interval_s": 0.2}}


def _turn(api: str, session: str, messages: list[dict[str, str]]) -> str:
    """A turn that runs on this very node (peer-forwarded), whatever placement would pick."""
    headers = {"X-Session-Id": session, "X-Kvmesh-Forwarded": "1", PEER_HEADER: _PEER_TOKEN}
    r = httpx.post(f"{api}/v1/chat/completions", headers=headers, timeout=120,
                   json={"model": "kvmesh-sim", "messages": messages, "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def _await_ready(ws_url: str, session: str, trigger: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Run trigger() and return the receiver's replica_ready event for this session."""
    # The peer token: with client keys set, the event stream wants a key, and the mesh's own token is one.
    with connect(ws_url, max_size=None, open_timeout=10, additional_headers={PEER_HEADER: _PEER_TOKEN}) as ws:
        ws.recv(timeout=10)  # the snapshot
        trigger()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if ev.get("replay"):
                continue
            if ev["type"] == "replica_ready" and ev["session"] == session:
                return ev
            if ev["type"] == "replica_refused" and ev["session"] == session:
                raise RuntimeError(f"replica refused: {ev['reason']} {ev.get('message')}")
    raise TimeoutError("no replica_ready")


# A round that fails (replica refused, no replica_ready in time, a turn or the raw send failing) is
# counted and the next one runs: the run reports what it measured and exits non-zero.
ROUND_ERRORS = (RuntimeError, TimeoutError, OSError, httpx.HTTPError, subprocess.SubprocessError)


def _measure(apis: dict[str, str], raw: Any, delta_blocks: int, repeat: int, rng: random.Random) -> dict[str, Any]:
    a, b = apis["a"], apis["b"]
    ws_b = b.replace("http://", "ws://") + "/v1/events"
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    for k in range(repeat):
        session = f"bench-transfer-{k}"
        try:
            # The base: BASE_BLOCKS blocks, replicated to b as a normal turn would.
            msgs = [{"role": "system", "content": text(rng, BASE_BLOCKS * BLOCK + 100)}]
            base = _await_ready(ws_b, session, lambda s=session, m=msgs: _turn(a, s, m))
            # The delta: the conversation grows by delta_blocks whole blocks.
            msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": text(rng, delta_blocks * BLOCK)}]
            ev = _await_ready(ws_b, session, lambda s=session, m=msgs: _turn(a, s, m))
            raw_s = raw(ev["bytes"])
        except ROUND_ERRORS as e:
            errors.append(f"round {k}: {type(e).__name__}: {e}")
            continue
        rounds.append({"bytes": ev["bytes"], "blocks": ev["blocks"], "recv_s": ev["recv_s"], "lag_s": ev["lag_s"],
                       "raw_s": raw_s, "base_blocks": base["blocks"]})
    return {"rounds": rounds, "errors": errors}


def median_index(values: list[float]) -> int:
    """Index of the median of `values` by value (not by position): with an even count, the lower of
    the two middle values, so the round reported is a real one and never the flattering pick."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def summarize(res: dict[str, Any], *, link: str, delta_blocks: int, block_bytes: int) -> dict[str, Any]:
    """The JSON result: the median round by kv_share/raw ratio, the worst ready lag and overhead, every round."""
    rounds, errors = res["rounds"], res["errors"]
    out: dict[str, Any] = {"link": link, "errors": len(errors), "error_samples": errors[:5]}
    if not rounds:
        return {**out, "rounds": []}
    kv = [8 * r["bytes"] / r["recv_s"] / 1e9 for r in rounds]
    raw = [8 * r["bytes"] / r["raw_s"] / 1e9 for r in rounds]
    ratios = [k / w for k, w in zip(kv, raw)]
    i = median_index(ratios)
    return {
        "bytes": rounds[i]["bytes"],
        "raw_tcp_gbps": round(raw[i], 3),
        "kvshare_gbps": round(kv[i], 3),
        "ratio": round(ratios[i], 3),
        "ready_after_last_byte_s": round(max(r["lag_s"] for r in rounds), 4),
        "sent_over_ideal": round(max(r["bytes"] for r in rounds) / (delta_blocks * block_bytes), 4),
        "delta_blocks": rounds[i]["blocks"],
        **out,
        "rounds": [{"kvshare_gbps": round(k, 3), "raw_tcp_gbps": round(w, 3), "lag_s": r["lag_s"]}
                   for k, w, r in zip(kv, raw, rounds)],
    }


def _on_loopback(work: Path, engine: dict[str, Any], delta_blocks: int, repeat: int,
                 rng: random.Random) -> dict[str, Any]:
    cfgs = mesh_configs(work, ["a", "b"], engine=engine, extra=EXTRA)
    nodes = [NodeProcess(n, p, work).start() for n, p in cfgs.items()]
    try:
        for n in nodes:
            n.wait_ready()
        wait_peers(nodes)
        apis = {n.name: n.api for n in nodes}
        return _measure(apis, lambda nb: rawtcp.measure(nb, [], [], "127.0.0.1"), delta_blocks, repeat, rng)
    finally:
        for n in nodes:
            n.stop()


def _on_shaped_link(link: str, work: Path, engine: dict[str, Any], delta_blocks: int, repeat: int,
                    rng: random.Random) -> dict[str, Any]:
    from kvmesh.node.lab.netlab.mesh import lab_api, lab_nodes
    from kvmesh.node.lab.netlab.netns import TwoHostLab, can_use_netns

    ok, why = can_use_netns()
    if not ok:
        raise SystemExit(f"--link {link}: {why}")
    with TwoHostLab(link) as lab:
        nodes = lab_nodes(lab, work, engine=engine, extra=EXTRA)
        try:
            for n in nodes:
                n.wait_ready()
            for n in nodes:
                n.info["api"] = lab_api(lab, n.name)
            wait_peers(nodes)
            a, b = lab.hosts
            apis = {"a": lab_api(lab, "host-a"), "b": lab_api(lab, "host-b")}
            return _measure(apis, lambda nb: rawtcp.measure(nb, b.exec_prefix(), a.exec_prefix(), b.data_ip),
                            delta_blocks, repeat, rng)
        finally:
            for n in nodes:
                n.stop()


def run_transfer(args: argparse.Namespace) -> int:
    """Measure, print the JSON result; non-zero exit when a round failed (or none completed)."""
    delta_blocks = 50
    engine = _engine(args.mib, delta_blocks)
    rng = random.Random(3)
    with tempfile.TemporaryDirectory(prefix="kvmesh-transfer-") as tmp:
        if args.link == "loopback":
            res = _on_loopback(Path(tmp), engine, delta_blocks, args.repeat, rng)
        else:
            res = _on_shaped_link(args.link, Path(tmp), engine, delta_blocks, args.repeat, rng)
    block_bytes = engine["sim"]["kv_bytes_per_token"] * BLOCK
    return emit(summarize(res, link=args.link, delta_blocks=delta_blocks, block_bytes=block_bytes), args)
