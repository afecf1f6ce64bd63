"""llama.cpp's own server tests, run against a kvmesh node: how much of them kvmesh passes.

The llama-cpp-python sdist kvmesh runs (node.engine.vocab) vendors llama.cpp's server test suite
(`vendor/llama.cpp/tools/server/tests`: pytest, `utils.ServerProcess` as the server under test).
This extracts it to a temp folder, starts one real `kvmesh node` (llama.cpp engine, SmolLM2 by
default, `accept_any_model`) on a free loopback port, and runs the selected tests against it in the
suite's own external-server mode (`DEBUG_EXTERNAL`, `PORT`: `ServerProcess.start`/`stop` do
nothing, every request goes to the node). Selected: the tests of the fields kvmesh honours
(`response_format`, chat `logprobs`/`top_logprobs`, the native `/completion` `n_probs` tests, the
suite's only completion log-probability tests, and chat `n` > 1) and the chat/completion tests
that do not hinge on the suite's own model (stories260K's exact text and token counts) or on a
llama.cpp-only route or field; `--all` runs both test files whole.

llama-server serves its one model when a request names none; kvmesh wants `model`. Unless
`--strict`, a conftest fills a missing or null `model` with the test's `model_alias` (what
llama-server would answer as), so the rest of each test is measured; `--strict` measures as is.

    python -m kvmesh.node.lab.llamacpp_suite [--all] [--strict] [--sdist PATH] [--keep]
    kvmesh bench llamacpp-suite ...                                   # the same

The last stdout line is one JSON object: selected, passed, failed, skipped, failed_tests (ids),
and per topic counts. The exit status is non-zero only when the harness itself failed (no sdist,
the node did not start, pytest could not run or collected nothing), not when tests fail.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI builds its parser from here: nothing heavy at import
    from kvmesh.node.lab.launcher import NodeProcess

TESTS_IN_SDIST = "/vendor/llama.cpp/tools/server/tests/"
CHAT, CMPL = "unit/test_chat_completion.py", "unit/test_completion.py"

# (pytest node id: every parametrisation of the test, topic)
SELECTED: tuple[tuple[str, str], ...] = (
    (f"{CHAT}::test_completion_with_response_format", "response_format"),
    (f"{CHAT}::test_completion_with_json_schema", "response_format"),
    (f"{CHAT}::test_logprobs", "logprobs"),
    (f"{CHAT}::test_logprobs_stream", "logprobs"),
    (f"{CMPL}::test_n_probs", "completion_logprobs"),
    (f"{CMPL}::test_n_probs_stream", "completion_logprobs"),
    (f"{CHAT}::test_chat_completions_multiple_choices", "n"),
    (f"{CHAT}::test_chat_completion_with_openai_library", "generic"),
    (f"{CHAT}::test_invalid_chat_completion_req", "generic"),
    (f"{CHAT}::test_chat_template_continue_final_message_mutual_exclusion", "generic"),
    (f"{CMPL}::test_completion_with_openai_library", "generic"),
    (f"{CMPL}::test_completion_stream_with_openai_library", "generic"),
)

# Appended to the suite's conftest.py unless --strict: llama-server answers a request without
# `model` with its one model (as `--alias`); kvmesh wants the field, so it is filled in.
MODEL_SHIM = '''

# --- kvmesh.node.lab.llamacpp_suite: a missing or null "model" is the server's alias ---
_kvmesh_request = ServerProcess.make_request
_kvmesh_stream = ServerProcess.make_stream_request


def _kvmesh_fill(server, method, data):
    if method == "POST" and isinstance(data, dict) and data.get("model") is None:
        return {**data, "model": server.model_alias or "kvmesh"}
    return data


def _kvmesh_make_request(self, method, path, data=None, *args, **kwargs):
    return _kvmesh_request(self, method, path, _kvmesh_fill(self, method, data), *args, **kwargs)


def _kvmesh_make_stream_request(self, method, path, data=None, *args, **kwargs):
    return _kvmesh_stream(self, method, path, _kvmesh_fill(self, method, data), *args, **kwargs)


ServerProcess.make_request = _kvmesh_make_request
ServerProcess.make_stream_request = _kvmesh_make_stream_request
'''

# utils.py imports wget (model downloads); nothing here downloads, and the venv need not carry it.
WGET_STUB = "def download(url, out=None):\n    raise RuntimeError('kvmesh llamacpp-suite: no downloads')\n"


class HarnessError(RuntimeError):
    """The harness could not measure (no suite, no node, pytest could not run)."""


def extract_tests(sdist: Path, dest: Path) -> Path:
    """The sdist's server tests folder, written under `dest` (only plain files inside it); returns it."""
    count = 0
    with tarfile.open(sdist) as tar:
        for m in tar:
            if not m.isfile() or TESTS_IN_SDIST not in m.name:
                continue
            rel = PurePosixPath(m.name.split(TESTS_IN_SDIST, 1)[1])
            src = tar.extractfile(m)
            if src is None or rel.is_absolute() or ".." in rel.parts:
                continue
            out = dest.joinpath(*rel.parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(src.read())
            count += 1
    if not count or not (dest / "utils.py").is_file():
        raise HarnessError(f"{sdist} holds no llama.cpp server tests under *{TESTS_IN_SDIST}")
    return dest


def find_sdist(given: Path | None, work: Path) -> Path:
    """`given`, else llama-cpp-python's sdist by pip (node.engine.vocab.download_sdist)."""
    if given is not None:
        if not given.is_file():
            raise HarnessError(f"--sdist {given}: no such file")
        return given
    from kvmesh.node.engine.vocab import download_sdist

    try:
        return download_sdist(work)
    except (subprocess.CalledProcessError, ValueError) as e:
        raise HarnessError(f"could not download llama-cpp-python's sdist: {e}") from e


def prepare(tests: Path, strict: bool) -> None:
    (tests / "wget.py").write_text(WGET_STUB)
    if not strict:
        with open(tests / "conftest.py", "a") as f:
            f.write(MODEL_SHIM)


def start_node(work: Path, model: str, threads: int) -> NodeProcess:
    from kvmesh.node.lab.launcher import NodeProcess, free_port, write_toml

    cfg: dict[str, Any] = {
        "name": "llamacpp-suite",
        "api": {"host": "127.0.0.1", "port": free_port()},
        "engine": {"kind": "llamacpp", "model": model, "accept_any_model": True, "slots": 2,
                   "queue_timeout_s": 600.0, "llamacpp": {"threads": threads}},
        "kvshare": {"enabled": False, "store_dir": str(work / "store")},
    }
    path = work / "node.toml"
    write_toml(path, cfg)
    node = NodeProcess("llamacpp-suite", path, work).start()
    try:
        return node.wait_ready(timeout=300.0)
    except (RuntimeError, TimeoutError) as e:
        node.stop()
        raise HarnessError(str(e)) from e


def run_pytest(tests: Path, port: int, ids: list[str], junit: Path, log: Path, timeout_s: float) -> int:
    env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port), "PYTHONPATH": str(tests),
           "LLAMA_CACHE": str(tests / "tmp")}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={timeout_s:g}")
    with open(log, "wb") as out:
        return subprocess.run([*cmd, *ids], cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def topic_of(test_id: str) -> str:
    for prefix, topic in SELECTED:
        if test_id == prefix or test_id.startswith(prefix + "["):
            return topic
    return "other"


def read_junit(junit: Path) -> list[dict[str, str]]:
    """One row per test case: id (file::name[params]), outcome, and the failure's first lines."""
    rows: list[dict[str, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        test_id = f"{file}::{case.get('name', '')}"
        outcome, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, why = "failed", child.get("message") or (child.text or "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, why = "skipped", child.get("message") or ""
        why = " | ".join(line.strip() for line in why.strip().splitlines()[:3])
        rows.append({"id": test_id, "outcome": outcome, "topic": topic_of(test_id), "why": why[:300]})
    return rows


def summarize(rows: list[dict[str, str]], strict: bool) -> dict[str, Any]:
    by_topic: dict[str, dict[str, int]] = {}
    for r in rows:
        t = by_topic.setdefault(r["topic"], {"passed": 0, "failed": 0, "skipped": 0})
        t[r["outcome"]] += 1
    count = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
    return {"selected": len(rows), **count, "failed_tests": [r["id"] for r in rows if r["outcome"] == "failed"],
            "by_topic": by_topic, "model_filled": not strict}


def run_suite(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvmesh-llamacpp-suite-"))
    node: NodeProcess | None = None
    try:
        sdist = find_sdist(args.sdist, work)
        tests = extract_tests(sdist, work / "tests")
        prepare(tests, args.strict)
        ids = [CHAT, CMPL] if args.all else [p for p, _ in SELECTED]
        node = start_node(work, args.model, args.threads)
        port = int(node.api.rsplit(":", 1)[1])
        print(f"kvmesh node on {node.api} ({args.model}); llama.cpp's server tests in {tests}", flush=True)
        junit, log = work / "junit.xml", work / "pytest.log"
        rc = run_pytest(tests, port, ids, junit, log, args.timeout)
        if rc not in (0, 1) or not junit.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.is_file() else ""
            raise HarnessError(f"pytest exited with {rc} (0/1 expected); its log's end:\n{tail}")
        rows = read_junit(junit)
        if not rows:
            raise HarnessError("pytest collected no test")
    except HarnessError as e:
        print(f"kvmesh llamacpp-suite: {e}", file=sys.stderr)
        print(json.dumps({"error": str(e).splitlines()[0]}), flush=True)
        return 2
    finally:
        if node is not None:
            node.stop()
        if args.keep:
            print(f"kept {work} (node.log, pytest.log, junit.xml, tests/)", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        print(f"{r['outcome'].upper():<7} [{r['topic']}] {r['id']}" + (f"\n        {r['why']}" if r["why"] else ""))
    result = summarize(rows, args.strict)
    print(f"{result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped of "
          f"{result['selected']}" + ("" if args.strict else " (a missing \"model\" filled with the test's alias)"))
    print(json.dumps(result), flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true", help="run test_chat_completion.py and test_completion.py whole")
    p.add_argument("--strict", action="store_true", help="send requests as the suite writes them (no \"model\" filled in)")
    p.add_argument("--model", default="smollm2", help="the node's GGUF file or packaged model alias")
    p.add_argument("--sdist", type=Path, help="a llama-cpp-python sdist (default: pip downloads the one kvmesh pins)")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp compute threads (0: all cores)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per test (pytest-timeout)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, junit.xml, the tests)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.node.lab.llamacpp_suite", description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run_suite(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
