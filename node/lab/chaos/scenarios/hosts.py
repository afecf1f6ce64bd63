"""Scenarios that break a host rather than a transfer: a full disk, a frozen peer, an engine that
drops every cache at once, a restart with replicas on disk.

Each checks what its fault is about: a host with a full store still serves; a frozen peer is
routed around once stale and serves again after; an evicted session comes back from the host's
own store, also while a slow push pins pool blocks; replicas survive a restart and the sessions'
next turns are warm from disk.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from kvmesh.node.lab.chaos.cleanup import CLEANUP
from kvmesh.node.lab.chaos.harness import BLOCK, NAMES, POLL_S, STALE_S, Drill
from kvmesh.node.lab.chaos.proxy import Fault
from kvmesh.node.lab.chaos.scenarios.base import THROTTLE_BPS, TRANSFER_CHARS, Scenario
from kvmesh.node.lab.chaos.turns import Conv

DISK_VICTIM = "node-b"
DISK_TMPFS_BYTES = 8 << 20
DISK_BUDGET_BYTES = 6 << 20


def _disk_setup(d: Drill) -> Iterator[None]:
    """As root: an 8 MiB tmpfs on the receiver's store dir (real ENOSPC); else a tiny byte budget."""
    mnt = d.stores[DISK_VICTIM]
    mnt.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount"):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_TMPFS_BYTES}", "tmpfs", str(mnt)],
                           check=False, capture_output=True, text=True)
        mounted = r.returncode == 0
        if not mounted:
            d.notes.append(f"tmpfs mount refused ({r.stderr.strip()[:120]}); used a store byte budget instead")
    undo = None
    if mounted:
        undo = CLEANUP.push(f"tmpfs on {mnt}", lambda: _umount(mnt))
        d.fault["mode"] = f"tmpfs of {DISK_TMPFS_BYTES >> 20} MiB on {DISK_VICTIM}'s store (ENOSPC)"
    else:
        d.overrides.setdefault(DISK_VICTIM, {}).setdefault("kvshare", {})["store_budget_bytes"] = DISK_BUDGET_BYTES
        d.fault["mode"] = f"store_budget_bytes {DISK_BUDGET_BYTES} on {DISK_VICTIM} (not root: LRU eviction, no ENOSPC)"
    d.fault["tmpfs"] = mounted
    try:
        yield
    finally:
        if undo is not None:
            CLEANUP.discard(undo)
            _umount(mnt)


def _umount(mnt: Path) -> None:
    for args in (["umount", str(mnt)], ["umount", "-l", str(mnt)]):
        if subprocess.run(args, check=False, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)


async def sc_disk_full(d: Drill) -> None:
    v = DISK_VICTIM
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    # Two big replicas pushed into the victim on top of the load's own: > 8 MiB in all.
    moved = []
    for k, src in enumerate(("node-a", "node-c")):
        big = Conv(f"fill-{k}-{d.seed}", d.seed + k, TRANSFER_CHARS)
        await d.turn(src, big, pin=True)
        moved.append((big, src, await d.migrate(big.session, src, v)))
    d.fault["migrations"] = [m[2] for m in moved]
    await asyncio.sleep(2.0)
    enospc = d.store_log_hits(v, "No space left on device")
    st = (await d.get(v, "/v1/stats"))["kvshare"]
    d.fault.update(enospc_log_lines=enospc, store_bytes=st["store_bytes"], store_evictions=st["store_evictions"])
    if d.fault["tmpfs"]:
        du = shutil.disk_usage(d.stores[v])
        d.fault["fs_used_pct"] = round(100 * du.used / du.total, 1)
        d.fault["hit"] = enospc > 0
    else:
        d.fault["hit"] = st["store_evictions"] > 0
    # With its store full, the victim still serves the sessions it holds, and new ones.
    for big, _src, _r in moved:
        t = await d.turn(v, big, pin=True)
        d.fault.setdefault("turns_on_full_host", []).append(t.brief())
    fresh = Conv(f"fresh-{d.seed}", d.seed + 7, 3000)
    d.fault["new_session_on_full_host"] = (await d.turn(v, fresh, pin=True)).brief()
    await asyncio.sleep(1.5)


