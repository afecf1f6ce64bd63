"""Bulk byte work of kv_share stays off the node's event loop.

Each test runs a node in-process (`serve_in_thread`) over a store that already
holds a large replica written before the node started (so its payload digests
are checked again), makes the node move those bytes (an import before a turn,
a replica landing in the engine, a replica landing in the store only with
fsync), and meanwhile measures how late a 2 ms timer on the node's loop runs.
Lateness is compared with the operation's own duration: before this change
the loop was blocked for most of it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np
import pytest

from kvmesh.node.config import EngineConfig, KVShareConfig, NodeConfig
from kvmesh.node.engine.hashing import block_hashes, chain_seed, payload_digest
from kvmesh.node.engine.simkv import fill_block
from kvmesh.node.kvshare import common, service, wire
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

from .service_helpers import BLOCK, EngineFacts, engine_facts, hand_offer, hand_send

T = TypeVar("T")
MIB = 1 << 20
HELD_BLOCKS = 384  # 384 MiB held in the store: seconds of loop time before this change on this box
SIM = {"kv_scale": 0.8, "prefill_tps": 1e6, "decode_tps": 1000.0}  # 16 KiB/token: 1 MiB blocks of 64 tokens
TICK_S = 0.002


def engine_cfg(cache_bytes: int) -> dict[str, Any]:
    return {"kind": "sim", "slots": 2, "cache_bytes": cache_bytes, "block_size": BLOCK, "sim": dict(SIM)}


def conversation(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=blocks * BLOCK, dtype=np.int32)


def write_replica(root: Path, facts: EngineFacts, session: str, tokens: np.ndarray) -> None:
    """A replica on disk, as a node that ran the session would have stored it (sim KV bytes)."""
    hashes = block_hashes(chain_seed(facts.fingerprint), tokens, BLOCK)
    store = ReplicaStore(root, 4 << 30, fsync="never")
    buf = memoryview(bytearray(facts.block_bytes))
    with store.begin_write(session, fingerprint=facts.fingerprint, block_size=BLOCK, block_bytes=facts.block_bytes,
                           tokens=tokens, hashes=hashes, first_block=0, generation=1) as w:
        kvpt = facts.block_bytes // BLOCK
        for i in range(len(hashes)):
            prev = hashes[i - 1] if i else chain_seed(facts.fingerprint)
            fill_block(buf, prev, tokens[i * BLOCK : (i + 1) * BLOCK], kvpt, BLOCK)
            w.write_block(i, buf, payload_digest(buf))
        w.commit()
    store.close()


@dataclass
class Setup:
    srv: ThreadedServer
    facts: EngineFacts
    held: np.ndarray  # tokens of the replica the store held at start

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self.srv.node.kvshare._loop
        assert loop is not None
        return loop

    def on_loop(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Any]:
    started: list[ThreadedServer] = []

    def make(*, cache_bytes: int, fsync: str = "never", session: str = "big") -> Setup:
        engine = engine_cfg(cache_bytes)
        facts = engine_facts(engine)
        held = conversation(HELD_BLOCKS, seed=1)
        write_replica(tmp_path / "store", facts, session, held)
        cfg = NodeConfig(name="loopfree", engine=EngineConfig.model_validate(engine),
                         kvshare=KVShareConfig(store_dir=str(tmp_path / "store"), fsync=fsync))  # type: ignore[arg-type]
        srv = serve_in_thread(cfg)
        started.append(srv)
        return Setup(srv, facts, held)

    yield make
    for srv in started:
        srv.stop()


class LoopProbe:
    """A 2 ms timer on the node's loop, run while the block runs; `worst` is its largest lateness (s)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lags: list[float] = []
        self._stop = threading.Event()
        self._fut: Any = None

    async def _tick(self) -> None:
        while not self._stop.is_set():
            t = self.loop.time()
            await asyncio.sleep(TICK_S)
            self.lags.append(self.loop.time() - t - TICK_S)

    def __enter__(self) -> Self:
        self._fut = asyncio.run_coroutine_threadsafe(self._tick(), self.loop)
        while not self.lags:  # ticking before the work starts
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._fut.result(30)

    @property
    def worst(self) -> float:
        return max(self.lags)


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def test_import_before_a_turn_leaves_the_loop_free(make_node: Any) -> None:
    """While ensure_imported copies and digests a 384 MiB stored replica, a timer on the loop is never held up long."""
    s = make_node(cache_bytes=(HELD_BLOCKS + 16) * MIB)
    kv = s.srv.node.kvshare
    with LoopProbe(s.loop) as probe:
        tokens, secs = timed(lambda: s.on_loop(kv.ensure_imported("big", s.held)))
    assert tokens == len(s.held)

    async def held() -> int:
        return s.srv.node.engine.cached_prefix("big", s.held)

    assert s.on_loop(held()) == len(s.held)
    assert probe.worst < secs / 4, f"the loop waited {probe.worst:.3f}s during a {secs:.3f}s import"


