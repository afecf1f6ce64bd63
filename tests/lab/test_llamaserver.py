"""make llama-server's build cache: where a build lives, what finds it, and the server's command line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmesh.node.lab import llamaserver
from kvmesh.node.lab.llamaserver import LlamaServer, LlamaServerMissing


def test_build_path_is_keyed_by_cmake_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CUDA build (CMAKE_ARGS) and a CPU build never share a cache folder; both sit under the cache root."""
    monkeypatch.setenv("KVMESH_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    cpu = llamaserver.binary_path()
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=on")
    cuda = llamaserver.binary_path()
    assert cpu != cuda and cpu.parent.parent == cuda.parent.parent == tmp_path
    assert cpu.name == "llama-server" and cpu.parent.name.startswith(llamaserver.LLAMA_CPP_PYTHON)


def test_missing_binary_says_how_to_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No build: the error names `make llama-server`; KVMESH_LLAMA_SERVER picks a given binary."""
    monkeypatch.setenv("KVMESH_LLAMA_SERVER_DIR", str(tmp_path))
    monkeypatch.delenv("KVMESH_LLAMA_SERVER", raising=False)
    with pytest.raises(LlamaServerMissing, match="make llama-server"):
        llamaserver.find()
    fake = tmp_path / "my-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVMESH_LLAMA_SERVER", str(fake))
    assert llamaserver.find() == fake
    assert llamaserver.main(["path"]) == 0 and llamaserver.main(["bogus"]) == 2


def test_argv_gives_each_slot_its_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """-c is shared by the -np slots, so it is slots x context; threads, prompt cache and flash attention as asked."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVMESH_LLAMA_SERVER", str(fake))
    argv = LlamaServer(Path("m.gguf"), slots=4, ctx_per_slot=8192, threads=1, cache_ram_mib=2048, repack=True).argv()
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert argv[0] == str(fake) and opts["-m"] == "m.gguf" and opts["-c"] == str(4 * 8192) and opts["-np"] == "4"
    assert opts["-t"] == opts["-tb"] == "1" and opts["--cache-ram"] == "2048" and opts["-fa"] == "on"
    assert "--repack" in argv and "--no-repack" not in argv


def test_argv_follows_the_weight_buffer_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host where kvmesh keeps weights in the plain buffer starts llama-server with --no-repack too."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVMESH_LLAMA_SERVER", str(fake))
    argv = LlamaServer(Path("m.gguf"), slots=1, ctx_per_slot=512, threads=1, repack=False).argv()
    assert "--no-repack" in argv and "--repack" not in argv
    assert os.access(fake, os.X_OK)
