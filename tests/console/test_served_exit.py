"""The browser view's console processes end: when the tab leaves, when the server stops or dies, and on SIGTERM.

`kvmesh-console --serve` (textual-serve) starts one console process per browser tab; a websocket to its /ws
is what a tab opens, so these tests open one (no browser needed) and watch the console process it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil
import pytest
from websockets.sync.client import connect

from kvmesh.node.lab.launcher import free_port, wait_for


@contextmanager
def served_tab() -> Iterator[tuple[subprocess.Popen[bytes], psutil.Process, Callable[[], None]]]:
    """A console server, one tab open on it: (server, the tab's console process, close the tab)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvmesh.console", "--serve", "--port", str(port), "--demo",
                               "--view", "demo"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        wait_for(lambda: _listening(port), f"the console server on {port}", timeout=60)
        with connect(f"ws://127.0.0.1:{port}/ws?width=80&height=24", open_timeout=30) as ws:
            me = psutil.Process(server.pid)
            child = wait_for(lambda: next((p for p in me.children(recursive=True)
                                           if "kvmesh.console" in " ".join(p.cmdline()) and "--serve" not in p.cmdline()),
                                          None), "the tab's console process", timeout=30)
            wait_for(lambda: ws.recv(timeout=10), "the console to draw")
            yield server, child, ws.close
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait(10)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE or not p.is_running()
    except psutil.NoSuchProcess:
        return True


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process-tree checks use /proc")


def test_the_console_is_the_servers_own_child() -> None:
    """The tab's console runs as the server's child (exec, no shell between them), so signals reach it."""
    with served_tab() as (server, child, _):
        assert child.ppid() == server.pid


def test_closing_the_tab_ends_its_console() -> None:
    """The tab's websocket closing ends its console process."""
    with served_tab() as (_, child, close):
        close()
        wait_for(lambda: _gone(child), "the console to exit after its tab closed", timeout=15)


def test_stopping_the_server_ends_its_consoles() -> None:
    """SIGTERM to the server (only it) ends the tab's console too, and the server."""
    with served_tab() as (server, child, _):
        server.send_signal(signal.SIGTERM)
        wait_for(lambda: _gone(child), "the console to exit after its server stopped", timeout=20)
        server.wait(20)


def test_a_console_whose_server_died_exits() -> None:
    """SIGKILL to the server (no goodbye to its consoles): the orphaned console notices and exits."""
    with served_tab() as (server, child, _):
        server.kill()
        server.wait(10)
        wait_for(lambda: _gone(child), "the orphaned console to exit", timeout=15)


def test_sigterm_ends_a_served_console() -> None:
    """SIGTERM to the tab's console itself ends it, within the leave grace."""
    with served_tab() as (_, child, _):
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        wait_for(lambda: _gone(child), "the console to exit on SIGTERM", timeout=10)
        assert time.monotonic() - t0 < 8
