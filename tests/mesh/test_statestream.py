"""The state stream's subscriber (node.mesh.statestream.subscribe) ends when cancelled, even while messages keep coming."""

from __future__ import annotations

import asyncio
import random

from websockets.asyncio.server import ServerConnection, serve

from kvmesh.node.mesh.statefeed import StateFeed, StateMirror, encode
from kvmesh.node.mesh.statestream import subscribe
from kvmesh.node.protocol import HostInfo, PeerStatus


def test_a_subscriber_cancelled_while_messages_arrive_ends() -> None:
    """Cancelled at random moments of a stream that never pauses, the subscriber ends every time (a cancel
    that lands as a recv completes is not dropped: the node's stop once waited on such a task for good)."""

    async def main() -> list[int]:
        message = encode(StateFeed(epoch=1.0).baseline(PeerStatus(host=HostInfo(name="b", slots=2))))

        open_streams: set[ServerConnection] = set()

        async def flood(ws: ServerConnection) -> None:
            open_streams.add(ws)
            try:
                while True:
                    await ws.send(message)
                    await asyncio.sleep(0)
            finally:
                open_streams.discard(ws)

        rng, lingered = random.Random(3), []
        async with serve(flood, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            for attempt in range(60):
                seen = asyncio.Event()

                def on_status(_: PeerStatus, __: StateMirror) -> None:
                    seen.set()

                task = asyncio.create_task(subscribe(f"ws://127.0.0.1:{port}/", {}, True, silent_after_s=30.0,
                                                     on_status=on_status, count=lambda direction, n: None))
                await seen.wait()
                for _ in range(rng.randrange(1, 40)):  # a random point in the flood
                    await asyncio.sleep(0)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=5.0)
                if not done:  # closed from the server's end, so that a failure fails rather than hangs
                    lingered.append(attempt)
                    for ws in list(open_streams):
                        await ws.close()
                    await asyncio.gather(task, return_exceptions=True)
                    break
        return lingered

    assert asyncio.run(main()) == []
