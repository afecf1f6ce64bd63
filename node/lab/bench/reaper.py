"""A benchmark's processes end with it: SIGTERM, SIGINT (Ctrl-C) or SIGHUP to a bench stops every one it started.

The servers a bench starts (llama-server, vLLM, kvmesh nodes, nginx) each run in a session of their
own, so a signal sent to the bench's process group never reaches them: a bench ended by `timeout`
left its llama-server running, busy (issue 50). `guarded()` wraps a bench's run: on one of those
signals it first stops every process started since it was entered (its descendants, and the process
groups they lead, so a server's workers go too even if their parent died first), then raises
`Interrupted`, so the bench's own `finally` blocks run over processes already gone and the exit
status says a signal ended it (128 + the signal's number). On a normal exit it stops whatever the
bench left running and says so on stderr.

Only processes that were not descendants when the guard was entered are touched: a bench run inside
a test process never stops the test's own servers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(SystemExit):
    """The bench was ended by a signal; its code is 128 + the signal's number, as a shell reports it."""


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _key(p: psutil.Process) -> tuple[int, float]:
    # (pid, start time): a pid the kernel reused for a process of someone else's is a different key
    try:
        return p.pid, p.create_time()
    except psutil.Error:
        return p.pid, 0.0


class Reaper:
    """What a bench started, told apart from what was running before it (see the module docstring)."""

    def __init__(self) -> None:
        self.before = {_key(p) for p in _descendants()}
        self.own_group = os.getpgrp()

    def started(self) -> list[psutil.Process]:
        """Descendants started since the guard was entered, still alive."""
        return [p for p in _descendants() if _key(p) not in self.before and _running(p)]

    def stop_all(self, grace_s: float = 8.0) -> list[int]:
        """SIGTERM every started process and every process group one of them leads, then SIGKILL what is
        left after `grace_s`; returns the pids that were running. Groups are taken before any signal,
        while every parent is alive to name its children."""
        procs = self.started()
        groups: set[int] = set()
        for p in procs:
            with contextlib.suppress(psutil.Error, OSError):
                pgid = os.getpgid(p.pid)
                if pgid == p.pid and pgid != self.own_group:
                    groups.add(pgid)
        # a group's members that are not our descendants any more (their parent died) still end with it
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for g in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(g, sig)
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            _, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 5.0)
            if not alive and not any(_group_alive(g) for g in groups):
                break
            if sig == signal.SIGTERM:
                time.sleep(0.05)
        return [p.pid for p in procs]


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a zombie has ended; its parent has yet to reap it
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@contextlib.contextmanager
def guarded(name: str = "kvmesh bench") -> Iterator[Reaper]:
    """Run the body with the signal handlers above installed (main thread only); restore them after."""
    reaper = Reaper()
    main = threading.current_thread() is threading.main_thread()
    fired: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if fired:  # a second signal while stopping: stopping goes on; a third is the default action
            signal.signal(signum, signal.SIG_DFL)
            return
        fired.append(signum)
        print(f"{name}: {signal.Signals(signum).name}: stopping every process it started", file=sys.stderr, flush=True)
        pids = reaper.stop_all()
        print(f"{name}: stopped {len(pids)} process(es)", file=sys.stderr, flush=True)
        raise Interrupted(128 + signum)

    old = {s: signal.signal(s, on_signal) for s in SIGNALS} if main else {}
    try:
        yield reaper
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if not fired:
            left = reaper.stop_all()
            if left:
                print(f"{name}: stopped {len(left)} process(es) it had left running: {left}", file=sys.stderr, flush=True)
