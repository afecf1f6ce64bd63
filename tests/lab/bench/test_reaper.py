"""A bench ended by SIGTERM stops every process it started: its servers, their workers, its nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvmesh.node.lab import testmodels
from kvmesh.node.lab.bench.reaper import Reaper

# A stand-in llama-server: healthy at once, a chat turn that streams forever, and a worker of its own
# in its process group (as a real server's are).
FAKE_SERVER = """\
import http.server, json, os, subprocess, sys, time
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["FAKE_PIDS"], "a").write(f"{os.getpid()} {worker.pid}\\n")

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        while True:
            chunk = {"choices": [{"delta": {"content": "x"}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(0.5)

http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    return alive


def test_guard_stops_children_in_their_own_sessions(tmp_path: Path) -> None:
    """SIGTERM to a guarded process: its child in a session of its own and that child's child both end; exit 143."""
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from kvmesh.node.lab.bench.reaper import guarded
        with guarded("fake bench"):
            inner = "import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \\
                    "open({str(pids)!r}, 'a').write(str(w.pid) + chr(10)); time.sleep(600)"
            c = subprocess.Popen([sys.executable, "-c", inner], start_new_session=True)
            open({str(pids)!r}, "a").write(str(c.pid) + chr(10))
            time.sleep(600)
    """)
    bench = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not pids.exists() or len(pids.read_text().split()) < 2):
        time.sleep(0.05)
    started = [int(x) for x in pids.read_text().split()]
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(30) == 128 + signal.SIGTERM
    assert _gone(started) == []
    assert "stopping every process it started" in (bench.stderr.read() if bench.stderr else "")


def test_reaper_leaves_what_ran_before_it_alone() -> None:
    """A process started before the guard (a test's own server) is never stopped by it."""
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reaper = Reaper()
        assert before.pid not in [p.pid for p in reaper.started()]
        assert reaper.stop_all(grace_s=1.0) == [] and before.poll() is None
    finally:
        before.kill()
        before.wait()


@pytest.mark.timeout(180)
def test_sigterm_to_bench_engine_stops_its_node_and_server(tmp_path: Path) -> None:
    """`kvmesh bench engine` with a node and a (fake) llama-server up: SIGTERM leaves no process of it alive."""
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    fake.chmod(0o755)
    gguf = testmodels.write_gguf(tmp_path / "tiny.gguf", testmodels.spec_for("tiny"))
    err = tmp_path / "stderr"
    env = {**os.environ, "KVMESH_LLAMA_SERVER": str(fake), "FAKE_PIDS": str(tmp_path / "fake.pids")}
    with open(err, "w") as e:
        bench = subprocess.Popen([sys.executable, "-m", "kvmesh.node.cli", "bench", "engine", "--model", str(gguf),
                                  "--prompts", "100", "--streams", "1", "--max-tokens", "4", "--json"],
                                 stdout=subprocess.DEVNULL, stderr=e, env=env)
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and "warm-up on llama-server" not in err.read_text():
            assert bench.poll() is None, err.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)
        tree = [p.pid for p in psutil.Process(bench.pid).children(recursive=True)]
        tree += [int(x) for x in (tmp_path / "fake.pids").read_text().split()]  # the fake's worker too
        assert len(tree) >= 3, err.read_text()[-2000:]  # the node, the fake server and its worker at least
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert _gone(tree) == [], err.read_text()[-2000:]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
