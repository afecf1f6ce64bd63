"""A host's configuration: one TOML file per host, validated with pydantic.

A bad file is refused at start with a message naming each field and reason.
Command-line flags override the common fields (see `node.cli`).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from kvmesh.node.errors import ConfigError
from kvmesh.node.modelnames import gguf_name, is_gguf

HOST_NAME_PATTERN = r"^[A-Za-z0-9._-]+$"  # a host's name (1-64 of these): in file names, URLs and the console


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimConfig(_Strict):
    """Cost model of the sim engine (defaults: the field report's scale)."""

    prefill_tps: float = Field(20000.0, gt=0, description="prefill tokens/s")
    decode_tps: float = Field(60.0, gt=0, description="decode tokens/s per slot")
    kv_bytes_per_token: int = Field(20480, gt=0, description="KV bytes per token at scale 1.0 (~1 GB per 50k tokens)")
    kv_scale: float = Field(1.0, gt=0, le=1.0, description="shrinks KV bytes per token by this factor")
    max_context: int = Field(131072, gt=0)
    # Test only: a fixed reply, so an API test can see a given text (a tool call) come back
    # through the real turn path; prefill, decode and KV stay the sim's. Unset in service.
    scripted_reply: str | None = Field(None, min_length=1, max_length=65536,
                                       description="test only: every reply is this text (printable ASCII, newlines)")

    @field_validator("scripted_reply")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        # The byte tokenizer lets the sim emit printable ASCII and newlines only.
        if v is not None and any(not (" " <= c <= "~" or c == "\n") for c in v):
            raise ValueError("scripted_reply must be printable ASCII and newlines")
        return v

    def scaled_kv_bytes_per_token(self) -> int:
        # Whole 16-byte words, so block bytes tile with the block hash.
        return max(16, int(self.kv_bytes_per_token * self.kv_scale) // 16 * 16)


class LlamaCppConfig(_Strict):
    """The llama.cpp engine (kind "llamacpp"): threads, batch sizes, context, offload, attention.

    Defaults suit a CPU build; on a GPU build set gpu_layers (-1: all) and larger batches."""

    threads: int = Field(0, ge=0, description="decode threads (0: the CPU cores this process may use)")
    threads_batch: int = Field(0, ge=0, description="prefill threads (0: same as threads)")
    n_batch: int = Field(2048, ge=32, description="tokens per llama_decode call during prefill")
    n_ubatch: int = Field(512, ge=32, description="tokens per compute micro-batch")
    gpu_layers: int = Field(0, ge=-1, description="layers offloaded to a GPU build's device (-1: all)")
    flash_attn: bool = Field(True, description="flash attention: V is stored row-wise, and a restored "
                             "cache gives the same logits wherever its cells land")
    type_k: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = "f16"
    type_v: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = "f16"
    use_mmap: bool = True
    extra_bufts: Literal["auto"] | bool = Field("auto", description="llama.cpp's repacked weight buffers (REPACK, "
                                               "AMX): true, false, or 'auto': on, except on CPUs that report AMX_INT8, "
                                               "where they segfault (llama.cpp#20824; node.engine.repack)")
    swa: Literal["full", "window"] = Field("full", description="a sliding-window model's cache (Gemma 2/3, gpt-oss): "
                                           "'full' keeps every position of its window layers, so blocks restore "
                                           "exactly at a full-attention cache's memory; 'window' keeps the last "
                                           "window only (llama.cpp's default): blocks hold the full-attention "
                                           "layers, and the window layers travel as a snapshot at each prompt's "
                                           "last block boundary (node.engine.snapshots)")
    snapshot_mib: int = Field(512, ge=16, description="swa 'window' and hybrid models: memory for snapshots "
                              "(window caches, recurrent states), this host's and its peers', least recently used dropped first")


class VllmConfig(_Strict):
    """The vLLM engine (kind "vllm"): a vLLM OpenAI server process the node starts on loopback (node.engine.vllm)."""

    python: str = Field("", description="the Python that has vllm (default: .venv-vllm/bin/python beside the code, "
                        "else this Python)")
    vllm_block: int = Field(128, ge=16, description="vLLM's block in tokens; engine.block_size is a multiple of it")
    kvcache_gib: int = Field(1, ge=1, description="vLLM's own paged cache (VLLM_CPU_KVCACHE_SPACE on CPU; on a "
                               "GPU vLLM sizes it by gpu_memory_utilization)")
    cpu_cores: str = Field("", description="VLLM_CPU_OMP_THREADS_BIND: the cores its compute is pinned to ('0', '0-3'); "
                           "empty: vLLM's choice")
    extra_args: list[str] = Field(default_factory=list, description="more api_server flags (--tensor-parallel-size 2, ...)")
    start_timeout_s: float = Field(600.0, gt=0, description="how long vLLM may take to load and serve")
    cache_dir: str = Field("", description="converted models and vLLM's caches (default: ~/.cache/kvmesh/vllm)")


class EngineConfig(_Strict):
    kind: Literal["tiny", "sim", "torch", "llamacpp", "vllm"] = "tiny"
    model: str = Field("", description="kind 'torch': a local Hugging Face checkpoint directory (Llama, Qwen2, Qwen3); "
                       "kind 'llamacpp': a GGUF file, or a packaged model's alias (smollm2, gemma3-270m); "
                       "kind 'vllm': a checkpoint directory, or a packaged GGUF's alias (converted once)")
    model_name: str = Field("", description="served model id; defaults to the checkpoint directory's name, else kvmesh-<kind>")
    # Other names clients may ask for (exact, or globs such as "claude-*", "gpt-*"): coding agents
    # send their vendor's model names unless told otherwise. accept_any_model takes every name.
    served_names: list[str] = Field(default_factory=list, max_length=64)
    accept_any_model: bool = False
    slots: int = Field(4, ge=1, le=256)
    queue_max: int = Field(64, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0)
    block_size: int = Field(256, ge=16, le=4096)
    cache_bytes: int = Field(1 << 30, gt=0, description="KV pool size: the byte budget for resident caches")
    cache_tokens: int = Field(0, ge=0, description="KV pool size in tokens of context, sized from the model's own KV "
                              "bytes per token (0: cache_bytes decides)")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_context: int = Field(32768, ge=64, description="context limit per slot (tokens), torch and llamacpp engines")
    reuse_tail: bool | None = Field(None, description="a session's next turn reuses its own partial last block "
                                    "token by token. false: whole blocks only, as a replica holds, at up to "
                                    "block_size-1 more tokens of prefill per turn. true: every common token, though "
                                    "llama.cpp's logits then move with the shape of the batches that computed a "
                                    "position. Unset: true for torch and the sim; for llamacpp, the slot's own cells "
                                    "past the last block are kept where they compute exactly what whole blocks "
                                    "would (probed at start), else whole blocks")
    prefill_chunk: int = Field(2048, ge=16)
    first_chunk: int = Field(16384, ge=16)
    sim: SimConfig = SimConfig()
    llamacpp: LlamaCppConfig = LlamaCppConfig()
    vllm: VllmConfig = VllmConfig()

    @model_validator(mode="before")
    @classmethod
    def _gguf_means_llamacpp(cls, data: object) -> object:
        # A `.gguf` path or a packaged model's alias names a model only llama.cpp serves.
        if isinstance(data, dict) and "kind" not in data and is_gguf(str(data.get("model", ""))):
            return {**data, "kind": "llamacpp"}
        return data

    @model_validator(mode="after")
    def _model_matches_kind(self) -> EngineConfig:
        if self.kind == "torch" and not self.model:
            raise ValueError("engine.kind 'torch' needs engine.model: the path of a local Hugging Face checkpoint directory")
        if self.kind == "llamacpp" and not self.model:
            raise ValueError("engine.kind 'llamacpp' needs engine.model: the path of a GGUF file")
        if self.kind == "vllm" and not self.model:
            raise ValueError("engine.kind 'vllm' needs engine.model: a checkpoint directory or a packaged model's alias")
        if self.model and self.kind not in ("torch", "llamacpp", "vllm"):
            raise ValueError(f"engine.model is set but engine.kind is {self.kind!r}: set kind = \"torch\" to serve a "
                             "checkpoint directory, or \"llamacpp\" to serve a GGUF file")
        return self

    def accepts_model(self, name: str) -> bool:
        """Whether a request naming `name` is for this model: its id, a served name or glob, or any name."""
        return self.accept_any_model or name == self.served_model or any(
            fnmatch.fnmatchcase(name, pattern) for pattern in self.served_names)

    @property
    def tail_reused(self) -> bool:
        return self.reuse_tail if self.reuse_tail is not None else self.kind != "llamacpp"

    @property
    def served_model(self) -> str:
        if self.model_name:
            return self.model_name
        if self.kind == "llamacpp" or (self.kind == "vllm" and is_gguf(self.model)):
            return gguf_name(self.model)
        return Path(self.model).name if self.kind in ("torch", "vllm") else f"kvmesh-{self.kind}"


class TLSConfig(_Strict):
    """Optional TLS for a listener; `ca_file` verifies peers (their API and kv_share)."""

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    ca_file: str = Field("", description="CA bundle that signs the peers' certificates (default: the system store)")


class ApiConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(8 << 20, gt=0)
    tls: TLSConfig | None = None
    # Client API keys (also KVMESH_API_KEY, comma-separated): with any set, the client routes want
    # `Authorization: Bearer <key>` or `x-api-key: <key>`, and so do the cluster view, stats and event
    # stream (they name every session). Health, readiness and metrics stay open; admin and peer routes
    # have their own tokens.
    keys: list[SecretStr] = Field(default_factory=list)
    cors_origins: list[str] = Field(default_factory=list, description="origins browsers may call the API from ('*': any)")
    event_loop: Literal["asyncio", "uvloop"] = Field("asyncio", description="the node's event loop; uvloop needs "
                                                     "`pip install 'kvmesh[uvloop]'` (bench handoff --event-loop A/Bs it)")

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: list[SecretStr]) -> list[SecretStr]:
        for k in v:
            if len(k.get_secret_value()) < 8 or any(c.isspace() or c == "," for c in k.get_secret_value()):
                raise ValueError("an API key is at least 8 characters, with no whitespace or comma")
        return v

    def key_values(self) -> list[str]:
        """The accepted client keys: the configured ones and KVMESH_API_KEY's."""
        env = [k.strip() for k in os.environ.get("KVMESH_API_KEY", "").split(",") if k.strip()]
        return [k.get_secret_value() for k in self.keys] + env


class PeerConfig(_Strict):
    """A configured peer: only these addresses are ever forwarded to or replicated to."""

    name: str = Field(min_length=1, max_length=64, pattern=HOST_NAME_PATTERN)
    api: str = Field(pattern=r"^https?://[^/\s]+$", description="base URL of the peer's API, e.g. http://10.0.0.2:8000")
    kvshare: str = Field(pattern=r"^[^:\s]+:[0-9]{1,5}$", description="host:port of the peer's kv_share listener")


class MeshConfig(_Strict):
    peers: list[PeerConfig] = []
    # Where peers come from beside `peers`, read every `discovery_interval_s`: "dns" resolves `dns_name`
    # (A/AAAA records at `dns_port`, as a Kubernetes headless Service gives; or SRV records, for a name
    # starting with "_"); "kubernetes" lists `k8s_service`'s EndpointSlices (ready, not terminating).
    # Each host found is admitted only after a hello signed with the mesh secret (node.mesh.discovery).
    discovery: Literal["static", "dns", "kubernetes"] = "static"
    discovery_interval_s: float = Field(5.0, gt=0)
    dns_name: str = Field("", max_length=253)
    dns_port: int = Field(0, ge=0, le=65535, description="API port of hosts found by A/AAAA records (0: this node's)")
    k8s_service: str = Field("kvmesh", min_length=1, max_length=63)
    k8s_namespace: str = Field("", max_length=63, description="default: the pod's own (its service account's)")
    k8s_api: str = Field("", description="API server URL (default: in-cluster config, else the kubeconfig)")
    dns_server: str = Field("", pattern=r"^$|^[^:\s]+:[0-9]{1,5}$", description="host:port of the DNS server to ask "
                            "(default: the system's resolvers)")
    # Secrets are SecretStr: their repr, logs and validation errors never show them.
    secret: SecretStr | None = Field(None, min_length=16, description="mesh secret (HMAC key for peers and kv_share)")
    previous_secret: SecretStr | None = Field(None, min_length=16, description="still accepted, for rotation")

    def secrets(self) -> list[bytes]:
        """Accepted HMAC keys, current first."""
        return [s.get_secret_value().encode() for s in (self.secret, self.previous_secret) if s is not None]
    stale_after_s: float = Field(3.0, gt=0)
    # Peers' state is pushed (node.mesh.statefeed): each node subscribes to every peer's
    # /v1/peer/state stream and gets field-level deltas at most every push_interval_s, a heartbeat
    # every heartbeat_s; a peer that cannot stream is polled whole every poll_interval_s.
    push_state: bool = True
    push_interval_s: float = Field(0.25, gt=0)
    heartbeat_s: float = Field(1.0, gt=0)
    poll_interval_s: float = Field(0.5, gt=0)
    # Past this many hosts (this one included) a session's state goes only to its directory host
    # (node.mesh.directory), and an entry asks that host where the session is before placing a turn.
    directory_after_hosts: int = Field(16, ge=1)
    forward_timeout_s: float = Field(600.0, gt=0)
    # A move that cannot be warm (predicted reuse below warm_fraction) is taken only to a host running
    # nothing, when it pays for itself, and once waiting for the warm host is expected to take longer than this.
    cold_move_after_s: float = Field(30.0, ge=0)
    warm_fraction: float = Field(0.9, gt=0, le=1)
    # Where turns go (node.mesh.placement.choose_by): kvmesh's placement, or a baseline to A/B it against on
    # real hosts (or fall back to); the baselines push no replicas, as in `kvmesh sim`.
    policy: Literal["kvmesh", "session_hash", "kv_overlap", "least_loaded", "round_robin"] = "kvmesh"
    # A rack or zone label the console groups hosts by (`g`); "" for none.
    zone: str = Field("", max_length=64, pattern=r"^[\w.:/-]*$")
    # Under mesh.policy kvmesh, a turn no host can start within admit_wait_s of queueing for a slot (a new
    # session's first turn: admit_new_wait_s) is refused as overloaded: 429 with a Retry-After of at most 60 s
    # (Anthropic's dialect: 529 overloaded_error), which the SDKs honour, and a place in line kept for its retry;
    # a turn that could not start within admit_client_timeout_s (the SDKs' attempt timeout) gets no place
    # (node.mesh.admission).
    admission: bool = True
    admit_wait_s: float = Field(60.0, gt=0)
    admit_new_wait_s: float = Field(60.0, gt=0)
    admit_client_timeout_s: float = Field(600.0, gt=0)
    # A session id names an affinity group; each conversation under it (a subagent's, a side request's)
    # keeps its own cache, replica and handoffs (node.mesh.threads). A session keeps at most this many.
    max_threads: int = Field(16, ge=2, le=1024)

    @model_validator(mode="after")
    def _heartbeat_within_staleness(self) -> MeshConfig:
        if self.push_state and self.heartbeat_s >= self.stale_after_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s:g}) must be below stale_after_s ({self.stale_after_s:g}): "
                             "a quiet peer would be marked unreachable between heartbeats")
        return self


