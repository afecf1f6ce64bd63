"""`make gpu-check`: the CUDA build flags, the commands it runs (each one kvmesh's CLI accepts), and its skip without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.node.cli import build_parser
from kvmesh.node.lab import gpucheck, llamaserver


def _steps() -> dict[str, gpucheck.Step]:
    return {s.name: s for s in gpucheck.plan("/venv/bin/python", jobs=16)}


def test_builds_are_cuda_builds() -> None:
    """llama-cpp-python is compiled from its sdist with GGML_CUDA on, llama-server with the same CMake flags, vLLM is PyPI's CUDA build."""
    steps = _steps()
    lcp = steps["llama-cpp-python (CUDA)"]
    assert "-DGGML_CUDA=on" in lcp.env["CMAKE_ARGS"].split() and lcp.env["CMAKE_BUILD_PARALLEL_LEVEL"] == "16"
    assert lcp.argv[:4] == ["/venv/bin/python", "-m", "pip", "install"]
    assert "--force-reinstall" in lcp.argv and lcp.argv[lcp.argv.index("--no-binary") + 1] == "llama-cpp-python"
    assert lcp.argv[-1] == f"llama-cpp-python=={llamaserver.LLAMA_CPP_PYTHON}"  # the version kvmesh's server build vendors
    server = steps["llama-server (CUDA)"]
    assert server.env["CMAKE_ARGS"] == lcp.env["CMAKE_ARGS"] and server.argv[-2:] == ["kvmesh.node.lab.llamaserver", "build"]
    assert steps["vLLM (CUDA)"].argv == ["make", "vllm", "VLLM_PACKAGE=vllm"]
    assert steps["vLLM (CUDA)"].parallel and server.parallel  # the three overlap, within the build budget
    assert all(s.timeout_s <= gpucheck.BUILD_BUDGET_S for s in steps.values() if not s.bench)


def test_bench_steps_are_commands_kvmesh_accepts() -> None:
    """Each bench step parses with kvmesh's own CLI; the engine bench offloads every layer on both sides and compares both servers."""
    benches = [s for s in gpucheck.plan("/venv/bin/python", jobs=4) if s.bench]
    assert [s.argv[4] for s in benches] == ["exactness", "ttft", "engine"]
    for s in benches:
        assert s.argv[1:4] == ["-m", "kvmesh.node.cli", "bench"] and "--json" in s.argv
        args = build_parser().parse_args(s.argv[3:])
        assert args.bench == s.argv[4]
    engine = build_parser().parse_args(benches[2].argv[3:])
    assert engine.against == "llama-server,vllm" and engine.gpu_layers == -1
    assert "vllm" in build_parser().parse_args(benches[0].argv[3:]).kinds.split(",")
    assert build_parser().parse_args(benches[1].argv[3:]).engine == "vllm"


def test_engine_bench_finds_the_cuda_llama_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The engine bench's environment keys llama-server's cache folder as the build step's does: it runs the CUDA binary."""
    steps = _steps()
    monkeypatch.setenv("KVMESH_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.setenv("CMAKE_ARGS", steps["llama-server (CUDA)"].env["CMAKE_ARGS"])
    built = llamaserver.binary_path()
    monkeypatch.setenv("CMAKE_ARGS", steps["engine"].env["CMAKE_ARGS"])
    assert llamaserver.binary_path() == built
    monkeypatch.delenv("CMAKE_ARGS")
    assert llamaserver.binary_path() != built  # not the CPU build's folder


def test_no_gpu_is_a_skip_that_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Without nvidia-smi: exit 0, a JSON line naming the reason, nothing run; --require-gpu makes it exit 1."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(gpucheck, "_run_all", lambda *a: pytest.fail("ran steps without a GPU"))
    assert gpucheck.main([]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out.strip().splitlines()[-1])
    assert res["skipped"] is True and "nvidia-smi" in res["reason"] and "SKIP" in err
    assert gpucheck.main(["--require-gpu"]) == 1


def test_gpu_without_cuda_compiler_skips_naming_nvcc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A driver that lists a GPU but no CUDA toolkit: the skip names nvcc, since llama.cpp's CUDA build needs it."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(gpucheck, "nvcc", lambda: None)
    ok, why = gpucheck.gpu_present()
    assert not ok and "nvcc" in why and "H200" in why
    monkeypatch.setattr(gpucheck, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert gpucheck.gpu_present() == (True, "GPU 0: NVIDIA H200 (UUID: GPU-x)")
