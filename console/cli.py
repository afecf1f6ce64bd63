"""`kvmesh-console`: run the operator console, or `kvmesh-console bench`.

    kvmesh-console --node http://127.0.0.1:8000 [--node URL ...] [--readonly]
    kvmesh-console --config console.toml
    kvmesh-console --demo                 # a synthetic mesh, no nodes needed
    kvmesh-console --view demo            # the demo view (read-only unless --admin)
    kvmesh-console --serve [--port 8080]  # the same console in a browser (read-only unless --admin)
    kvmesh-console bench --json [--seconds 30] [--ended 1800] [--hosts 256 --sessions 20000]

The admin token is read from KVMESH_ADMIN_TOKEN or --admin-token-file, and the client API key
(which nodes with keys want on their event stream) from KVMESH_API_KEY or --api-key-file; neither
ever from a flag value (it would be visible in `ps`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from kvmesh.console.admin import TOKEN_ENV, AdminClient, TokenError, load_admin_token
from kvmesh.console.apikey import KEY_ENV, ApiKeyError, load_api_key
from kvmesh.console.config import ConsoleConfig, load_config_file
from kvmesh.console.serve import guard_served, is_served
from kvmesh.console.theme import THEME_NAMES


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvmesh-console",
        description="Live operator console for a kvmesh mesh. Subcommand: 'bench' (see kvmesh-console bench -h).",
        epilog=f"Admin token: set {TOKEN_ENV} or pass --admin-token-file; API key (nodes with client keys want it): "
               f"set {KEY_ENV} or pass --api-key-file. Never a flag value.",
    )
    p.add_argument("--node", action="append", default=None, metavar="URL",
                   help="node API URL (repeatable); peers are discovered from its snapshot")
    p.add_argument("--config", metavar="PATH", help="TOML config file (flags win)")
    p.add_argument("--readonly", action="store_true", default=None, help="no mesh-changing actions; RO in the header")
    p.add_argument("--ascii", action="store_true", default=None, help="ASCII only (no Unicode glyphs or box drawing)")
    p.add_argument("--theme", choices=THEME_NAMES, default=None)
    p.add_argument("--utc", action="store_true", default=None, help="show times in UTC")
    p.add_argument("--no-discover", dest="discover", action="store_false", default=None,
                   help="only follow the --node URLs, not peers found in snapshots")
    p.add_argument("--admin-token-file", metavar="PATH", default=None)
    p.add_argument("--api-key-file", metavar="PATH", default=None,
                   help=f"file holding the client API key nodes want (kvmesh init writes mesh/api-key); or {KEY_ENV}")
    p.add_argument("--layout", choices=("auto", "compact", "large"), default=None)
    p.add_argument("--refresh", type=float, default=None, metavar="SECONDS", help="screen refresh interval (0.5)")
    p.add_argument("--demo", action="store_true", default=None, help="play a synthetic mesh (no nodes needed)")
    p.add_argument("--view", choices=("main", "demo"), default=None,
                   help="start in this view; 'demo': big counters and sparklines for a room (read-only unless --admin)")
    p.add_argument("--admin", action="store_true", default=None,
                   help="allow mesh-changing actions in the demo view and the browser view (read-only otherwise)")
    p.add_argument("--idle-minutes", type=float, default=None, metavar="N",
                   help="a session with no turn for longer has ended (default 5)")
    p.add_argument("--serve", action="store_true", help="serve this console to a browser (textual-serve)")
    p.add_argument("--host", default="127.0.0.1", help="with --serve: address to bind (loopback unless told)")
    p.add_argument("--port", type=int, default=8080, help="with --serve: port (8080)")
    return p


def _bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh-console bench", description="Headless benchmark on a synthetic mesh.")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--sessions", type=int, default=2000)
    p.add_argument("--hosts", type=int, default=4,
                   help="hosts; past 16 (the directory threshold) each streams its own part, as a large mesh does")
    p.add_argument("--ended", type=int, default=0, help="of the sessions, this many finished long ago")
    p.add_argument("--threads", type=int, default=0,
                   help="each client session: a main conversation and this many threads (subagents) of it")
    p.add_argument("--events-per-s", type=float, default=200.0)
    p.add_argument("--size", default="120x40", help="terminal size WxH")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds after the snapshot before measuring")
    return p


def build_config(args: argparse.Namespace) -> ConsoleConfig:
    values = load_config_file(args.config) if args.config else {}
    cfg = ConsoleConfig(**values)
    for name in ("readonly", "ascii", "theme", "utc", "discover", "admin_token_file", "api_key_file", "layout", "demo", "view",
                 "admin", "idle_minutes"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    if cfg.readonly and cfg.admin:
        raise ValueError("--readonly and --admin contradict each other")
    # The demo view and the browser are for rooms and projectors: nothing changes the mesh there
    # unless the operator asked for it.
    if (cfg.view == "demo" or getattr(args, "serve", False)) and not cfg.admin:
        cfg.readonly = True
    if args.node:
        cfg.nodes = list(args.node)
    if args.refresh is not None:
        cfg.refresh_interval = max(0.1, args.refresh)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        bargs = _bench_parser().parse_args(argv[1:])
        w, _, h = bargs.size.partition("x")
        from kvmesh.console.bench import run_bench

        run_bench(bargs.seconds, bargs.sessions, bargs.events_per_s, (int(w), int(h)), as_json=bargs.json,
                  warmup=bargs.warmup, ended=bargs.ended, hosts=bargs.hosts, threads=bargs.threads)
        return 0
    for a in argv:
        for flag, env in (("--admin-token", TOKEN_ENV), ("--api-key", KEY_ENV)):
            if a == flag or a.startswith(flag + "="):
                print(f"kvmesh-console: no {flag} flag (it would show in ps); set {env} or use {flag}-file",
                      file=sys.stderr)
                return 2
    parser = _run_parser()
    args = parser.parse_args(argv)
    try:
        cfg = build_config(args)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(str(exc))
    if not cfg.nodes and not cfg.demo:
        parser.error("give at least one --node URL (or nodes in --config, or --demo)")
    if args.serve:
        from kvmesh.console.serve import serve

        return serve(argv, cfg, host=args.host, port=args.port)
    return run_console(cfg)


def run_console(cfg: ConsoleConfig) -> int:
    from kvmesh.console.app import KvmeshConsole
    from kvmesh.console.state import ConsoleState

    token = None
    admin = None
    if not cfg.readonly:
        try:
            token = load_admin_token(cfg.admin_token_file, os.environ)
        except TokenError as exc:
            print(f"kvmesh-console: {exc}", file=sys.stderr)
            return 2
    try:
        api_key = load_api_key(cfg.api_key_file, os.environ)
    except ApiKeyError as exc:
        print(f"kvmesh-console: {exc}", file=sys.stderr)
        return 2
    sources = None
    state = ConsoleState()
    if cfg.demo:
        from kvmesh.console.synthetic import SyntheticMesh, run_synthetic

        cfg.discover = False
        mesh = SyntheticMesh(sessions=200, hosts=4, ended=140, threads=3, t0=time.time())

        async def demo(st: ConsoleState) -> None:
            await run_synthetic(mesh, st.feed_frame, st.node_connected, events_per_s=20, clock=time.time)

        sources = [("demo", demo)]
    app = KvmeshConsole(cfg, state=state, sources=sources, token=token, api_key=api_key)
    if not cfg.readonly:
        def node_urls() -> list[str]:
            # Connected nodes first: every node is an entry point for admin calls.
            conns = sorted(state.nodes.values(), key=lambda c: not c.connected)
            return [c.url for c in conns if c.url.startswith("http")]

        admin = AdminClient(node_urls, token.token if token else None)
        app.admin = admin
    if is_served():
        guard_served(app)
    app.run()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
