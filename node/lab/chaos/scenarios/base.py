"""What a scenario is, and the moves several scenarios share (a turn surely in flight, refusal counts).

A scenario is an async function of a started `Drill`: it injects one fault while turns are in
flight, heals it, and records in `d.fault` what was injected and whether it really happened
(`hit`), in `d.checks` what that fault is about, or `d.cannot_inject(reason)` when it cannot be
injected here. The runner checks the invariants common to every scenario afterwards.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmesh.node.lab.chaos.harness import Drill
from kvmesh.node.lab.chaos.turns import Conv, TurnResult

THROTTLE_BPS = 1.5e6  # slows a watched transfer to seconds, so a kill lands mid-stream
HOG_TOKENS = 100_000  # a turn whose prefill keeps the sim busy 5 s: a turn surely in flight on a host
TRANSFER_CHARS = 12_000  # a session big enough for a transfer of ~47 blocks


@dataclass
class Scenario:
    """One drill: its name, what it does, how it runs, and how its mesh differs from the default."""

    name: str
    about: str
    run: Callable[[Drill], Awaitable[None]]
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    faulted: str | None = None  # the host the fault hits (for the "keeps serving" report)
    setup: Callable[[Drill], Iterator[None]] | None = None  # context around the mesh (mounts)
    env: Callable[[Drill], dict[str, dict[str, str]]] | None = None  # extra environment per node


async def wait_event(ev: threading.Event, timeout: float) -> bool:
    """Wait for a proxy thread's event without a worker thread (Ctrl-C must not wait on one)."""
    deadline = time.monotonic() + timeout
    while not ev.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return ev.is_set()


async def hog(d: Drill, host: str, entry: str, seed: int) -> tuple[Conv, asyncio.Task[TurnResult], str]:
    """A session homed on `host`, whose next turn (through `entry`) spends HOG_TOKENS / prefill_tps
    seconds in prefill on `host`: a client's turn surely in flight there. Returns when it started."""
    conv = Conv(f"hog-{host}-{seed}", seed, 600)
    await d.turn(host, conv, pin=True, max_tokens=4, tool_chars=HOG_TOKENS)
    started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(d.turn(entry, conv, stream=True, max_tokens=8, started=started))
    async with asyncio.timeout(30.0):  # not wait_for: see node.mesh.statestream
        ran_on = await started
    return conv, task, ran_on


async def refusals(d: Drill, host: str, src: str) -> dict[str, int]:
    """Transfers from src that host refused, by reason (its kv_share stats)."""
    st = await d.get(host, "/v1/stats")
    return dict(st["kvshare"]["in"].get(src, {}).get("refused", {}))


def new_counts(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """The counts that grew from `before` to `after`, by how much."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
