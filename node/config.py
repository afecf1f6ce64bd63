"""A host's configuration: one TOML file per host, validated with pydantic.

A bad file is refused at start with a message naming each field and reason.
Command-line flags override the common fields (see `node.cli`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from node.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimConfig(_Strict):
    """Cost model of the sim engine (defaults: the field report's scale)."""

    prefill_tps: float = Field(20000.0, gt=0, description="prefill tokens/s")
    decode_tps: float = Field(60.0, gt=0, description="decode tokens/s per slot")
    kv_bytes_per_token: int = Field(20480, gt=0, description="KV bytes per token at scale 1.0 (~1 GB per 50k tokens)")
    kv_scale: float = Field(1.0, gt=0, le=1.0, description="shrinks KV bytes per token by this factor")
    max_context: int = Field(131072, gt=0)

    def scaled_kv_bytes_per_token(self) -> int:
        # Whole 16-byte words, so block bytes tile with the block hash.
        return max(16, int(self.kv_bytes_per_token * self.kv_scale) // 16 * 16)


class EngineConfig(_Strict):
    kind: Literal["tiny", "sim"] = "tiny"
    model_name: str = Field("", description="served model id; defaults to kvmesh-<kind>")
    slots: int = Field(4, ge=1, le=256)
    queue_max: int = Field(64, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    block_size: int = Field(256, ge=16, le=4096)
    cache_bytes: int = Field(1 << 30, gt=0, description="KV pool size: the byte budget for resident caches")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: int = Field(32768, ge=64, description="torch engine context limit (tokens)")
    prefill_chunk: int = Field(2048, ge=16)
    first_chunk: int = Field(16384, ge=16)
    sim: SimConfig = SimConfig()

    @property
    def served_model(self) -> str:
        return self.model_name or f"kvmesh-{self.kind}"


class ApiConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8 << 20, gt=0)


class NodeConfig(_Strict):
    name: str = Field("node-1", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    api: ApiConfig = ApiConfig()
    engine: EngineConfig = EngineConfig()

    @field_validator("name")
    @classmethod
    def _no_dots_only(cls, v: str) -> str:
        if set(v) <= {"."}:
            raise ValueError("must contain a letter or digit")
        return v


def describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: dict[str, object] | None = None) -> NodeConfig:
    """Read a TOML file (or defaults), apply dotted-key overrides, validate."""
    data: dict[str, object] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})  # type: ignore[assignment]
        node[leaf] = value  # type: ignore[index]
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, source)) from None
