"""Decode steps of every running slot, batched on the compute thread (the torch and llama.cpp runners).

Two ways in, one batch:
- `step(slot, token, pos)`: one step; the event loop awaits its logits (prefill's last step, tests);
- `run_ahead(slot, token, pos, pick)`: the slot keeps decoding on the compute thread. After each
  batch, `pick(logits)` (the engine's sampler, on the compute thread) gives the next token and
  whether it is the last; the token is fed into the next batch at once, without a round trip
  through the event loop, and handed to the turn's async iterator. So every running slot is in
  every batch (no batch waits on a slot's Python), and a turn's Python (detokenising, stop
  strings, SSE) runs beside the decode, not between its steps. A run waits once it is MAX_AHEAD
  tokens ahead of its consumer, so a consumer that stops early (a stop string, a hang-up) leaves
  the slot at most that many positions past what the turn commits; the next turn on the slot trims them.
Between batches the compute thread takes other jobs in order (prefill chunks, block copies), as
each batch is its own job on the single-thread executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass

import torch

MAX_AHEAD = 4  # tokens a run may be ahead of its consumer before it waits (an event loop that lags)
Pick = Callable[[torch.Tensor], tuple[int, bool]]  # logits -> (next token, it is the last)


@dataclass(frozen=True)
class DecodeStep:
    """One running slot's next token at its position."""

    slot: int
    token: int
    pos: int


class _Run:
    """A slot decoding ahead: its next step, its sampler and where its tokens go."""

    def __init__(self, slot: int, token: int, pos: int, pick: Pick, loop: asyncio.AbstractEventLoop) -> None:
        self.slot, self.token, self.pos, self.pick, self.loop = slot, token, pos, pick, loop
        self.queue: asyncio.Queue[int | BaseException | None] = asyncio.Queue()
        self.stopped = False  # set by the consumer (event loop) or on the last token (compute thread)
        self.ahead = 0  # tokens sent, not yet consumed (under the batcher's lock)
        self.paused = False  # left out of batches until its consumer catches up

    def send(self, item: int | BaseException | None) -> None:
        if self.loop.is_closed():
            return  # its consumer's loop is gone (a run left behind when the loop ended): nobody to tell
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class DecodeBatcher:
    """Decode steps of every running slot, gathered and run as one batch (module docstring).

    `run_batch(steps)` returns one row of logits per step; if it raises, every waiter of that
    batch gets the error (none hangs) after `on_error(steps)` has run."""

    def __init__(self, executor: concurrent.futures.Executor, run_batch: Callable[[list[DecodeStep]], Iterable[torch.Tensor]],
                 on_error: Callable[[list[DecodeStep]], None] = lambda steps: None):
        self._exec, self._run_batch, self._on_error = executor, run_batch, on_error
        # Guarded by the lock: the event loop adds, the compute thread takes.
        self._pending: list[tuple[DecodeStep, asyncio.Future[torch.Tensor], asyncio.AbstractEventLoop]] = []
        self._runs: list[_Run] = []
        self._lock = threading.Lock()
        self._queued = False  # a batch job is submitted or running; it resubmits itself while work remains
        self.batches = 0  # counters: batches run and steps in them
        self.steps = 0

    def _kick(self) -> None:
        """Caller holds the lock: make sure a batch job will see what was just added."""
        if not self._queued:
            self._queued = True
            self._exec.submit(self._drain)

    async def step(self, slot: int, token: int, pos: int) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[torch.Tensor] = loop.create_future()
        with self._lock:
            self._pending.append((DecodeStep(slot, token, pos), fut, loop))
            self._kick()
        return await fut

    async def run_ahead(self, slot: int, token: int, pos: int, pick: Pick) -> AsyncGenerator[int, None]:
        """Feed `token` at `pos`, then every token `pick` chooses until it says last; yields each
        chosen token. Closing the iterator stops the run at the next batch."""
        run = _Run(slot, token, pos, pick, asyncio.get_running_loop())
        with self._lock:
            self._runs.append(run)
            self._kick()
        try:
            while (item := await run.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                with self._lock:
                    run.ahead -= 1
                    if run.paused and run.ahead < MAX_AHEAD:
                        run.paused = False
                        self._kick()
                yield item
        finally:
            run.stopped = True

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            runs = []
            for r in self._runs:
                r.paused = not r.stopped and r.ahead >= MAX_AHEAD
                if not (r.stopped or r.paused):
                    runs.append(r)
        # A step whose turn was cancelled before the batch started is dropped; one cancelled
        # later only writes its own slot's state past what any later turn reads.
        pending = [p for p in pending if not p[1].cancelled()]
        steps = [p[0] for p in pending] + [DecodeStep(r.slot, r.token, r.pos) for r in runs]
        if steps:
            self._batch(pending, runs, steps)
        with self._lock:
            self._runs = [r for r in self._runs if not r.stopped]
            self._queued = bool(self._pending or any(not r.paused for r in self._runs))
            if self._queued:  # its own job again, so prefill chunks queued meanwhile run in between
                self._exec.submit(self._drain)

    def _batch(self, pending: list[tuple[DecodeStep, asyncio.Future[torch.Tensor], asyncio.AbstractEventLoop]],
               runs: list[_Run], steps: list[DecodeStep]) -> None:
        try:
            rows = list(self._run_batch(steps))
        except BaseException as e:  # every waiter hears of it; none hangs
            self._on_error(steps)
            for _, fut, loop in pending:
                loop.call_soon_threadsafe(_resolve, fut, None, e)
            for r in runs:
                r.stopped = True
                r.send(e)
            return
        self.batches += 1
        self.steps += len(steps)
        for (_, fut, loop), row in zip(pending, rows):
            loop.call_soon_threadsafe(_resolve, fut, row, None)
        for r, row in zip(runs, rows[len(pending):]):
            try:
                tok, last = r.pick(row)
            except BaseException as e:  # a sampler error ends its own turn only
                r.stopped = True
                r.send(e)
                continue
            with self._lock:
                r.ahead += 1
            r.send(tok)
            if last:
                r.stopped = True
                r.send(None)
            else:
                r.token, r.pos = tok, r.pos + 1

    def idle(self) -> bool:
        """No step is waiting and no slot is decoding (any thread)."""
        with self._lock:
            return not self._pending and all(r.stopped for r in self._runs)

    def cancel_pending(self) -> None:
        """Steps whose batch will never run (the executor is shut down): their turns end as cancelled."""
        with self._lock:
            pending, self._pending = self._pending, []
            runs, self._runs = self._runs, []
        for _, fut, loop in pending:
            if not loop.is_closed():
                loop.call_soon_threadsafe(fut.cancel)
        for r in runs:
            r.stopped = True
            r.send(asyncio.CancelledError())


def _resolve(fut: asyncio.Future[torch.Tensor], value: torch.Tensor | None, exc: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        assert value is not None
        fut.set_result(value)
