"""Write-behind through the host-memory tier, on a real node (sim engine, 4 slots, a 52k-token pool, served
on 127.0.0.1 port 0): a conversation evicted from the pool while other conversations run at once is
restored whole before its next turn, however slow the disk; with kv_share off too (issue 31, item 3).

The node runs in this process, so a test can make its disk slow: `SlowDisk` holds every store write of a
session other than the main one until the test lets go, as a disk far behind a burst of turns would."""

from __future__ import annotations

import random
import string
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from kvmesh.node.config import NodeConfig
from kvmesh.node.kvshare.store.segment import SegmentWriter
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.lab.launcher import wait_for

MAIN, OTHER, MORE = 22_000, 14_000, 1_500  # the main's first prompt, each other conversation's, the main's growth
SIM = {"kv_scale": 0.02, "prefill_tps": 1e6, "decode_tps": 2000.0}


def node_config(**kvshare: Any) -> NodeConfig:
    return NodeConfig.model_validate({
        "name": "tier", "engine": {"kind": "sim", "slots": 4, "cache_tokens": 52_000, "queue_timeout_s": 60.0,
                                   "sim": SIM},
        "kvshare": {"fsync": "never", **kvshare}})


class SlowDisk:
    """Once `hold` is called, the store's writes of every session but those it names wait until `release`
    (or 60 s)."""

    def __init__(self, store: ReplicaStore) -> None:
        self.gate = threading.Event()
        self.through: set[str] | None = None  # None: nothing is held
        self.held = 0
        self._begin: Callable[..., SegmentWriter] = store.begin_write

        def begin_write(session: str, **kw: Any) -> SegmentWriter:
            if self.through is not None and session not in self.through:
                self.held += 1
                self.gate.wait(60)
            return self._begin(session, **kw)

        store.begin_write = begin_write  # type: ignore[method-assign]

    def hold(self, but: set[str]) -> None:
        self.through = but

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def slow_node(request: pytest.FixtureRequest) -> Iterator[tuple[ThreadedServer, SlowDisk]]:
    srv = serve_in_thread(node_config(**getattr(request, "param", {})))
    disk = SlowDisk(srv.node.kvshare.store)
    try:
        yield srv, disk
    finally:
        disk.release()
        srv.stop()


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


