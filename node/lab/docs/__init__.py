"""`kvmesh docs`: the manual's generated pages, written from what holds each fact, and a check that they are current.

One source for each fact: the configuration reference comes from the pydantic models that validate a node's
config, the command-line reference from the argparse parsers, the HTTP API reference from the node's own OpenAPI
document, the metrics reference from the node's registry, the console's keys from its screens' bindings, and the
console screenshots from the snapshot tests' SVGs. `generate()` renders all of them in memory; `stale()` compares
them with what is under docs/ (tests/test_docs.py runs it); `kvmesh docs` writes them. A change to a model, a
parser, a route, a metric, a key or a snapshot without regenerating fails that test, naming the command to run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Where each generated file goes, under docs/; the folders are the generator's alone (a file there it did not write
# is stale too).
OWNED = ("reference", "images/console")
COMMAND = ".venv/bin/kvmesh docs"

# The console screenshots the manual shows, each copied from the snapshot test that renders it.
SNAPSHOTS = "tests/console/__snapshots__"
SCREENS = {
    "images/console/main.svg": "test_snapshots/test_screen_snapshot[120x40-kvmesh-dark].svg",
    "images/console/main-light.svg": "test_snapshots/test_screen_snapshot[120x40-kvmesh-light].svg",
    "images/console/compact.svg": "test_snapshots/test_screen_snapshot[80x24-kvmesh-dark].svg",
    "images/console/threads.svg": "test_snapshots/test_threads_snapshot[120x40].svg",
    "images/console/confirm.svg": "test_snapshots/test_confirm_modal_snapshot.svg",
    "images/console/ascii-readonly.svg": "test_snapshots/test_ascii_readonly_snapshot.svg",
    "images/console/demo.svg": "test_demo_view/test_demo_view_snapshot[120x40-kvmesh-dark].svg",
    "images/console/demo-compact.svg": "test_demo_view/test_demo_view_snapshot[80x24-kvmesh-cb].svg",
}


def openapi_document() -> dict[str, object]:
    """The OpenAPI document of a node as `kvmesh node` would build it (a small sim engine: nothing is served)."""
    from kvmesh.node.api.app import create_app
    from kvmesh.node.config import EngineConfig, NodeConfig
    from kvmesh.node.node import Node

    cfg = NodeConfig(name="docs", engine=EngineConfig(kind="sim", cache_bytes=16 << 20))
    return create_app(Node(cfg)).openapi()


def generate(root: Path, cli: argparse.ArgumentParser) -> dict[str, bytes]:
    """Every generated file, by its path under docs/, rendered now from the checkout at `root`; `cli` is the `kvmesh`
    parser (node.cli hands it in: the lab never imports the command line that reaches it)."""
    from kvmesh.node.lab.docs.apiref import api_page, openapi_json
    from kvmesh.node.lab.docs.cliref import cli_page
    from kvmesh.node.lab.docs.configref import config_page
    from kvmesh.node.lab.docs.keysref import keys_page
    from kvmesh.node.lab.docs.metricsref import metrics_page

    doc = openapi_document()
    pages = {"reference/configuration.md": config_page(), "reference/cli.md": cli_page(cli),
             "reference/http-api.md": api_page(doc), "reference/openapi.json": openapi_json(doc),
             "reference/metrics.md": metrics_page(), "reference/console-keys.md": keys_page()}
    out = {path: text.encode() for path, text in pages.items()}
    for dest, src in SCREENS.items():
        out[dest] = (root / SNAPSHOTS / src).read_bytes()
    return out


def stale(docs: Path, fresh: dict[str, bytes]) -> list[str]:
    """What under `docs` differs from `fresh` (what `generate` made): each path, and why."""
    problems = []
    for path, data in fresh.items():
        f = docs / path
        if not f.is_file():
            problems.append(f"docs/{path} is missing")
        elif f.read_bytes() != data:
            problems.append(f"docs/{path} is out of date")
    for folder in OWNED:
        for f in sorted((docs / folder).rglob("*")) if (docs / folder).is_dir() else []:
            rel = f.relative_to(docs).as_posix()
            if f.is_file() and rel not in fresh:
                problems.append(f"docs/{rel} is not generated any more")
    return problems


def write(docs: Path, fresh: dict[str, bytes]) -> list[str]:
    """Write every generated file under `docs` and remove what the generator owns but no longer makes."""
    changed = []
    for folder in OWNED:
        for f in sorted((docs / folder).rglob("*")) if (docs / folder).is_dir() else []:
            if f.is_file() and f.relative_to(docs).as_posix() not in fresh:
                f.unlink()
                changed.append(f"docs/{f.relative_to(docs).as_posix()} (removed)")
    for path, data in fresh.items():
        f = docs / path
        if not f.is_file() or f.read_bytes() != data:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(data)
            changed.append(f"docs/{path}")
    return changed


def run_docs(args: argparse.Namespace, cli: argparse.ArgumentParser) -> int:
    root: Path = args.root.resolve()
    if not (root / "mkdocs.yml").is_file():
        print(f"kvmesh docs: {root} is not a kvmesh checkout (no mkdocs.yml); pass --root", file=sys.stderr)
        return 2
    if args.check:
        problems = stale(root / "docs", generate(root, cli))
        for p in problems:
            print(f"kvmesh docs: {p}", file=sys.stderr)
        if problems:
            print(f"kvmesh docs: run `{COMMAND}` and commit docs/", file=sys.stderr)
        return 1 if problems else 0
    changed = write(root / "docs", generate(root, cli))
    print("\n".join(changed) if changed else "docs/ is current")
    return 0
