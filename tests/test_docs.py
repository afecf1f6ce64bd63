"""The manual: its generated reference is current, it builds with `mkdocs build --strict` offline, and the commands
it and the README show parse with the parsers they name."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvmesh.console.cli import _bench_parser, _run_parser
from kvmesh.node.cli import build_parser
from kvmesh.node.lab.docs import COMMAND, generate, stale, write

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "2>&1"}


@pytest.fixture(scope="module")
def fresh() -> dict[str, bytes]:
    """Every generated page, rendered now from this checkout."""
    return generate(REPO, build_parser())


def test_generated_reference_is_current(fresh: dict[str, bytes]) -> None:
    """docs/reference and the console screenshots equal what `kvmesh docs` writes from the code today."""
    problems = stale(DOCS, fresh)
    assert not problems, "\n".join(problems) + f"\nthe manual's generated pages are out of date: run `{COMMAND}` and commit docs/"


def test_the_check_names_each_stale_page(fresh: dict[str, bytes], tmp_path: Path) -> None:
    """A page edited by hand, one missing and one the generator no longer makes are each named."""
    docs = tmp_path / "docs"
    write(docs, fresh)
    assert stale(docs, fresh) == []
    (docs / "reference" / "cli.md").write_text("edited by hand\n")
    (docs / "reference" / "metrics.md").unlink()
    (docs / "reference" / "old.md").write_text("# gone\n")
    assert stale(docs, fresh) == ["docs/reference/cli.md is out of date", "docs/reference/metrics.md is missing",
                                        "docs/reference/old.md is not generated any more"]


def _pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def _nav_pages(nav: list[object]) -> set[str]:
    out: set[str] = set()
    for item in nav:
        for v in (item.values() if isinstance(item, dict) else [item]):
            out |= _nav_pages(v) if isinstance(v, list) else {str(v)}
    return out


def test_manual_builds_strict_offline(tmp_path: Path) -> None:
    """`mkdocs build --strict` succeeds (no broken link or anchor, every page in the nav) and fetches nothing: no page
    loads a font, script or stylesheet from another host."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    assert _nav_pages(nav) == _pages()
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(site)], capture_output=True, text=True, timeout=180, env=env)
    took = time.monotonic() - t0
    assert run.returncode == 0, run.stdout + run.stderr
    print(f"mkdocs build --strict: {took:.1f} s")
    for page in _pages():
        html = site / (page.removesuffix(".md").removesuffix("index") + ("/index.html" if page != "index.md" else "index.html"))
        assert html.is_file(), page
        remote = re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', html.read_text())
        assert not remote, (page, remote)
    assert (site / "search" / "search_index.json").is_file()


def _commands(text: str) -> list[str]:
    """The shell lines of a Markdown text's sh and bash blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", text, flags=re.M | re.S):
        out += block.replace("\\\n", " ").splitlines()
    return out


def _invocations(line: str) -> list[list[str]]:
    """Each `kvmesh` or `kvmesh-console` call on a shell line, as its argument words (optional `[...]` parts left out)."""
    try:
        words = shlex.split(re.sub(r"\s\[[^\]]*\]", "", line), comments=True)
    except ValueError:
        return []
    words = [w for word in words for w in (shlex.split(word) if " " in word else [word])]
    calls = []
    for i, w in enumerate(words):
        if os.path.basename(w) in ("kvmesh", "kvmesh-console") and (i == 0 or words[i - 1] in SHELL_OPERATORS | {"sudo", "exec"}
                                                                   or "=" in words[i - 1] or words[i - 1].startswith("(")):
            args = []
            for a in words[i + 1:]:
                if a in SHELL_OPERATORS or a.startswith((">", "2>")):
                    break
                args.append(a.rstrip(")"))
            calls.append([os.path.basename(w), *args])
    return calls


def _parses(call: list[str]) -> str | None:
    """None when the call parses, else argparse's complaint."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if call[0] == "kvmesh":
                build_parser().parse_args(call[1:])
            elif call[1:2] == ["bench"]:
                _bench_parser().parse_args(call[2:])
            else:
                _run_parser().parse_args(call[1:])
        except SystemExit as e:
            return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def test_manual_commands_parse() -> None:
    """Every `kvmesh` and `kvmesh-console` command in the manual's and the README's shell blocks parses, and every
    `make` target they name exists."""
    files = [*sorted(DOCS.rglob("*.md")), REPO / "README.md"]
    makefile = (REPO / "Makefile").read_text()
    bad, seen = [], 0
    for f in files:
        for line in _commands(f.read_text()):
            for call in _invocations(line):
                seen += 1
                problem = _parses(call)
                if problem:
                    bad.append(f"{f.relative_to(REPO)}: {' '.join(call)}: {problem}")
            for target in re.findall(r"^make (\w[\w-]*)", line):
                if not re.search(rf"^{target}:", makefile, flags=re.M):
                    bad.append(f"{f.relative_to(REPO)}: make {target}: no such target")
    assert seen >= 40, seen
    assert not bad, "\n".join(bad)


def test_invocations_sees_what_it_should() -> None:
    """The shell reader finds calls after sudo, exec, env assignments and operators, and drops comments and `[...]`."""
    line = "KEY=x .venv/bin/kvmesh load --node http://a:8000 [--json] && (cd a && exec ../.venv/bin/kvmesh node --config ../a.toml) # no"
    assert _invocations(line) == [["kvmesh", "load", "--node", "http://a:8000"], ["kvmesh", "node", "--config", "../a.toml"]]
    assert _invocations("sudo .venv/bin/kvmesh netlab --quick > out.txt") == [["kvmesh", "netlab", "--quick"]]
    assert _parses(["kvmesh", "bench", "nope"]) and _parses(["kvmesh", "node", "--port", "1"]) is None
