"""Scenarios that break one kv_share transfer: a node killed mid-stream, a connection cut, a bit flipped.

A killed node: a big replica is migrated over a throttled link while a client's turn is in flight
on the victim, the victim is SIGKILLed once the transfer is under way, then restarted; the replica
must still be delivered whole afterwards and the session restored, not recomputed. A proxy fault:
the receiver must refuse the transfer and import none of it, the retry must land whole, and the
session's next turn must be warm.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from kvmesh.node.lab.chaos.harness import BLOCK, NAMES, Drill
from kvmesh.node.lab.chaos.proxy import Fault
from kvmesh.node.lab.chaos.scenarios.base import (
    THROTTLE_BPS,
    TRANSFER_CHARS,
    Scenario,
    hog,
    new_counts,
    refusals,
    wait_event,
)
from kvmesh.node.lab.chaos.turns import Conv, TurnResult

# A kill must land before the sender has written the whole replica into its kernel buffers
# (kvshare.socket_buffer_bytes, 4 MiB, doubled by Linux): what is written is delivered by the
# kernel after the process dies. 30k tokens is a ~12 MiB replica.
KILL_TRANSFER_CHARS = 30_000


async def _kill_mid_transfer(d: Drill, *, victim_role: Literal["receiver", "sender"]) -> None:
    src = "node-a"
    big = Conv(f"xfer-{d.seed}", d.seed, KILL_TRANSFER_CHARS)
    await d.turn(src, big, pin=True)
    dst = await d.target_without(big, src)
    victim = dst if victim_role == "receiver" else src
    entry = next(n for n in NAMES if n not in (src, dst))
    d.fault.update(sender=src, receiver=dst, killed=victim)
    # A client's turn in flight on the victim when it dies (placed there by the mesh via `entry`).
    hog_conv, hog_task, hog_host = await hog(d, victim, entry, d.seed + 1)
    d.fault["turn_in_flight_on_victim"] = hog_host == victim
    d.start_load([n for n in NAMES if n != victim])
    await asyncio.sleep(0.5)
    refused0, killed_at = await _kill_during_migrate(d, big, src, dst, victim, hog_task)
    hog_res = await hog_task
    d.fault["hog_turn"] = hog_res.brief()
    if not hog_res.ok and hog_host == victim:
        d.lost_on_faulted_host += 1
        # The client retries, as a client would; the conversation goes on elsewhere.
        retry = await d.turn(entry, hog_conv, max_tokens=8)
        d.fault["hog_retry"] = retry.brief()
    if victim_role == "sender":
        await _receiver_drops_torn_transfer(d, dst, src, refused0, killed_at)
    await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - killed_at)))
    await d.restart(victim)
    await _redeliver(d, big, src, dst, victim_role)


async def _kill_during_migrate(d: Drill, big: Conv, src: str, dst: str, victim: str,
                               hog_task: asyncio.Task[TurnResult]) -> tuple[dict[str, int], float]:
    """Migrate `big` over a throttled link and SIGKILL `victim` once the transfer is under way;
    returns the receiver's refusal counts before the kill, and when it happened (monotonic)."""
    watch = d.proxies[(src, dst)].arm(Fault("watch", big.session, at=0.05, rate_bps=THROTTLE_BPS))
    mig = asyncio.ensure_future(d.migrate(big.session, src, dst))
    hit = await wait_event(watch.fired, 20.0)
    mid_transfer, hog_running = hit and not mig.done(), not hog_task.done()  # before the kill changes them
    refused0 = await refusals(d, dst, src)
    await d.kill(victim)
    killed_at = time.monotonic()
    watch.rate_bps = None  # what the dead sender's kernel still holds now drains at once
    d.fault.update(hit=mid_transfer, transfer=dict(watch.info), hog_running_at_kill=hog_running)
    d.fault["migrate"] = await mig
    return refused0, killed_at


async def _receiver_drops_torn_transfer(d: Drill, dst: str, src: str, refused0: dict[str, int],
                                        killed_at: float) -> None:
    """The receiver must drop the torn transfer (and say so) once the stream ends."""
    while (got := await refusals(d, dst, src)) == refused0 and time.monotonic() - killed_at < 15.0:
        await asyncio.sleep(0.1)
    d.fault.update(receiver_refused=new_counts(got, refused0),
                   receiver_refused_after_s=round(time.monotonic() - killed_at, 2))
    d.checks["receiver_refused_the_torn_transfer"] = got != refused0


