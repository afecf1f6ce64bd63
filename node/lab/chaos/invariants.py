"""The invariants every scenario is judged on, after its fault was injected and healed.

- failed turns: the load generator's error count and non-200 statuses plus the drill's own
  turns. A turn may be slower or cold, never lost.
- corrupt or partial replicas: every store re-read by `verify.verify_store` once the nodes stop.
- identical output: every answered turn replayed on a reference node that never fails.
- leaked temp files: none once kv_share is idle (live), and none after a clean stop.
- serving afterwards: a turn pinned on each node, and one through each node as the entry.
- the fault itself: it really happened (`hit`), and what it is about held (`checks`). A fault
  that could not be injected (`not_run`) makes the scenario "not_run": nothing was tested.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvmesh.node.lab.chaos.harness import NAMES, Drill
from kvmesh.node.lab.chaos.turns import MODEL, Conv, Pair
from kvmesh.node.lab.chaos.verify import StoreReport

Status = Literal["passed", "failed", "not_run"]


@dataclass
class Observed:
    """What the runner measured around one scenario, beyond what the drill recorded itself."""

    failures: list[str] = field(default_factory=list)  # the drill broke, the load did not stop, ...
    stores: list[StoreReport] = field(default_factory=list)
    live_temp: dict[str, list[str]] = field(default_factory=dict)
    serving: dict[str, Any] = field(default_factory=dict)
    compared: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

async def serving_after(d: Drill) -> dict[str, Any]:
    """Every node answers a turn pinned on it and a turn it places as the entry."""
    out: dict[str, Any] = {}
    for k, n in enumerate(NAMES):
        pinned = await d.turn(n, Conv(f"alive-pin-{n}-{d.seed}", d.seed * 31 + k, 1500), pin=True, max_tokens=8)
        entry = await d.turn(n, Conv(f"alive-entry-{n}-{d.seed}", d.seed * 37 + k, 1500), max_tokens=8,
                             temperature=0.8, seed=d.seed + k)
        out[n] = {"pinned": pinned.ok, "as_entry": entry.ok, "entry_served_by": entry.host}
    return out


async def replay(ref_api: str, pairs: list[Pair], http: httpx.AsyncClient) -> tuple[int, list[dict[str, Any]]]:
    """Replay every answered turn on the reference node; returns (compared, mismatches)."""
    sem = asyncio.Semaphore(8)
    mismatches: list[dict[str, Any]] = []

    async def one(p: Pair) -> None:
        body: dict[str, Any] = {"model": MODEL, "messages": p.messages, "max_tokens": p.max_tokens,
                                "temperature": p.temperature, "stream": False}
        if p.seed is not None:
            body["seed"] = p.seed
        async with sem:
            r = await http.post(f"{ref_api}/v1/chat/completions", json=body, headers={"X-Session-Id": p.session},
                                timeout=120.0)
        r.raise_for_status()
        obj = r.json()
        want = obj["choices"][0]["message"]["content"] or ""
        tokens = int(obj["usage"]["prompt_tokens"])
        if want != p.reply or (p.prompt_tokens is not None and tokens != p.prompt_tokens):
            mismatches.append({"source": p.source, "session": p.session, "turn_messages": len(p.messages),
                               "got": p.reply[:60], "reference": want[:60], "prompt_tokens": p.prompt_tokens,
                               "reference_prompt_tokens": tokens})

    await asyncio.gather(*(one(p) for p in pairs))
    return len(pairs), mismatches


def node_tracebacks(d: Drill) -> dict[str, int]:
    """Tracebacks in each node's log, by node (reported, not judged: a refused transfer may log one)."""
    out = {}
    for n, p in d.nodes.items():
        try:
            log = p.log_file.read_text(errors="replace")
        except FileNotFoundError:
            continue
        k = log.count("Traceback")
        if k:
            out[n] = k
    return out




