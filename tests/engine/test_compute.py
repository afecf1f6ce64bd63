"""A runner's compute thread: idle only while no job waits for it or runs on it (node.engine.compute)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.node.engine.compute import ComputeThread


def test_idle_until_a_job_is_submitted_and_again_once_it_ended() -> None:
    """A running job and one queued behind it both count; once both ended the thread is idle."""
    ct = ComputeThread("t")
    try:
        assert ct.idle()
        gate = threading.Event()
        running = ct.submit(gate.wait, 5)
        queued = ct.submit(lambda: 1)
        assert not ct.idle()
        gate.set()
        assert running.result(5) and queued.result(5) == 1
        assert ct.idle()
    finally:
        ct.shutdown(wait=True)


def test_a_job_dropped_from_the_queue_stops_counting_at_once() -> None:
    """A queued job cancelled, or cancelled by shutdown, no longer counts; the running one still does."""
    ct = ComputeThread("t")
    gate = threading.Event()
    try:
        ct.submit(gate.wait, 5)
        dropped = ct.submit(lambda: None)
        assert dropped.cancel()
        assert not ct.idle()  # the first still runs
        ct.submit(lambda: None)
        ct.shutdown(wait=False, cancel_futures=True)
        assert not ct.idle()
        gate.set()
        ct.shutdown(wait=True)
        assert ct.idle()
        with pytest.raises(RuntimeError):
            ct.submit(lambda: None)
        assert ct.idle()  # a refused submission never counted
    finally:
        gate.set()
        ct.shutdown(wait=True)


def test_a_running_job_whose_awaiting_turn_was_cancelled_counts_until_it_ends() -> None:
    """A turn cancelled while its prefill runs leaves that prefill on the thread: not idle until it ends."""
    ct = ComputeThread("t")
    gate = threading.Event()
    started = threading.Event()

    def job() -> None:
        started.set()
        gate.wait(5)

    async def turn() -> None:
        task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(ct, job))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(turn())
        assert not ct.idle()
        gate.set()
        ct.submit(lambda: None).result(5)
        assert ct.idle()
    finally:
        gate.set()
        ct.shutdown(wait=True)
