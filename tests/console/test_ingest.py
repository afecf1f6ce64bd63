"""The websocket ingest loop against a real (fake) node server on loopback: snapshot, replay, live, reconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from fake_node import FakeEventsServer
from kvm_helpers import T0, Clock, make_view

from kvmesh.console.ingest import Backoff, events_url, stream_node
from kvmesh.console.state import ConsoleState
from kvmesh.node.protocol import ClusterViewEvent, Handoff

pytestmark = pytest.mark.anyio


def handoff(seq: int, cls: str = "warm", ts: float | None = None) -> Handoff:
    return Handoff(ts=ts or T0 + seq, node="node-2", seq=seq, session="s-001", src="node-1", dst="node-2",
                   cls=cls, prompt_tokens=100, reused_tokens=95)  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[FakeEventsServer]:
    snaps = {"n": 6}

    def view() -> ClusterViewEvent:
        return make_view(n_sessions=snaps["n"])

    srv = FakeEventsServer(view)
    srv.snaps = snaps  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


async def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_events_url() -> None:
    """Node URLs map to their event stream: http->ws, https->wss, path /v1/events."""
    assert events_url("http://10.0.0.1:8000") == "ws://10.0.0.1:8000/v1/events"
    assert events_url("https://gpu-2.example/") == "wss://gpu-2.example/v1/events"
    assert events_url("127.0.0.1:8001") == "ws://127.0.0.1:8001/v1/events"


def test_backoff_grows_to_a_cap_and_resets() -> None:
    """Reconnect delays double up to the cap (with jitter) and start over after a good connection."""
    b = Backoff(initial=0.5, maximum=4.0, jitter=0.0)
    assert [b.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    b.reset()
    assert b.next() == 0.5


async def test_snapshot_replay_live_then_reconnect_rebuilds(server: FakeEventsServer) -> None:
    """Snapshot + replay + live over a real socket; a dropped socket reconnects, rebuilds and dedupes the replay."""
    url = f"http://127.0.0.1:{server.port}"
    server.ring.append(handoff(1))  # history from before the console connected
    state = ConsoleState(clock=Clock())
    task = asyncio.create_task(stream_node(url, state, backoff=Backoff(initial=0.05, maximum=0.2)))
    try:
        await wait_for(lambda: len(state.sessions) == 6 and any(e.replay for e in state.log))
        assert state.counters.warm == 50, "the replayed handoff is already in the snapshot"
        await wait_for(lambda: server.client_count == 1)
        server.publish(handoff(2, cls="cold"))
        await wait_for(lambda: state.counters.cold == 2)
        server.snaps["n"] = 3  # type: ignore[attr-defined]
        server.drop_clients()
        await wait_for(lambda: server.connections == 2 and len(state.sessions) == 3)
        assert state.nodes[url].connected and state.nodes[url].reconnects == 1
        assert state.counters.cold == 1, "rebuilt from the new snapshot, replay not re-applied"
        assert [e.seq for e in state.log if e.kind == "handoff"] == [1, 2], "replayed events are deduped"
        assert any("lost node-1" in e.text for e in state.log)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_node_down_stays_disconnected_then_recovers(server: FakeEventsServer) -> None:
    """While the node refuses, the stream stays DISCONNECTED (stale since the loss) and keeps retrying."""
    url = f"http://127.0.0.1:{server.port}"
    clock = Clock()
    state = ConsoleState(clock=clock)
    task = asyncio.create_task(stream_node(url, state, backoff=Backoff(initial=0.05, maximum=0.1)))
    try:
        await wait_for(lambda: len(state.sessions) == 6)
        lost_at = clock()
        server.refuse = True
        server.drop_clients()
        await wait_for(lambda: not state.nodes[url].connected)
        clock.advance(60)
        await asyncio.sleep(0.3)  # several refused retries
        assert state.host_state("node-1") == ("DISCONNECTED", "stale", lost_at)
        server.refuse = False
        await wait_for(lambda: state.host_state("node-1")[0] == "UP")
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