async def sc_peer_unreachable(d: Drill) -> None:
    v = "node-c"
    homed = [Conv(f"homed-{k}-{d.seed}", d.seed + k, 5000) for k in range(2)]
    for c in homed:
        await d.turn(v, c, pin=True)
    await d.quiesce(0.5, 15.0)
    d.start_load(["node-a", "node-b"])
    await asyncio.sleep(1.5)
    stop_s = 6.0
    d.signal(v, signal.SIGSTOP)
    t0 = time.monotonic()
    d.fault["stopped"] = v
    try:
        # At once: the entries still believe the peer is up and may forward into the frozen host.
        early = asyncio.ensure_future(d.turn("node-a", homed[0], stream=True))
        await asyncio.sleep(STALE_S + 2 * POLL_S + 0.5)
        seen = await d.get("node-a", "/v1/cluster")
        d.fault["marked_unreachable"] = not next(h for h in seen["hosts"] if h["name"] == v)["reachable"]
        late = await d.turn("node-b", homed[1], stream=True)  # after stale_after: placed elsewhere
        d.fault["late_turn"] = late.brief()
        d.checks["turn_after_stale_routed_around"] = late.ok and late.host != v and late.seconds < stop_s / 2
        await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
    finally:
        d.signal(v, signal.SIGCONT)
    d.fault["stopped_s"] = round(time.monotonic() - t0, 2)
    d.fault["hit"] = bool(d.fault["marked_unreachable"])
    res = await early
    d.fault["early_turn"] = res.brief()
    await d.wait_reachable()
    await asyncio.sleep(2.0)


EVICT_VICTIM = "node-b"
# 163 blocks of 100 KiB (~41.7k tokens): room for two running load turns (<= 55 blocks each)
# plus the 32-block restore, so a restore that finds no room is the engine's fault, not the pool's.
EVICT_CACHE_BYTES = 16 << 20
EVICT_FLOOD_CHARS = 44_000  # a prompt bigger than the whole pool


async def sc_evict_all(d: Drill) -> None:
    v = EVICT_VICTIM
    keep = [Conv(f"resident{k}-{d.seed}", d.seed + k, 8000) for k in range(2)]
    for c in keep:
        await d.turn(v, c, pin=True)
    await d.quiesce(0.5, 15.0)
    d.start_load(list(NAMES))
    await asyncio.sleep(2.0)
    st = await d.get(v, "/v1/peer/status", peer=True)
    before = {s["session"] for s in st["sessions"] if s["resident_tokens"] > 0}
    # One turn whose prompt is bigger than the whole pool: the engine drops every idle cache at
    # once. Its replica then goes to a peer over a slow link (as 1 Gb/s would be), so the push
    # holds the pool's blocks (Engine.export) for seconds, as it would in the field.
    flood = Conv(f"flood-{d.seed}", d.seed + 3, EVICT_FLOOD_CHARS)
    slow = [d.proxies[(v, n)].arm(Fault("watch", flood.session, at=0.9, rate_bps=8 * THROTTLE_BPS))
            for n in NAMES if n != v]
    fl = await d.turn(v, flood, pin=True, max_tokens=4)
    st = await d.get(v, "/v1/peer/status", peer=True)
    after = {s["session"] for s in st["sessions"] if s["resident_tokens"] > 0} - {flood.session}
    d.fault.update(flood_turn=fl.brief(), resident_before=len(before), still_resident=sorted(before & after),
                   evicted=len(before - after))
    # Running turns keep their blocks (at most one per slot); every idle cache must be gone.
    d.fault["hit"] = bool(before) and not any(c.session in after for c in keep) and len(before & after) <= 2
    # Restores from this host's own store: one while the flood's replica is still on the wire ...
    # (the push may still be queued behind the load's own pushes: it is given a few seconds to start)
    for _ in range(50):
        if pushing := any(px.active() for px in (d.proxies[(v, n)] for n in NAMES if n != v)):
            break
        await asyncio.sleep(0.1)
    e0 = (await d.get(v, "/v1/stats"))["engine"]
    during = await d.turn(v, keep[0], pin=True)
    e1 = (await d.get(v, "/v1/stats"))["engine"]
    d.fault["restore_while_pushing"] = {**during.brief(), "push_in_flight": pushing,
                                        "imported_blocks": e1["imported_blocks"] - e0["imported_blocks"]}
    d.checks["restored_from_store_while_a_push_is_in_flight"] = during.ok and during.reused >= 0.9
    # ... and one once kv_share is idle.
    for f in slow:
        f.rate_bps = None
    await d.quiesce(0.3, 20.0, session=flood.session)  # the load keeps other links busy
    later = await d.turn(v, keep[1], pin=True)
    d.fault["restore_when_idle"] = later.brief()
    d.checks["restored_from_store_when_idle"] = later.ok and later.reused >= 0.9
    await asyncio.sleep(2.0)
    c = (await d.get("node-a", "/v1/cluster"))["counters"]
    d.fault["handoffs"] = c
    d.checks["no_stale_state_cold_handoff"] = c["stale_state_cold"] == 0