# Shorter sessions are not replicated: measured in `kvmesh sim --sweep` (Mooncake's trace), 2048 rather than 8192
# cut p50 and p99 at 8 hosts (a short conversation's follow-up stuck behind a long prefill at its home moves warm
# instead of waiting) and left the agent traces, whose prompts are far longer, as they were.
REPLICATE_MIN_TOKENS = 2048


class KVShareConfig(_Strict):
    enabled: bool = Field(True, description="false: no replica is pushed or accepted (no listener); the store still "
                          "keeps this host's own sessions when persist_own")
    listen: str = Field("127.0.0.1:0", pattern=r"^[^:\s]*:[0-9]{1,5}$", description="host:port of this node's kv_share listener")
    replicate_min_tokens: int = Field(REPLICATE_MIN_TOKENS, ge=0, description="sessions shorter than this are not "
                                      "replicated; unset: 2048, at most a quarter of the engine's context per slot")
    store_dir: str = Field("", description="replica store directory (default: a per-node temp dir)")
    store_budget_bytes: int = Field(8 << 30, gt=0)
    fsync: Literal["always", "never"] = "always"
    persist_own: bool = Field(True, description="also keep this host's own sessions in the store")
    host_tier_bytes: int | None = Field(None, ge=0, description="host memory between the KV pool and the store (as "
                                        "llama-server's --cache-ram): the store's write-behinds copy pool blocks here and "
                                        "write the disk copy from here; a restore takes the blocks held here with a memory "
                                        "copy. Unset: twice the KV pool (SGLang HiCache's ratio), at most an eighth of the host's memory; 0: none")
    concurrency: int = Field(4, ge=1, le=64, description="replica pushes in flight at once (all targets together)")
    socket_buffer_bytes: int = Field(4 << 20, ge=65536)
    tls: TLSConfig | None = None
    connect_timeout_s: float = Field(3.0, gt=0)
    io_timeout_s: float = Field(30.0, gt=0)
    supersede_stall_s: float = Field(2.0, gt=0, description="a transfer in flight gives way to a newer replica "
                                     "of its session once it has sent nothing for this long")

    def for_context(self, context: int) -> KVShareConfig:
        """This section for an engine of `context` tokens per slot: an unset replicate_min_tokens can fire there."""
        if "replicate_min_tokens" in self.model_fields_set:
            return self
        return self.model_copy(update={"replicate_min_tokens": min(REPLICATE_MIN_TOKENS, context // 4)})

    def never_replicates(self, context: int) -> str | None:
        """Why no session can ever be replicated on an engine of `context` tokens per slot, or None."""
        if self.replicate_min_tokens < context:
            return None
        return (f"kvshare.replicate_min_tokens = {self.replicate_min_tokens} is not below this engine's context of "
                f"{context} tokens per slot: no session will ever be replicated")


class ResponsesConfig(_Strict):
    """Stored Responses (`store: true`, `previous_response_id`; node.responses): kept with their conversation, on
    its home and its replica holder, each with a disk copy."""

    ttl_s: float = Field(30 * 86400.0, gt=0, description="how long a stored response is kept after it was made "
                         "(OpenAI keeps them 30 days)")
    budget_bytes: int = Field(256 << 20, ge=0, description="stored responses' bytes (as JSON) this host keeps, in memory "
                              "and on disk; past it the least recently used conversation's go first. 0: none are kept")
    dir: str = Field("", description="where their disk copies go (default: beside kvshare.store_dir, named "
                     "<store_dir>-responses; with no store_dir a per-node temp dir, gone at exit)")


class NodeConfig(_Strict):
    name: str = Field("node-1", min_length=1, max_length=64, pattern=HOST_NAME_PATTERN)
    api: ApiConfig = ApiConfig()
    engine: EngineConfig = EngineConfig()
    mesh: MeshConfig = MeshConfig()
    kvshare: KVShareConfig = KVShareConfig()
    responses: ResponsesConfig = ResponsesConfig()
    admin_token: SecretStr | None = Field(None, min_length=8, description="bearer token for /v1/admin (or KVMESH_ADMIN_TOKEN)")
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, description="SIGTERM: how long the warm drain may take before "
                                   "the node exits anyway (node.shutdown)")

    @field_validator("name")
    @classmethod
    def _no_dots_only(cls, v: str) -> str:
        if set(v) <= {"."}:
            raise ValueError("must contain a letter or digit")
        return v

    @model_validator(mode="after")
    def _discovery_needs_what_it_reads(self) -> NodeConfig:
        if self.mesh.discovery == "dns" and not self.mesh.dns_name:
            raise ValueError('mesh.discovery "dns" needs mesh.dns_name (the name whose records are the hosts)')
        if self.mesh.discovery != "static" and self.mesh.secret is None:
            raise ValueError(f'mesh.discovery "{self.mesh.discovery}" needs mesh.secret: a discovered host is '
                             "admitted only after proving it holds the mesh secret")
        return self

    @model_validator(mode="after")
    def _loopback_without_secret(self) -> NodeConfig:
        """Without a mesh secret, peers and kv_share are unauthenticated: loopback only."""
        if self.mesh.secret is None:
            for field_name, host in (("api.host", self.api.host), ("kvshare.listen", self.kvshare.listen.rsplit(":", 1)[0])):
                if not is_loopback(host):
                    raise ValueError(f"{field_name} {host!r} is not a loopback address, and no mesh.secret is set: "
                                     "set mesh.secret (or KVMESH_MESH_SECRET) to listen beyond this machine")
        return self


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")  # the message, never the input value (it may be a secret)
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
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {type(e).__name__}: {e.args[-1] if e.args else e}") from None
    # Secrets may come from the environment rather than a file or a flag (flags show in `ps`).
    env = {"admin_token": "KVMESH_ADMIN_TOKEN", "mesh.secret": "KVMESH_MESH_SECRET"}
    overrides = {**{k: os.environ[v] for k, v in env.items() if os.environ.get(v)}, **(overrides or {})}
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})  # type: ignore[assignment]
            if not isinstance(node, dict):
                raise ConfigError(f"invalid configuration in {source}:\n  {p}: must be a table, not a value")
        node[leaf] = value  # type: ignore[index]
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, source)) from None