def test_replica_landing_in_the_engine_leaves_the_loop_free(make_node: Any) -> None:
    """A delta on top of a stored replica: filling the engine from the store (digests, copies) happens off the loop."""
    s = make_node(cache_bytes=(HELD_BLOCKS + 32) * MIB)
    grown = np.concatenate([s.held, conversation(4, seed=2)])
    ho = hand_offer(s.facts, "big", grown)
    with LoopProbe(s.loop) as probe:
        reply, secs = timed(lambda: hand_send(s.srv.node.kvshare.address, service.DEV_SECRET, ho))
    assert isinstance(reply, wire.Completed) and reply.tokens == len(grown)

    async def held() -> int:
        return s.srv.node.engine.cached_prefix("big", grown)

    assert s.on_loop(held()) == len(grown)
    assert probe.worst < secs / 4, f"the loop waited {probe.worst:.3f}s during a {secs:.3f}s transfer"


def test_replica_landing_in_the_store_leaves_the_loop_free(make_node: Any) -> None:
    """No room in the engine: the store write carries the held blocks (verified, copied) and fsyncs, off the loop."""
    s = make_node(cache_bytes=16 * MIB, fsync="always")
    # Diverges inside the held replica's only segment: every held block before it is carried into a new one.
    grown = np.concatenate([s.held[: (HELD_BLOCKS - 1) * BLOCK], conversation(4, seed=3)])
    ho = hand_offer(s.facts, "big", grown)
    with LoopProbe(s.loop) as probe:
        reply, secs = timed(lambda: hand_send(s.srv.node.kvshare.address, service.DEV_SECRET, ho))
    assert isinstance(reply, wire.Completed) and reply.tokens == len(grown)
    m = s.srv.node.kvshare.store.manifest("big")
    assert m is not None and m.hashes == ho.hashes
    assert probe.worst < secs / 4, f"the loop waited {probe.worst:.3f}s during a {secs:.3f}s transfer"


def test_cancelled_import_gives_everything_back(make_node: Any) -> None:
    """Cancelling ensure_imported mid-copy aborts it: nothing imported, every reserved block free again, no pin left."""
    s = make_node(cache_bytes=(HELD_BLOCKS + 16) * MIB)
    node = s.srv.node
    e = node.engine

    async def cancel_midway() -> tuple[bool, int]:
        free = e.blocks.num_free
        task = asyncio.ensure_future(node.kvshare.ensure_imported("big", s.held))
        while e.blocks.num_free == free:  # blocks reserved: the copy is under way
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return task.cancelled(), free

    cancelled, free = s.on_loop(cancel_midway())
    assert cancelled

    async def state() -> tuple[int, int]:
        return e.blocks.num_free, e.cached_prefix("big", s.held)

    deadline = time.monotonic() + 30
    while s.on_loop(state())[0] != free and time.monotonic() < deadline:  # the worker stops at its next block
        time.sleep(0.01)
    assert s.on_loop(state()) == (free, 0)
    assert s.on_loop(node.kvshare.ensure_imported("big", s.held)) == len(s.held)  # and the next import works


def test_await_worker_releases_only_after_the_worker_returns() -> None:
    """A cancelled await asks the worker to stop, and frees what it uses only once it has returned."""
    gate, started = threading.Event(), threading.Event()
    released: list[float] = []
    stopped: list[bool] = []

    def work() -> int:
        started.set()
        gate.wait(10)
        return 1

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, work)
        task = asyncio.ensure_future(common._await_worker(fut, stop=lambda: stopped.append(True),
                                                           release=lambda: released.append(time.monotonic())))
        while not started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the task is awaiting the worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stopped == [True] and released == []  # the worker still runs: nothing freed under it
        gate.set()
        while not released:
            await asyncio.sleep(0.001)
        assert len(released) == 1

    asyncio.run(main())
