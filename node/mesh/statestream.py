"""The asyncio shells around node.mesh.statefeed: pushing this host's state, subscribing to a peer's.

`push` runs one subscriber's side of `/v1/peer/state` on the serving host: a baseline, then the
delta since the last message every `interval_s` and as soon as something placement acts on
happens (nothing when nothing changed, a heartbeat every `heartbeat_s`), and a fresh baseline
whenever the subscriber says "resync". `subscribe` is the
other end, run by the PeerTable for each peer: it connects (websockets, the mesh's peer header),
applies each message to a `StateMirror`, hands each new status on, counts the bytes, and asks for
a baseline on a gap. A peer that cannot stream (an older node, a proxy without websockets) raises
`StreamRefused`, and the PeerTable polls it instead.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable, Callable

import websockets
from pydantic import ValidationError
from websockets.asyncio.client import connect

from kvmesh.node.mesh.statefeed import StateFeed, StateMirror, encode
from kvmesh.node.protocol import STATE_ADAPTER, PeerStatus

RESYNC = "resync"
MIN_GAP_S = 0.05  # a change's delta waits this long for the rest of its burst (at most 20 messages a second)
MAX_MESSAGE_BYTES = 64 << 20  # a baseline of a host holding many sessions


class StreamRefused(Exception):
    """The peer answered the upgrade with something other than a websocket (older node, 404, 403)."""


async def push(send: Callable[[str], Awaitable[None]], receive: Callable[[], Awaitable[str]],
               status: Callable[[], PeerStatus], feed: StateFeed, *, interval_s: float, heartbeat_s: float,
               wake: asyncio.Event | None = None, min_gap_s: float = MIN_GAP_S) -> None:
    """Stream `status()` to one subscriber until its connection ends (receive or send raises).

    A delta goes out every `interval_s` if anything changed, and `min_gap_s` after `wake` is set (a
    turn started or ended, a replica landed: what placement acts on), so the changes of a burst
    share one delta."""
    await send(encode(feed.baseline(status())))
    resync = asyncio.Event()
    wake = wake or asyncio.Event()

    async def reader() -> None:
        while True:
            if await receive() == RESYNC:
                resync.set()

    task = asyncio.create_task(reader())
    last = time.monotonic()
    try:
        while not task.done():
            waits = [asyncio.ensure_future(e.wait()) for e in (resync, wake)]
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if wake.is_set():
                # Let the burst settle (a turn's end is an event, its slot freed just after): one
                # delta with all of it, `min_gap_s` after the first change.
                await asyncio.sleep(min_gap_s)
                wake.clear()
            if task.done():
                break
            if resync.is_set():
                resync.clear()
                msg = encode(feed.baseline(status()))
            else:
                delta = feed.delta(status())
                if delta is None and time.monotonic() - last >= heartbeat_s:
                    delta = feed.heartbeat()
                msg = encode(delta) if delta else ""
            if msg:
                await send(msg)
                last = time.monotonic()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def frame_bytes(payload: int, *, masked: bool) -> int:
    """A websocket text frame's size on the wire (RFC 6455: 2-10 header bytes, +4 masked from a client)."""
    head = 2 if payload < 126 else 4 if payload < 65536 else 10
    return head + (4 if masked else 0) + payload


async def subscribe(url: str, headers: dict[str, str], verify: ssl.SSLContext | bool, *, silent_after_s: float,
                    on_status: Callable[[PeerStatus, StateMirror], None], count: Callable[[str, int], None]) -> None:
    """Mirror one peer's state until the stream breaks (returns or raises; the caller reconnects)."""
    ctx: ssl.SSLContext | None = None
    if url.startswith("wss:"):
        ctx = verify if isinstance(verify, ssl.SSLContext) else ssl.create_default_context()
        if verify is False:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        ws = await connect(url, additional_headers=headers, ssl=ctx, open_timeout=2.0, max_size=MAX_MESSAGE_BYTES,
                           compression=None, ping_interval=None)
    except websockets.InvalidStatus as e:
        raise StreamRefused(f"HTTP {e.response.status_code}") from None
    except websockets.InvalidHandshake as e:
        raise StreamRefused(type(e).__name__) from None
    mirror, awaiting = StateMirror(), False
    try:
        req, resp = ws.request, ws.response
        if req is not None and resp is not None:
            count("out", len(f"GET {req.path} HTTP/1.1") + 4 + sum(len(k) + len(v) + 4 for k, v in req.headers.raw_items()))
            count("in", len(f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}") + 4
                  + sum(len(k) + len(v) + 4 for k, v in resp.headers.raw_items()))
        while True:
            # Not asyncio.wait_for: on 3.11 it drops a cancel that arrives as the recv completes, and this
            # loop would then run on (a node's stop waited on it for good while heartbeats kept coming).
            async with asyncio.timeout(silent_after_s):
                raw = await ws.recv()
            count("in", frame_bytes(len(raw), masked=False))
            try:
                msg = STATE_ADAPTER.validate_json(raw)
            except ValidationError:
                return  # not our protocol: drop the stream, poll instead until the next try
            if mirror.apply(msg):
                awaiting = False
                if mirror.status is not None:
                    on_status(mirror.status, mirror)
            elif not awaiting:
                awaiting = True
                mirror.out_of_step()
                await ws.send(RESYNC)
                count("out", frame_bytes(len(RESYNC), masked=True))
    finally:
        await ws.close()