async def _redeliver(d: Drill, big: Conv, src: str, dst: str, victim_role: str) -> None:
    """Recovery: the replica can still be delivered whole. A migrate needs the session resident on
    the sender (after a crash its engine is empty; the load may have evicted it too): a turn there
    first brings it back from the engine or the store, not from a recompute."""
    again = await d.turn(src, big, pin=True)
    d.fault["sender_turn_after_restart" if victim_role == "sender" else "sender_turn_after"] = again.brief()
    d.checks["session_restored_on_sender_not_recomputed"] = again.ok and again.reused >= 0.9
    retry_mig = await d.migrate(big.session, src, dst)
    d.fault["migrate_retry"] = retry_mig
    d.checks["replica_delivered_after_restart"] = bool(retry_mig.get("ok"))
    await asyncio.sleep(2.0)


async def sc_receiver_killed(d: Drill) -> None:
    await _kill_mid_transfer(d, victim_role="receiver")


async def sc_sender_killed(d: Drill) -> None:
    await _kill_mid_transfer(d, victim_role="sender")


async def _proxy_fault(d: Drill, kind: Literal["cut", "flip"]) -> None:
    src = "node-a"
    big = Conv(f"xfer-{d.seed}", d.seed, TRANSFER_CHARS)
    await d.turn(src, big, pin=True)
    dst = await d.target_without(big, src)
    entry = next(n for n in NAMES if n not in (src, dst))
    d.fault.update(sender=src, receiver=dst)
    d.start_load(list(NAMES))
    await asyncio.sleep(1.5)
    before = await d.holding(dst, big.session)
    refused_before = await refusals(d, dst, src)
    f = d.proxies[(src, dst)].arm(Fault(kind, big.session, at=0.5))
    first = await d.migrate(big.session, src, dst)
    d.fault.update(hit=f.fired.is_set(), injected=dict(f.info), migrate=first, receiver_held_before=before)
    await asyncio.sleep(0.5)
    after = await d.holding(dst, big.session)
    new_refusals = new_counts(await refusals(d, dst, src), refused_before)
    d.fault.update(receiver_held_after=after, receiver_refused=new_refusals)
    d.checks["transfer_refused"] = not first.get("ok") and bool(new_refusals)
    if kind == "flip":
        d.checks["flip_caught_by_digest"] = "digest" in new_refusals
    d.checks["no_partial_import"] = after == before
    await _retry_lands_whole(d, big, src, dst, entry)


async def _retry_lands_whole(d: Drill, big: Conv, src: str, dst: str, entry: str) -> None:
    """After a refused transfer: the retry delivers the whole replica, and the next turn is warm."""
    retry: dict[str, Any] = await d.migrate(big.session, src, dst)
    full = await d.holding(src, big.session)
    got = await d.holding(dst, big.session)
    d.fault.update(migrate_retry=retry, sender_holds=full, receiver_holds=got)
    d.checks["retry_delivers_whole_replica"] = bool(retry.get("ok")) and got >= full // BLOCK * BLOCK > 0
    await d.quiesce(0.5, 10.0, session=big.session)
    nxt = await d.turn(entry, big)  # through placement: the session's home is now dst
    d.fault["next_turn"] = nxt.brief()
    d.checks["next_turn_warm"] = nxt.ok and nxt.reused >= 0.9
    await asyncio.sleep(1.5)


async def sc_connection_cut(d: Drill) -> None:
    await _proxy_fault(d, "cut")


async def sc_bit_flip(d: Drill) -> None:
    await _proxy_fault(d, "flip")


SCENARIOS = [
    Scenario("receiver-killed", "receiver node SIGKILLed mid-transfer (a turn in flight on it), then restarted",
             sc_receiver_killed),
    Scenario("sender-killed", "sender node SIGKILLed mid-transfer (a turn in flight on it), then restarted",
             sc_sender_killed),
    Scenario("connection-cut", "kv_share connection cut half-way through a replica (proxy)", sc_connection_cut),
    Scenario("bit-flip", "one bit of one block's payload flipped in transit (proxy)", sc_bit_flip),
]
