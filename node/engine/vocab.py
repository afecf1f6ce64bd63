"""Real tokenizers and chat templates for tests and benches, without downloading a model.

llama.cpp ships vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`: a real model's
tokenizer, merges and `tokenizer.chat_template`, no weights) with its tokenizer test pairs
(`.inp`/`.out`), and the llama-cpp-python sdist carries them. `fetch` takes the few kvmesh
uses out of that sdist (pip's own download, so pip's cache and index settings apply) into
`<venv>/share/kvmesh/vocab`; `make test` runs it once. `vocab_path` finds a file there, or
under `KVMESH_VOCAB_DIR`.

    python -m kvmesh.node.engine.vocab fetch     # idempotent; prints the folder
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the binding whose vendored llama.cpp the vocabularies come from
NAMES = ("llama-spm", "llama-bpe", "qwen2", "qwen35", "phi-3", "gemma-4")


class VocabMissing(FileNotFoundError):
    """A vocabulary file is not where kvmesh looks; the message says how to get it."""


def vocab_dir() -> Path:
    env = os.environ.get("KVMESH_VOCAB_DIR")
    return Path(env) if env else Path(sys.prefix) / "share" / "kvmesh" / "vocab"


def vocab_path(name: str) -> Path:
    """`ggml-vocab-<name>.gguf` (or a test pair, e.g. name 'qwen2', suffix via the returned path)."""
    p = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not p.is_file():
        raise VocabMissing(f"{p} is missing: run `python -m kvmesh.node.engine.vocab fetch` (make test does)")
    return p


def _wanted(member: str) -> str | None:
    base = member.rsplit("/", 1)[-1]
    for n in NAMES:
        if base in (f"ggml-vocab-{n}.gguf", f"ggml-vocab-{n}.gguf.inp", f"ggml-vocab-{n}.gguf.out"):
            return base
    return None


def download_sdist(folder: Path) -> Path:
    """llama-cpp-python's sdist (the version kvmesh runs) into `folder`, by pip, so pip's cache
    and index settings apply; returns the archive's path. The vocabularies and `make
    llama-server` (node.lab.llamaserver) both come from it."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    "-d", str(folder), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    (sdist,) = folder.glob("llama_cpp_python-*.tar.gz")
    return sdist


def fetch(dest: Path | None = None) -> Path:
    """Extract the vocabularies into `dest` (default `vocab_dir()`); a no-op when all are there.

    Each file lands under a temp name and is renamed, so an interrupted fetch leaves no
    half-written vocabulary behind."""
    dest = dest or vocab_dir()
    if all((dest / f"ggml-vocab-{n}.gguf").is_file() for n in NAMES):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvmesh-vocab-") as tmp:
        with tarfile.open(download_sdist(Path(tmp))) as tar:
            for m in tar:
                base = _wanted(m.name) if m.isfile() and "/vendor/llama.cpp/models/" in m.name else None
                src = tar.extractfile(m) if base else None
                if base is None or src is None:
                    continue
                part = dest / f".{base}.part"
                try:
                    part.write_bytes(src.read())
                    part.replace(dest / base)
                finally:
                    part.unlink(missing_ok=True)  # gone after the rename; after a failure, nothing half-written stays
    missing = [n for n in NAMES if not (dest / f"ggml-vocab-{n}.gguf").is_file()]
    if missing:
        raise VocabMissing(f"llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist lacks {', '.join(missing)}")
    return dest


if __name__ == "__main__":
    if sys.argv[1:] != ["fetch"]:
        sys.exit("usage: python -m kvmesh.node.engine.vocab fetch")
    print(fetch())
