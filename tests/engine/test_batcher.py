"""Decoding ahead on the compute thread: running slots decode in lockstep batches, stop, fail and share the thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import pytest
import torch

from kvmesh.node.engine.batcher import MAX_AHEAD, DecodeBatcher, DecodeStep

VOCAB = 50


def _rows(steps: list[DecodeStep]) -> list[torch.Tensor]:
    """Logits whose argmax is (token + slot + 1) mod VOCAB: each slot's sequence is predictable."""
    out = []
    for st in steps:
        row = torch.zeros(VOCAB)
        row[(st.token + st.slot + 1) % VOCAB] = 1.0
        out.append(row)
    return out


def _pick(limit: int):  # type: ignore[no-untyped-def]
    n = 0

    def pick(row: torch.Tensor) -> tuple[int, bool]:
        nonlocal n
        n += 1
        assert threading.current_thread().name.startswith("test-compute")  # sampling runs on the compute thread
        return int(row.argmax()), n >= limit
    return pick


@pytest.fixture
def executor():  # type: ignore[no-untyped-def]
    ex = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="test-compute")
    yield ex
    ex.shutdown(wait=True)


def test_running_slots_decode_in_lockstep(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """Three slots running ahead share the batches: about 20 batches for 3 x 20 steps (one step per
    slot and batch; 60 if each step went alone), each slot's tokens in order."""
    sizes: list[int] = []

    def run_batch(steps: list[DecodeStep]) -> list[torch.Tensor]:
        sizes.append(len(steps))
        time.sleep(0.005)  # a decode step's compute: the consumers keep up, as with a real model
        return _rows(steps)

    b = DecodeBatcher(executor, run_batch)

    async def one(slot: int) -> list[int]:
        return [t async for t in b.run_ahead(slot, 0, 10, _pick(20))]

    async def go() -> list[list[int]]:
        return await asyncio.gather(*(one(s) for s in range(3)))

    got = asyncio.run(go())
    for slot, toks in enumerate(got):
        want, t = [], 0
        for _ in range(20):
            t = (t + slot + 1) % VOCAB
            want.append(t)
        assert toks == want
    assert b.steps == 60 and b.batches <= 24 and max(sizes) == 3


def test_closing_early_stops_the_run(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """A consumer that stops after 3 tokens (a stop string) leaves the slot at most MAX_AHEAD steps ahead,
    however much faster than its consumer the compute thread is."""
    b = DecodeBatcher(executor, _rows)

    async def go() -> list[int]:
        got = []
        async with contextlib.aclosing(b.run_ahead(0, 0, 0, _pick(1000))) as toks:
            async for t in toks:
                got.append(t)
                if len(got) == 3:
                    break
        await asyncio.sleep(0.2)  # any batch still queued runs now, or never
        return got

    assert len(asyncio.run(go())) == 3
    assert b.steps <= 3 + MAX_AHEAD + 1


def test_batch_error_reaches_every_run_and_on_error(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """A failed llama_decode: on_error sees the steps, each running turn raises it, none hangs."""
    erased: list[int] = []

    def run_batch(steps: list[DecodeStep]) -> list[torch.Tensor]:
        if len(steps) == 2:  # the first batch both runs are in (a loaded box may run a few alone first)
            raise RuntimeError("llama_decode returned 1")
        return _rows(steps)

    b = DecodeBatcher(executor, run_batch, on_error=lambda steps: erased.extend(st.slot for st in steps))

    async def one(slot: int) -> list[int]:
        return [t async for t in b.run_ahead(slot, 0, 0, _pick(50))]

    async def go() -> list[object]:
        return await asyncio.wait_for(asyncio.gather(one(0), one(1), return_exceptions=True), 10)

    res = asyncio.run(go())
    assert all(isinstance(r, RuntimeError) for r in res) and sorted(erased) == [0, 1]


def test_other_compute_jobs_run_between_batches(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """A prefill chunk submitted while a slot runs ahead runs before that slot's decode ends."""
    order: list[str] = []

    def run_batch(steps: list[DecodeStep]) -> list[torch.Tensor]:
        order.append("batch")
        return _rows(steps)

    b = DecodeBatcher(executor, run_batch)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        toks = b.run_ahead(0, 0, 0, _pick(30))
        first = await anext(toks)
        assert first == 1
        await loop.run_in_executor(executor, order.append, "prefill")
        async with contextlib.aclosing(toks):
            async for _ in toks:
                pass

    asyncio.run(go())
    assert order.count("batch") == 30 and order.index("prefill") < len(order) - 1


def test_the_batcher_is_idle_only_while_no_slot_decodes(executor: concurrent.futures.ThreadPoolExecutor) -> None:
    """Idle before a run, busy in each of its batches (seen from the compute thread), idle once it stopped."""
    seen: list[bool] = []

    def rows(steps: list[DecodeStep]) -> list[torch.Tensor]:
        seen.append(b.idle())
        return _rows(steps)
    b = DecodeBatcher(executor, rows)

    async def go() -> None:
        async for _ in b.run_ahead(0, 1, 0, _pick(5)):
            pass
    assert b.idle()
    asyncio.run(go())
    assert len(seen) == 5 and not any(seen) and b.idle()
