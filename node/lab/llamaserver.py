"""llama.cpp's own `llama-server`, built from the sdist kvmesh runs, and started for the benches.

The llama-cpp-python sdist vendors llama.cpp's full source (`vendor/llama.cpp`, the commit the
binding compiles), so the server kvmesh is compared with is the same llama.cpp as kvmesh's
engine. `build` runs CMake on it with no network (no prebuilt web UI, no OpenSSL) into a cache
folder keyed by the binding's version and the CMake arguments; `make llama-server` calls it.

    python -m kvmesh.node.lab.llamaserver build [CMAKE_ARGS...]   # idempotent; prints the binary
    python -m kvmesh.node.lab.llamaserver path                    # the binary, or exit 1

`LlamaServer` runs one as a child process on loopback, pinned to given cores, and stops it. Its
weights are repacked or not as the caller says (`--repack` / `--no-repack`): a bench passes the
choice kvmesh's engine made on this host (node.engine.repack), so both sides run the same kernels
and neither segfaults on an AMX host.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

from kvmesh.node.engine.vocab import LLAMA_CPP_PYTHON, download_sdist
from kvmesh.node.lab.launcher import free_port, pinned

_BASE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DBUILD_SHARED_LIBS=OFF")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the bench that started it dies (Linux's PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class LlamaServerMissing(FileNotFoundError):
    """No llama-server binary where kvmesh looks; the message says how to build one."""


def cache_root() -> Path:
    env = os.environ.get("KVMESH_LLAMA_SERVER_DIR")
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(env) if env else base / "kvmesh" / "llama-server"


def _cmake_args(extra: list[str] | None) -> list[str]:
    """The build's CMake arguments: ours, then CMAKE_ARGS from the environment (e.g. -DGGML_CUDA=on),
    then the caller's; later ones win in CMake."""
    return [*_BASE_ARGS, *shlex.split(os.environ.get("CMAKE_ARGS", "")), *(extra or [])]


def binary_path(extra: list[str] | None = None) -> Path:
    """Where the build for these CMake arguments lives (whether or not it is built yet)."""
    key = hashlib.blake2b("\0".join(_cmake_args(extra)).encode(), digest_size=6).hexdigest()
    return cache_root() / f"{LLAMA_CPP_PYTHON}-{key}" / "llama-server"


def find() -> Path:
    """`KVMESH_LLAMA_SERVER` (a binary), else the cached CPU build; LlamaServerMissing otherwise."""
    env = os.environ.get("KVMESH_LLAMA_SERVER")
    p = Path(env) if env else binary_path()
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise LlamaServerMissing(f"no llama-server at {p}: run `make llama-server` (it builds llama.cpp's server "
                                 f"from the llama-cpp-python {LLAMA_CPP_PYTHON} sdist, 10-30 min on 2 cores), "
                                 "or set KVMESH_LLAMA_SERVER to a binary")
    return p


def build(extra: list[str] | None = None, jobs: int | None = None) -> Path:
    """Build llama-server (a no-op when this configuration is built); returns the binary.

    The binary lands under a temp name and is renamed, so an interrupted build leaves nothing
    that `find` would take for a server."""
    dest = binary_path(extra)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    jobs = jobs or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="kvmesh-llama-server-", dir=dest.parent) as tmp:
        work = Path(tmp)
        with tarfile.open(download_sdist(work)) as tar:
            members = [m for m in tar if "/vendor/llama.cpp/" in m.name]
            tar.extractall(work, members=members, filter="data")
        (src,) = work.glob("llama_cpp_python-*/vendor/llama.cpp")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(src), "-B", str(work / "build"), *gen, *_cmake_args(extra)], check=True)
        subprocess.run(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
        part = dest.with_suffix(".part")
        shutil.copy2(work / "build" / "bin" / "llama-server", part)
        part.replace(dest)
    return dest


class LlamaServer:
    """One llama-server child: `slots` slots of `ctx_per_slot` tokens each, its own cores, prompt
    cache in RAM (`--cache-ram`); on loopback, or behind `prefix` (a network namespace) listening on
    `bind` and reached at `host`. `url` once started; `stop` ends it (and only it). Start it from a thread
    that outlives it: the kernel's parent-death signal fires when the starting thread ends."""

    def __init__(self, model: Path, *, slots: int, ctx_per_slot: int, threads: int, cores: set[int] | None = None,
                 cache_ram_mib: int = 8192, host: str = "127.0.0.1", log: Path | None = None,
                 extra: list[str] | None = None, prefix: list[str] | None = None, bind: str | None = None,
                 repack: bool) -> None:
        self.model, self.slots, self.ctx_per_slot, self.threads = model, slots, ctx_per_slot, threads
        self.repack = repack
        self.cores, self.cache_ram_mib, self.host, self.extra = cores, cache_ram_mib, host, extra or []
        self.log = log
        self.prefix, self.bind = prefix or [], bind or host  # e.g. `ip netns exec NS`, listening on 0.0.0.0 there
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        # -c is shared by the -np slots (no -kvu), so slots x ctx gives each slot ctx_per_slot
        return [str(find()), "-m", str(self.model), "-c", str(self.slots * self.ctx_per_slot), "-np", str(self.slots),
                "-t", str(self.threads), "-tb", str(self.threads), "--host", self.bind, "--port", str(self.port),
                "--cache-ram", str(self.cache_ram_mib), "--no-webui", "--metrics", "-fa", "on",
                "--repack" if self.repack else "--no-repack", *self.extra]

    def start(self, timeout_s: float = 180.0) -> LlamaServer:
        self.port = free_port("127.0.0.1") if self.prefix else free_port(self.host)  # another namespace: any port is free there
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115  # closed below; the child holds its copy
        try:
            # Its own session (a Ctrl-C at the bench's terminal is the bench's to handle), and SIGTERM when the
            # bench dies however it dies (node.lab.bench.reaper stops it on a signal; this covers SIGKILL).
            self.proc = subprocess.Popen([*self.prefix, *pinned(self.cores), *self.argv()], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} at start; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"llama-server did not become healthy within {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        """SIGTERM its process group (a netns prefix's `ip` and the server alike), then SIGKILL after 10 s."""
        p, self.proc = self.proc, None
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # anything it left in its group


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        print(build(argv[1:]))
        return 0
    if argv == ["path"]:
        try:
            print(find())
        except LlamaServerMissing as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    print("usage: python -m kvmesh.node.lab.llamaserver build [CMAKE_ARGS...] | path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
