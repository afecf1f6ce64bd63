"""`kvmesh-console --serve`: the same console in a browser, through textual-serve.

textual-serve runs one console process per browser tab (the command below) and
relays its screen over a websocket to xterm.js in the page. The server binds
loopback unless `--host` says otherwise, and every console it starts is
read-only unless `--serve` was given with `--admin`: a projector or a shared
laptop must not be able to drain a host.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence

from kvmesh.console.config import ConsoleConfig

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
    return shlex.join([sys.executable, "-m", "kvmesh.console", *args])


def serve(argv: Sequence[str], cfg: ConsoleConfig, *, host: str, port: int) -> int:
    """Serve until interrupted (Ctrl-C); 2 if textual-serve is not installed."""
    try:
        from textual_serve.server import Server
    except ImportError:
        print("kvmesh-console: --serve needs textual-serve (pip install textual-serve)", file=sys.stderr)
        return 2
    command = console_command(argv, cfg)
    mode = "read-only" if cfg.readonly else "ADMIN: mesh-changing actions allowed"
    print(f"kvmesh-console: serving on http://{host}:{port} ({mode})", flush=True)
    Server(command, host=host, port=port, title="kvmesh-console").serve()
    return 0