def _turn_figures(d: Drill) -> dict[str, Any]:
    st = d.load.stats if d.load is not None else None
    load_errors = st.errors if st else 0
    return {
        "load": st.turns if st else 0, "load_errors": load_errors,
        "load_non_200": sum(v for k, v in st.status.items() if k != "200") if st else 0,
        "load_5xx": sum(v for k, v in st.status.items() if k.startswith("5")) if st else 0,
        "load_status": dict(st.status) if st else {}, "load_handoffs": dict(st.handoffs) if st else {},
        "drill": d.probe_turns, "drill_failed": len(d.probe_failures),
        "latency_p99_s": st.summary()["latency_p99_s"] if st else None,
        "error_samples": ((st.error_samples[:4] if st else []) + d.probe_failures[:4])[:6],
    }


def _breaches(d: Drill, obs: Observed, turns: dict[str, Any]) -> list[str]:
    """Every invariant the scenario broke, in words; the fault's own miss last."""
    out = list(obs.failures)
    failed_turns = turns["load_errors"] + len(d.probe_failures)
    corrupt = sum(len(s.corrupt) for s in obs.stores)
    leaked = sum(len(s.leaked) for s in obs.stores) + sum(len(v) for v in obs.live_temp.values())
    if failed_turns:
        out.append(f"{failed_turns} client turns failed ({turns['load_errors']} load, {len(d.probe_failures)} drill)")
    if turns["load_5xx"] + d.probe_5xx:
        out.append(f"{turns['load_5xx'] + d.probe_5xx} turns got a 5xx")
    if corrupt:
        out.append(f"{corrupt} corrupt or partial replicas committed")
    if obs.mismatches:
        out.append(f"{len(obs.mismatches)} of {obs.compared} replies differ from the reference node's")
    if leaked:
        out.append(f"{leaked} leaked temp or orphan files in stores")
    if not (obs.serving and all(v["pinned"] and v["as_entry"] for v in obs.serving.values())):
        out.append("a node did not serve turns after the fault")
    out += [f"check failed: {k}" for k, ok in d.checks.items() if not ok]
    if not d.not_run and not d.fault.get("hit"):
        out.append("the fault was not injected as planned (nothing was tested)")
    return out


def status_of(failures: list[str], not_run: str | None) -> Status:
    """A breach fails the scenario; else a fault that could not be injected is "not_run"; else "passed"."""
    return "failed" if failures else "not_run" if not_run else "passed"


def judge(d: Drill, name: str, about: str, obs: Observed) -> dict[str, Any]:
    """The scenario's details: status, every breach, and the figures behind each invariant."""
    turns = _turn_figures(d)
    failures = _breaches(d, obs, turns)
    status = status_of(failures, d.not_run)
    leaked = ([f"{s.host}: {x}" for s in obs.stores for x in s.leaked]
              + [f"{n} (live): {x}" for n, v in obs.live_temp.items() for x in v])
    serving_ok = bool(obs.serving) and all(v["pinned"] and v["as_entry"] for v in obs.serving.values())
    return {
        "name": name, "about": about, "status": status, "passed": status == "passed", "not_run": d.not_run,
        "seconds": round(obs.seconds, 1), "failures": failures,
        "failed_turns": turns["load_errors"] + len(d.probe_failures), "http_5xx": turns["load_5xx"] + d.probe_5xx,
        "corrupt_imports": sum(len(s.corrupt) for s in obs.stores), "lost_on_faulted_host": d.lost_on_faulted_host,
        "turns": {k: v for k, v in turns.items() if k not in ("load_5xx", "error_samples")},
        "error_samples": turns["error_samples"],
        "outputs_compared": obs.compared, "output_mismatches": obs.mismatches[:3],
        "replicas_checked": sum(s.replicas for s in obs.stores), "blocks_rehashed": sum(s.blocks for s in obs.stores),
        "corrupt": [c for s in obs.stores for c in s.corrupt][:5],
        "leaked_temp_files": len(leaked), "leaked": leaked[:6],
        "serving_after": serving_ok, "serving": obs.serving, "checks": d.checks, "fault": d.fault,
        "node_tracebacks": node_tracebacks(d), "notes": d.notes,
    }