def turn(http: httpx.Client, srv: ThreadedServer, session: str, prompt: str) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one completion turn of `session`."""
    r = http.post(srv.v1 + "/completions", headers={"X-Session-Id": session},
                  json={"model": srv.model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def stored_tokens(srv: ThreadedServer) -> int:
    store = srv.node.kvshare.store
    return sum(m.num_tokens for s in store.sessions() if (m := store.manifest(s)) is not None)


def scenario(srv: ThreadedServer, disk: SlowDisk, *, main_stored: bool) -> tuple[float, int]:
    """The main's first turn (on disk first when `main_stored`), three other conversations at once, the
    main's next turn: the fraction of its prompt it reused, and how many of its tokens the engine still held
    before that turn (an eviction may leave a leading part)."""
    rng = random.Random(31)
    main = text(rng, MAIN)
    store = srv.node.kvshare.store
    with httpx.Client(timeout=120) as http:
        if not main_stored:
            disk.hold(but=set())
        turn(http, srv, "main", main)
        if main_stored:
            wait_for(lambda: stored_tokens(srv) >= MAIN // 256 * 256, "the main conversation to be on disk")
            disk.hold(but=set(store.sessions()))
        others = [text(rng, OTHER) for _ in range(3)]
        with ThreadPoolExecutor(3) as pool:
            for prompt_tokens, _ in pool.map(lambda i: turn(http, srv, f"other-{i}", others[i]), range(3)):
                assert prompt_tokens > OTHER
        wait_for(lambda: disk.held, "the store's disk thread to be held")  # the others' copies queue behind it
        resident = srv.node.engine.resident_tokens("main")
        prompt, cached = turn(http, srv, "main", main + text(rng, MORE))
    return cached / prompt, resident


def test_a_conversation_evicted_by_concurrent_turns_is_restored_while_their_writes_wait_on_the_disk(
        slow_node: tuple[ThreadedServer, SlowDisk]) -> None:
    """The store holds the main conversation; three others at once evict it from the pool and their store
    copies queue on a slow disk; its next turn restores >= 0.9 of its prompt (the write-behinds let go of the
    pool once their blocks are in host memory, so the restore finds room)."""
    srv, disk = slow_node
    reuse, _ = scenario(srv, disk, main_stored=True)
    assert reuse >= 0.9, f"the main's next turn reused {reuse:.3f} of its prompt"
    assert srv.node.engine.counters.evicted_sessions >= 1


@pytest.mark.parametrize("slow_node", [{"enabled": False}], indirect=True)
def test_with_kv_share_off_the_memory_tier_alone_restores_an_evicted_conversation(
        slow_node: tuple[ThreadedServer, SlowDisk]) -> None:
    """kv_share off and nothing on disk yet: the main conversation, evicted by three others at once, comes
    back from the host-memory tier (>= 0.9 of its next prompt)."""
    srv, disk = slow_node
    reuse, resident = scenario(srv, disk, main_stored=False)
    assert stored_tokens(srv) == 0
    assert reuse >= 0.9, f"the main's next turn reused {reuse:.3f} of its prompt"
    # The eviction may leave the main's leading blocks in the engine: the tier brings back every block it took.
    assert resident < MAIN // 256 * 256, "the main conversation was not evicted"
    assert srv.node.kvshare.tier.hits >= MAIN // 256 - resident // 256


@pytest.mark.parametrize("slow_node", [{"host_tier_bytes": 10 * 256 * 400}], indirect=True)
def test_a_tier_too_small_for_a_write_behind_stages_what_fits_and_the_store_copy_is_whole(
        slow_node: tuple[ThreadedServer, SlowDisk]) -> None:
    """A 10-block tier takes the first 10 blocks of an 85-block write-behind; the rest are written from the
    pool, and the store's copy holds every block."""
    srv, _ = slow_node
    with httpx.Client(timeout=120) as http:
        turn(http, srv, "main", text(random.Random(1), MAIN))
    wait_for(lambda: stored_tokens(srv) == MAIN // 256 * 256, "the whole conversation to be on disk")
    tier = srv.node.kvshare.tier
    wait_for(lambda: tier.stats()["pinned_blocks"] == 0, "the tier's blocks to be let go")
    assert tier.stats()["staged"] == 10


def test_a_restore_into_a_pool_that_running_turns_hold_brings_back_what_fits(
        slow_node: tuple[ThreadedServer, SlowDisk]) -> None:
    """Three conversations' turns run and hold most of the pool while the evicted main conversation's next
    turn starts: it restores the leading blocks there is room for, not nothing."""
    srv, _ = slow_node
    rng = random.Random(7)
    main, others = text(rng, MAIN), [text(rng, OTHER) for _ in range(3)]
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(3) as pool:
        turn(http, srv, "main", main)
        list(pool.map(lambda i: turn(http, srv, f"busy-{i}", others[i]), range(3)))  # the main is evicted

        def long_turn(i: int) -> None:  # each holds its 14k cached tokens' blocks while it decodes
            r = http.post(srv.v1 + "/completions", headers={"X-Session-Id": f"busy-{i}"},
                          json={"model": srv.model, "prompt": others[i] + " more", "max_tokens": 4000,
                                "ignore_eos": True})
            assert r.status_code == 200, r.text

        busy = [pool.submit(long_turn, i) for i in range(3)]
        wait_for(lambda: srv.node.engine.slots.busy == 3, "the three long turns to run")
        prompt, cached = turn(http, srv, "main", main + text(rng, MORE))
        assert srv.node.engine.slots.busy >= 3, "the long turns ended before the main's restore"
        for f in busy:
            f.result()
    assert 0.3 <= cached / prompt < 0.9, (cached, prompt)
