"""nginx, as operators put it in front of llama-servers: a session-sticky or round-robin proxy.

`Proxy` writes its own config into a work folder (no system paths), starts `nginx -g 'daemon
off;'` on a free loopback port, and stops it by its PID. Sticky is nginx's consistent hash of
the `X-Session-Id` header (what production-stack's session router does); streams pass through
unbuffered and a failed upstream is never retried on the other host (a retry would hide an
error and prefill the prompt twice). `ensure_installed` installs Debian's nginx when it is
missing and we are root, as `make test` does for chromium.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from kvmesh.node.lab.launcher import free_port


class NginxMissing(FileNotFoundError):
    """No nginx binary, and it could not be installed."""


def ensure_installed() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "nginx-light"], check=False, env=env, capture_output=True)
        if os.access("/usr/sbin/nginx", os.X_OK):
            return "/usr/sbin/nginx"
    raise NginxMissing("nginx is not installed (apt-get install nginx-light, as root)")


def config(port: int, upstreams: list[str], policy: str) -> str:
    """nginx.conf for one proxy: `policy` "sticky" (hash of X-Session-Id) or "round_robin"."""
    if policy not in ("sticky", "round_robin"):
        raise ValueError(f"policy {policy!r}: sticky or round_robin")
    balance = "    hash $http_x_session_id consistent;\n" if policy == "sticky" else ""
    servers = "".join(f"    server {u};\n" for u in upstreams)
    return f"""worker_processes 1;
pid nginx.pid;
error_log error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path tmp/body; proxy_temp_path tmp/proxy; fastcgi_temp_path tmp/fcgi;
  uwsgi_temp_path tmp/uwsgi; scgi_temp_path tmp/scgi;
  client_max_body_size 64m;
  upstream hosts {{
{balance}{servers}    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://hosts;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 3600s;
      proxy_send_timeout 3600s;
      proxy_next_upstream off;
    }}
  }}
}}
"""


class Proxy:
    """One nginx on 127.0.0.1 in front of `upstreams` (host:port); `url` once started."""

    def __init__(self, work: Path, upstreams: list[str], policy: str) -> None:
        self.work, self.upstreams, self.policy = work, upstreams, policy
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> Proxy:
        binary = ensure_installed()
        self.port = free_port()
        (self.work / "tmp").mkdir(parents=True, exist_ok=True)
        conf = self.work / "nginx.conf"
        conf.write_text(config(self.port, self.upstreams, self.policy))
        self.proc = subprocess.Popen([binary, "-p", str(self.work), "-c", str(conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self._errors()}")
            try:
                httpx.get(f"{self.url}/health", timeout=2.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"nginx did not answer within {timeout_s:.0f} s: {self._errors()}")

    def _errors(self) -> str:
        try:
            return (self.work / "error.log").read_text()[-2000:]
        except OSError:
            return "(no error log)"

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGQUIT)  # graceful: nginx's own workers end with their master
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
