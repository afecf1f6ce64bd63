"""Raw single-stream TCP between two hosts: the yardstick kv_share is measured against.

`python -m kvmesh.node.lab.bench.rawtcp recv HOST PORT BYTES` receives into a pre-touched
buffer and prints the seconds from first to last byte; `... send HOST PORT BYTES`
sends 4 MiB slices of a pre-touched buffer with sendall. Same buffer sizes and
socket options as kv_share, so the comparison is like for like.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from kvmesh.node.lab.launcher import free_port

CHUNK = 4 << 20
SOCK_BUF = 4 << 20


def recv(host: str, port: int, nbytes: int, ready: Callable[[], object] | None = None) -> float:
    buf = np.ones(CHUNK, dtype=np.uint8)  # pre-touched
    view = memoryview(buf)  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree
    with socket.create_server((host, port)) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
        if ready is not None:
            ready()
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            got = 0
            t0 = None
            while got < nbytes:
                n = conn.recv_into(view[: min(CHUNK, nbytes - got)])
                if not n:
                    raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                if t0 is None:
                    t0 = time.monotonic()
                got += n
            secs = time.monotonic() - (t0 or time.monotonic())
            conn.sendall(b"k")
    return secs


def send(host: str, port: int, nbytes: int) -> float:
    buf = np.ones(CHUNK, dtype=np.uint8)
    view = memoryview(buf)  # type: ignore[arg-type]  # ndarrays are buffers; numpy's stubs disagree
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.monotonic()
        sent = 0
        while sent < nbytes:
            n = min(CHUNK, nbytes - sent)
            sock.sendall(view[:n])
            sent += n
        sock.recv(1)
        return time.monotonic() - t0


def measure(nbytes: int, recv_prefix: list[str], send_prefix: list[str], host: str) -> float:
    """Seconds to move nbytes over one TCP stream, receiver and sender each run as a
    process under its prefix (e.g. `ip netns exec NS`)."""
    port = free_port() if not recv_prefix else 7100
    rx = subprocess.Popen([*recv_prefix, sys.executable, "-m", "kvmesh.node.lab.bench.rawtcp", "recv", host, str(port), str(nbytes)],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("raw TCP receiver did not start")
        subprocess.run([*send_prefix, sys.executable, "-m", "kvmesh.node.lab.bench.rawtcp", "send", host, str(port), str(nbytes)],
                       check=True, capture_output=True, timeout=300)
        out, _ = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
    return float(out.split()[-1])


if __name__ == "__main__":
    mode, h, p, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    secs = recv(h, p, n) if mode == "recv" else send(h, p, n)
    print(f"seconds {secs:.6f}", flush=True)
