"""A deferred compute-thread job: it starts after its grace period, and cancelling it first drops it."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from kvmesh.node.engine.deferred import Deferred


def test_a_deferred_job_runs_once_its_grace_period_is_over() -> None:
    """The job is submitted no sooner than `after_s`, and `done` carries its result."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        t0 = time.monotonic()
        job = Deferred(0.05, lambda: ex.submit(lambda: time.monotonic() - t0))
        assert job.done.result(timeout=5) >= 0.05


def test_a_deferred_job_waits_until_its_thread_is_idle() -> None:
    """Past its grace period but `when()` false (other slots decoding): not submitted until `when()` turns true."""
    busy = threading.Event()
    busy.set()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        job = Deferred(0.02, lambda: ex.submit(lambda: 1), when=lambda: not busy.is_set())
        time.sleep(0.2)
        assert not job.done.done() and job._job is None  # noqa: SLF001 - ten grace periods on, never submitted
        busy.clear()
        assert job.done.result(timeout=5) == 1


def test_cancelled_in_its_grace_period_the_job_never_runs() -> None:
    """Cancelled before its timer fires: `done` is cancelled and the job is never submitted."""
    submitted = threading.Event()

    def start() -> concurrent.futures.Future[int]:
        submitted.set()
        raise AssertionError("a cancelled job was submitted")

    job = Deferred(0.05, start)
    assert job.cancel() and job.done.cancelled()
    time.sleep(0.15)
    assert not submitted.is_set()


def test_a_job_queued_behind_another_is_still_dropped_and_a_running_one_is_not() -> None:
    """Submitted but waiting for the thread: cancel drops it; running: cancel says so and `done` ends with it."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        gate = threading.Event()
        busy = ex.submit(gate.wait)  # the thread is taken
        queued = Deferred(0.0, lambda: ex.submit(lambda: 1))
        while queued._job is None:  # noqa: SLF001 - the timer has fired: the job is in the executor's queue
            time.sleep(0.005)
        assert queued.cancel() and queued.done.cancelled()
        gate.set()
        busy.result(timeout=5)

        started, release = threading.Event(), threading.Event()

        def run() -> int:
            started.set()
            release.wait()
            return 7
        running = Deferred(0.0, lambda: ex.submit(run))
        assert started.wait(5)
        assert not running.cancel()
        release.set()
        assert running.done.result(timeout=5) == 7


def test_a_job_whose_executor_was_shut_down_ends_cancelled_and_an_error_is_passed_on() -> None:
    """An engine closed within the grace period: `done` ends cancelled, not hanging; a failing job's error is in `done`."""
    ex = concurrent.futures.ThreadPoolExecutor(1)
    ex.shutdown()
    late = Deferred(0.0, lambda: ex.submit(lambda: 1))
    concurrent.futures.wait([late.done], timeout=5)
    assert late.done.cancelled()

    def fail() -> int:
        raise ValueError("no room")
    with concurrent.futures.ThreadPoolExecutor(1) as ex2:
        bad = Deferred(0.0, lambda: ex2.submit(fail))
        assert isinstance(bad.done.exception(timeout=5), ValueError)


def test_jobs_waiting_for_an_idle_thread_share_one_clock_thread() -> None:
    """Twenty settles re-asking every 10 ms on a busy host add at most one thread between them, not one each."""
    busy = threading.Event()
    busy.set()
    before = threading.active_count()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        jobs = [Deferred(0.01, lambda: ex.submit(lambda: 1), when=lambda: not busy.is_set()) for _ in range(20)]
        peak = 0
        for _ in range(20):
            time.sleep(0.01)
            peak = max(peak, threading.active_count() - before)
        assert peak <= 1
        busy.clear()
        assert [j.done.result(timeout=5) for j in jobs] == [1] * 20
