"""The browser view: `kvmesh-console --serve` opened in headless Chromium, read through the DevTools protocol.

textual-serve draws the console with xterm.js on a canvas (its WebGL or canvas renderer), so the DOM holds
no rows of text: the page's text is read from xterm.js's own screen buffer. A script injected before the
page loads keeps a reference to the terminal object when textual's page creates it.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from kvmesh.node.lab.launcher import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-port=0", "--window-size=1280,800",
]
# Keeps the page's xterm.js Terminal (assigned as `this.terminal = new Terminal(...)`) in window.__kvmTerm.
HOOK = """
Object.defineProperty(Object.prototype, "terminal", {
  configurable: true,
  get() { return undefined; },
  set(v) {
    Object.defineProperty(this, "terminal", {value: v, writable: true, configurable: true, enumerable: true});
    if (v && v.buffer && !window.__kvmTerm) { window.__kvmTerm = v; }
  },
});
"""
SCREEN_TEXT = """(() => {
  const t = window.__kvmTerm; if (!t) return "";
  const b = t.buffer.active, out = [];
  for (let i = 0; i < t.rows; i++) { const l = b.getLine(b.viewportY + i); out.push(l ? l.translateToString(true) : ""); }
  return out.join("\\n");
})()"""

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (Debian package 'chromium'; `make test` installs it as root)"
)


def wait_port(port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


class DevTools:
    """A minimal DevTools protocol client over one browser websocket (flattened target sessions)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.session: str | None = None

    def call(self, method: str, params: dict[str, Any] | None = None, *, browser: bool = False) -> dict[str, Any]:
        msg: dict[str, Any] = {"id": next(self.ids), "method": method, "params": params or {}}
        if self.session and not browser:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv(timeout=30))
            if reply.get("id") == msg["id"]:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"].get("value")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """`kvmesh-console --serve` on a free loopback port, playing the synthetic mesh, opening the demo view."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.console", "--serve", "--port", str(port), "--demo", "--view", "demo", "--utc"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_port(port, 60)
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the console it started for the page
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    assert CHROMIUM is not None
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        active = profile / "DevToolsActivePort"
        end = time.monotonic() + 60
        while not (active.exists() and len(active.read_text().split()) >= 2) and time.monotonic() < end:
            time.sleep(0.2)
        port, path = active.read_text().split()[:2]
        with connect(f"ws://127.0.0.1:{port}{path}", max_size=64 << 20, open_timeout=30) as ws:
            yield DevTools(ws)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def test_browser_view_renders_the_demo_view_read_only(served: str, browser: DevTools, tmp_path: Path) -> None:
    """The served console, opened in headless Chromium, renders the demo view's counters, marked RO (read-only)."""
    target = browser.call("Target.createTarget", {"url": "about:blank"}, browser=True)["targetId"]
    browser.session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                   browser=True)["sessionId"]
    browser.call("Page.enable")
    browser.call("Page.addScriptToEvaluateOnNewDocument", {"source": HOOK})
    browser.call("Emulation.setDeviceMetricsOverride",
                 {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    browser.call("Page.navigate", {"url": served})
    text = ""
    end = time.monotonic() + 90
    while time.monotonic() < end:
        text = browser.evaluate(SCREEN_TEXT) or ""
        # The counters have rendered once the warm percentage carries a total of handoffs.
        if "WARM % of" in text and "Handoffs as they happen" in text and "sess-" in text:
            break
        time.sleep(0.5)
    shot = browser.call("Page.captureScreenshot", {"format": "png"})["data"]
    png = tmp_path / "browser-demo-view.png"
    png.write_bytes(base64.b64decode(shot))
    if os.environ.get("KVMESH_SCREENSHOT_DIR"):
        shutil.copy(png, Path(os.environ["KVMESH_SCREENSHOT_DIR"]) / png.name)
    for expected in ("kvmesh", " RO ", "● WARM", "◐ PART", "○ COLD", "WARM % of", "Links: replica throughput",
                     "node-1→node-2", "Handoffs as they happen", "Main view"):
        assert expected in text, f"{expected!r} not on the page; page text:\n{text}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