async def sc_restart_with_replicas(d: Drill) -> None:
    v = "node-c"
    own = Conv(f"own-{d.seed}", d.seed, 8000)
    await d.turn(v, own, pin=True)
    got = Conv(f"got-{d.seed}", d.seed + 1, 8000)
    await d.turn("node-a", got, pin=True)
    await d.quiesce(0.5, 15.0)
    d.fault["received_replica"] = await d.migrate(got.session, "node-a", v)
    await d.quiesce(0.5, 15.0)
    before = {c.session: await d.holding(v, c.session) for c in (own, got)}
    d.start_load(["node-a", "node-b"])
    await asyncio.sleep(2.0)
    t0 = time.monotonic()
    await d.restart(v, clean=True)
    d.fault.update(restarted=v, restart_s=round(time.monotonic() - t0, 2), held_before=before)
    st = await d.get(v, "/v1/peer/status", peer=True)
    after = {s["session"]: s["store_tokens"] for s in st["sessions"] if s["session"] in before}
    d.fault["store_after_restart"] = after
    d.fault["hit"] = all(before.values())
    d.checks["replicas_survive_restart"] = all(after.get(s, 0) >= before[s] // BLOCK * BLOCK > 0 for s in before)
    for c in (own, got):
        t = await d.turn(v, c, pin=True)
        d.fault[f"turn_after_restart:{c.session}"] = t.brief()
        d.checks[f"warm_from_disk:{c.session.split('-')[0]}"] = t.ok and t.reused >= 0.9
    await asyncio.sleep(2.0)



SCENARIOS = [
    Scenario("disk-full", "receiver's replica store on a full filesystem (8 MiB tmpfs; byte budget if not root)",
             sc_disk_full, faulted=DISK_VICTIM, setup=_disk_setup),
    Scenario("peer-unreachable", "a host with sessions homed on it SIGSTOPped for 6 s (API answers nothing), then SIGCONT",
             sc_peer_unreachable, faulted="node-c"),
    Scenario("evict-all", "one host's engine drops every idle cache at once (tiny pool, one pool-sized turn)",
             sc_evict_all, overrides={EVICT_VICTIM: {"engine": {"cache_bytes": EVICT_CACHE_BYTES}}}, faulted=EVICT_VICTIM),
    Scenario("restart-with-replicas", "a host restarted (SIGTERM) with its own and received replicas on disk",
             sc_restart_with_replicas, faulted="node-c"),
]
