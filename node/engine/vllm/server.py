"""The vLLM server process a node drives: started on loopback, watched, stopped (kind "vllm").

A separate process, not AsyncLLM in the node: vLLM brings its own torch and CUDA pins, threads and
worker processes, and may live in its own venv (`make vllm`: .venv-vllm); a crash of it fails the
turns in flight (the API answers 503) and never takes the node down. It runs in its own process
group, so stopping it ends its engine core and workers too.

The connector (node.engine.vllm.connector) reaches vLLM as the package `kvmesh_vllm`: a link in the
run folder to this package, on vLLM's PYTHONPATH, so vLLM's venv needs nothing of kvmesh installed.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmesh.node.errors import ConfigError

log = logging.getLogger("kvmesh.engine.vllm")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def vllm_python(configured: str) -> str:
    """The Python that runs vLLM: as configured, else the repository's .venv-vllm, else this one."""
    if configured:
        return configured
    local = REPO / ".venv-vllm" / "bin" / "python"
    return str(local) if local.is_file() else sys.executable


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the node's process dies, however it dies (Linux's
    PR_SET_PDEATHSIG), so a killed node never leaves a vLLM holding gigabytes behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launch:
    """Everything one vLLM server is started with."""

    python: str
    model_dir: Path
    served_name: str
    dtype: str  # "float32", "bfloat16", ...
    max_context: int
    slots: int
    pool: Path
    block_size: int  # kvmesh's
    vllm_block: int
    run_dir: Path
    cache_dir: Path
    kvcache_gib: int = 1
    cpu_cores: str = ""
    extra_args: list[str] = field(default_factory=list)

    def transfer_config(self) -> dict[str, object]:
        return {"kv_connector": "KvmeshConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "kvmesh_vllm.connector", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"pool": str(self.pool), "block_size": self.block_size}}

    def argv(self, port: int) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
                "--model", str(self.model_dir), "--served-model-name", self.served_name, "--dtype", self.dtype,
                "--enforce-eager", "--block-size", str(self.vllm_block), "--max-model-len", str(self.max_context),
                "--max-num-seqs", str(max(1, self.slots)), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(self.transfer_config()),
                # Constraints are llguidance grammars (node.engine.constraint): with "auto", vLLM tries xgrammar
                # first, which would read the same text with other semantics or refuse it.
                "--structured-outputs-config", json.dumps({"backend": "guidance"}), *self.extra_args]

    def env(self) -> dict[str, str]:
        pkg = self.run_dir / "pkg"
        pkg.mkdir(parents=True, exist_ok=True)
        link = pkg / "kvmesh_vllm"
        if not link.exists():
            link.symlink_to(HERE, target_is_directory=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(PYTHONPATH=str(pkg), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CACHE_ROOT=str(self.cache_dir / "vllm"),
                   TORCHINDUCTOR_CACHE_DIR=str(self.cache_dir / "inductor"), TMPDIR=str(self.run_dir),
                   VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_gib), VLLM_SERVER_DEV_MODE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1")
        if self.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        return env


class VllmServer:
    """One vLLM OpenAI server: `start` waits until it serves (or says why it did not), `stop` ends it."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = launch.run_dir / "vllm.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float) -> None:
        """Start it (again: the exited one is reaped first) and wait until it serves."""
        if self.proc is not None:
            self.stop()
        self.port = free_port()
        self.launch.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.launch.argv(self.port), env=self.launch.env(), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         cwd=self.launch.run_dir, preexec_fn=_die_with_parent)
        log.info("vLLM starting (pid %d, port %d, log %s)", self.proc.pid, self.port, self.log_path)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ConfigError(f"vLLM exited with status {self.proc.returncode} before it served: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("vLLM serves %s on port %d", self.launch.served_name, self.port)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ConfigError(f"vLLM did not serve within {timeout_s:g}s: {self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return " | ".join(tail)

    def stop(self, timeout_s: float = 20.0) -> None:
        """End the server's process group (its engine core and workers with it): SIGTERM, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children the server left behind
        except ProcessLookupError:
            pass
