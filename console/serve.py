"""`kvmesh-console --serve`: the same console in a browser, through textual-serve.

A console so started leaves when its browser tab closes (textual-serve tells it to quit), when its
server stops or dies, and on SIGTERM (`guard_served`).

textual-serve runs one console process per browser tab (the command below) and
relays its screen over a websocket to xterm.js in the page. The server binds
loopback unless `--host` says otherwise, and every console it starts is
read-only unless `--serve` was given with `--admin`: a projector or a shared
laptop must not be able to drain a host.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil
from textual.app import App

from kvmesh.console.config import ConsoleConfig

# A console that was asked to leave and has not within this long is ended by force.
LEAVE_GRACE_S = 3.0

# Flags that belong to the server, not to the console it starts (with whether they take a value).
_SERVER_FLAGS = {"--serve": False, "--host": True, "--port": True}


def console_command(argv: Sequence[str], cfg: ConsoleConfig) -> str:
    """The shell command textual-serve runs per browser tab: this console's flags, minus the server's,
    plus `--readonly` unless the operator passed `--admin`."""
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _SERVER_FLAGS:
            skip = _SERVER_FLAGS[name] and "=" not in arg
            continue
        args.append(arg)
    if cfg.readonly and "--readonly" not in args:
        args.append("--readonly")
    # exec: the shell textual-serve starts becomes the console, so the console is the server's own
    # child (signals reach it, and it sees the server go).
    return "exec " + shlex.join([sys.executable, "-m", "kvmesh.console", *args])


def is_served() -> bool:
    """Whether this console runs under textual-serve (its web driver), one process per browser tab."""
    return os.environ.get("TEXTUAL_DRIVER", "").endswith(":WebDriver")


def guard_served(app: App[Any], *, every_s: float = 1.0) -> None:
    """A served console leaves when its server does (it is reparented), and on SIGTERM; if the app does
    not end within LEAVE_GRACE_S of being asked, the process exits anyway. Without this a console whose
    server stopped kept running, and drawing, for minutes, deaf to SIGTERM."""
    parent = os.getppid()
    leaving = threading.Event()

    def leave() -> None:
        if leaving.is_set():
            return
        leaving.set()
        try:
            app.call_from_thread(app.exit)
        except Exception:  # noqa: BLE001 - not running yet, or already gone: the deadline below ends it
            pass
        time.sleep(LEAVE_GRACE_S)
        os._exit(0)

    def watch() -> None:
        while not leaving.is_set():
            time.sleep(every_s)
            if os.getppid() != parent:
                leave()

    threading.Thread(target=watch, name="served-watch", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=leave, name="served-leave", daemon=True).start())


def serve(argv: Sequence[str], cfg: ConsoleConfig, *, host: str, port: int) -> int:
    """Serve until interrupted (Ctrl-C); 2 if textual-serve is not installed."""
    try:
        from textual_serve.server import Server
    except ImportError:
        print("kvmesh-console: --serve needs textual-serve (pip install textual-serve)", file=sys.stderr)
        return 2
    class _Server(Server):  # type: ignore[misc]
        def request_exit(self) -> None:
            # The tabs' consoles are this process's children (exec'd): tell each to leave, by its PID,
            # rather than leave them to notice the server is gone.
            for child in psutil.Process().children():
                try:
                    child.terminate()
                except psutil.Error:
                    pass
            super().request_exit()

    command = console_command(argv, cfg)
    mode = "read-only" if cfg.readonly else "ADMIN: mesh-changing actions allowed"
    print(f"kvmesh-console: serving on http://{host}:{port} ({mode})", flush=True)
    _Server(command, host=host, port=port, title="kvmesh-console").serve()
    return 0
