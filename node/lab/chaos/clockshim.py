"""A wall-clock shim for the clock-jump drill: one node process's time.time() jumps when a file says so.

The drill copies this file as `sitecustomize.py` into a directory it puts first on the victim
node's PYTHONPATH, with `KVMESH_CHAOS_CLOCK_FILE` naming an offset file ("+3600" or "-3600",
seconds). Python imports sitecustomize at start-up, before any kvmesh module, so every
`time.time()` and `time.time_ns()` in that process (`from time import time` included) reads the
real clock plus the file's current offset; the drill replaces the file mid-run (write a new one,
rename it into place) to jump the clock forward or back, and the next call sees the jump. The monotonic clocks are left alone: they cannot jump. Standard library only
(it runs before anything else is importable), and pure Python, so no system package is needed.

What it does not shift: C code that reads CLOCK_REALTIME itself (the node has none on its
duration paths; its durations are Python), and datetime.now() (used only to render dates).
The drill proves the shift took effect from the node's own answers (`created` of a chat
completion), so a shim that failed to load makes the drill "not run", never "passed".
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import time

ENV = "KVMESH_CHAOS_CLOCK_FILE"
_real_time = time.time
_real_time_ns = time.time_ns


class _Offset:
    """The offset file's value. Each call stats the file (a microsecond) and re-reads it only when
    it was replaced (the drill renames a new file into place), so a jump is seen by the very next
    call; an unreadable file keeps the last value."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds = 0.0
        self._stamp: tuple[int, int] | None = None

    def now(self) -> float:
        try:
            st = os.stat(self.path)
        except OSError:
            return self.seconds  # gone for a moment: keep the last offset
        if (st.st_ino, st.st_mtime_ns) != self._stamp:
            try:
                with open(self.path, encoding="ascii") as f:
                    self.seconds = float(f.read().strip())  # empty: mid-write, ValueError
                self._stamp = (st.st_ino, st.st_mtime_ns)
            except (OSError, ValueError):
                pass  # mid-write: read it again next call
        return self.seconds


def install(path: str) -> None:
    """Shift time.time() and time.time_ns() of this process by the offset in `path` from now on."""
    offset = _Offset(path)

    def shifted_time() -> float:
        return _real_time() + offset.now()

    def shifted_time_ns() -> int:
        return _real_time_ns() + int(offset.now() * 1e9)

    time.time = shifted_time
    time.time_ns = shifted_time_ns


def _chain_site_customize() -> None:
    """Run the sitecustomize this copy shadows, if the interpreter has one further down the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # started as a node's site hook by the drill
    if os.environ.get(ENV):
        install(os.environ[ENV])
    _chain_site_customize()
