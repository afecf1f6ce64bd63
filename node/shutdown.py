"""SIGTERM is a warm drain, not a stop: what a node does between the signal and its exit.

The first SIGTERM (or SIGINT) marks the node stopping: `GET /ready` answers 503 at once (a
load balancer or Kubernetes stops sending clients here) and the node drains (peers see it
draining at their next status poll and place no new turn here; every resident session is
pushed to the host it would go to next, the operator's drain path). Turns already running
finish; turns a client still sends here are placed on peers, as any drained host's are. The node
exits once no turn runs or waits and the drain's pushes are done, or at `drain_timeout_s`,
whichever comes first. A second signal, or the deadline, exits at once: nothing is lost then
but warmth (a session whose push had not landed recomputes on its next host).

The exit itself is bounded too: once the drain has told the server to stop, a watchdog
(faulthandler) gives the rest of the deadline plus `exit_grace_s`, then writes every thread's
stack to the log and ends the process. A stop step that hangs (a connection that never closes,
a thread stuck in a socket call that the interpreter would join at exit) shows in the log with
where it hung, instead of a node that said "exiting" and stayed up until something killed it. Meanwhile,
every few seconds, the log says which connections the exit waits on and where each task awaits: a stop
step stuck on an await shows there, which a thread's stack does not.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import math
import signal
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("kvmesh.shutdown")


class Exitable(Protocol):
    """What of uvicorn's Server the drain drives."""

    should_exit: bool
    force_exit: bool


class Drainable(Protocol):
    """What of the Node the drain asks (the Node satisfies it)."""

    name: str
    stopping: bool

    async def begin_drain(self) -> None: ...

    def drain_pending(self) -> str | None: ...


class WarmStop:
    """The signal handler's state: one drain, then the exit (or at once on a second signal)."""

    def __init__(self, node: Drainable, server: Exitable, timeout_s: float, *, poll_s: float = 0.1,
                 exit_grace_s: float = 8.0, watchdog: Callable[[float], None] | None = None,
                 report_every_s: float = 5.0) -> None:
        """`watchdog(after_s)` is armed once the server is told to stop (`exit_watchdog` in a node's own process;
        None where the process is not the node's alone, as in tests)."""
        self.node, self.server, self.timeout_s, self.poll_s = node, server, timeout_s, poll_s
        self.exit_grace_s, self.watchdog, self.report_every_s = exit_grace_s, watchdog, report_every_s
        self.task: asyncio.Task[None] | None = None
        self.lingering: asyncio.Future[None] | None = None
        self.signals = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: int = signal.SIGTERM) -> None:
        self.signals += 1
        if self.signals > 1:
            log.warning("node %s: %s again: exiting now, without waiting for the drain", self.node.name,
                        signal.Signals(sig).name)
            self.server.force_exit = self.server.should_exit = True
            self._arm(self.exit_grace_s)
            return
        log.warning("node %s: %s: draining (not ready, pushing sessions, finishing turns; at most %.0fs)",
                    self.node.name, signal.Signals(sig).name, self.timeout_s)
        self.node.stopping = True  # /ready says 503 from now on
        self.task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        try:
            await self.node.begin_drain()
            while (pending := self.node.drain_pending()) is not None and time.monotonic() < deadline:
                await asyncio.sleep(self.poll_s)
            if pending is not None:
                log.warning("node %s: drain timeout (%.0fs) with %s: exiting anyway", self.node.name, self.timeout_s,
                            pending)
            else:
                log.warning("node %s: drained in %.1fs; exiting", self.node.name, time.monotonic() - t0)
        except Exception:  # a drain that fails must still let the node exit
            log.exception("node %s: the drain failed; exiting", self.node.name)
        # Streams still open (a relay of a turn running elsewhere) get what is left of the deadline.
        config = getattr(self.server, "config", None)
        left = max(1, math.ceil(deadline - time.monotonic()))
        if config is not None:
            config.timeout_graceful_shutdown = left
        self.server.should_exit = True
        self._arm(left + self.exit_grace_s)
        if self.watchdog is not None:  # a node's own process: say what its exit waits on, should it wait
            self.lingering = asyncio.ensure_future(self._report_lingering())

    async def _report_lingering(self) -> None:
        """Every `report_every_s` until the process ends: the connections uvicorn still waits on and every task's await
        chain (the watchdog's stacks show threads only: a stop step stuck on an await shows here)."""
        while True:
            await asyncio.sleep(self.report_every_s)
            state = getattr(self.server, "server_state", None)
            conns = list(getattr(state, "connections", ()))
            log.warning("node %s: the exit still waits; %d connections open: %s", self.node.name, len(conns),
                        "; ".join(_connection(c) for c in conns) or "none")
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    log.warning("node %s:   task %s at %s", self.node.name, t.get_name(), _await_chain(t.get_coro()))

    def _arm(self, after_s: float) -> None:
        if self.watchdog is not None:
            log.info("node %s: exiting; a process still up in %.0fs dumps its threads and ends", self.node.name, after_s)
            self.watchdog(after_s)


def exit_watchdog(after_s: float) -> None:
    """Still running `after_s` from now: every thread's stack to stderr (the node's log), then exit 1."""
    faulthandler.dump_traceback_later(after_s, exit=True)


def _await_chain(coro: object) -> str:
    """Where a suspended coroutine waits: each frame of its await chain, outermost first."""
    out: list[str] = []
    while coro is not None and len(out) < 20:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            out.append(type(coro).__name__)
            break
        out.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " -> ".join(out)


def _connection(conn: object) -> str:
    """One uvicorn connection: its protocol and the request it serves."""
    cycle = getattr(conn, "cycle", None)
    scope = getattr(cycle, "scope", None) or getattr(conn, "scope", None) or {}
    return f"{type(conn).__name__} {scope.get('method', '')} {scope.get('path', '?')} from {scope.get('client')}"
