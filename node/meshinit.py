"""`kvmesh init`: write one commented, valid TOML config per host of a new mesh.

A newcomer names the hosts (`--host gpu-1=10.0.0.1 --host gpu-2=10.0.0.2`) and gets, in
one folder: `<name>.toml` for each host (every other host as a peer, one fresh mesh
secret shared by all), `admin-token` (the bearer token the console's drain/migrate keys
send), `api-key` (the client API key every host accepts) and `console.toml` (the console
pointed at every host, reading both files). Every file is validated by
the same loader the node uses before anything is written, and all of them land by
rename, so a refused call leaves nothing behind and never overwrites without `--force`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import secrets
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from kvmesh.node.config import HOST_NAME_PATTERN, REPLICATE_MIN_TOKENS, KVShareConfig, NodeConfig, describe
from kvmesh.node.engine import repack
from kvmesh.node.engine.ggufmeta import GGUFFacts, read_facts
from kvmesh.node.engine.modelfiles import resolve as resolve_model
from kvmesh.node.errors import ConfigError

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class HostSpec:
    """One host of the mesh: its name, the address its API binds, and the address kv_share binds."""

    name: str
    api_addr: str
    kvshare_addr: str


@dataclass(frozen=True)
class MeshPlan:
    """Everything `init` writes, decided before a byte is written."""

    hosts: list[HostSpec]
    engine: str = "sim"
    model: str = ""
    slots: int = 4
    api_port: int = 8000
    kvshare_port: int = 9000
    store_dir: str = "/var/lib/kvmesh/store"
    facts: GGUFFacts | None = None  # read from the GGUF when it is on this machine


def gguf_facts(engine: str, model: str) -> GGUFFacts | None:
    """The served GGUF's facts, when it is here to read (an alias, or a path present on this machine)."""
    if engine != "llamacpp" or not model:
        return None
    path = resolve_model(model)
    if not path.is_file():
        return None
    try:
        return read_facts(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--model {model}: {path} is not a GGUF kvmesh can read ({e})") from None


def _sized(plan: MeshPlan) -> tuple[str, str]:
    """The [engine] sizing lines and the [kvshare] replication line: derived from the GGUF when it was read."""
    f = plan.facts
    if f is None and plan.engine == "llamacpp":
        # Unset, the node fits these to the model it loads; a fixed 8192 would never fire on an 8k model.
        return (f"# {plan.model} is not on this machine: sizes are defaults; max_context is the model's trained\n"
                f"# context when unset.\n# KV pool: the byte budget for resident session caches (LRU beyond it).\n"
                f"cache_bytes = {1 << 30}\n{_llamacpp_section('')}",
                "# Sessions shorter than this are not replicated (recomputing them is cheap). Unset: 8192, at most\n"
                f"# a quarter of the model's context per slot.\n# replicate_min_tokens = {REPLICATE_MIN_TOKENS}\n")
    if f is None:
        return (f"# KV pool: the byte budget for resident session caches (LRU beyond it).\ncache_bytes = {1 << 30}\n",
                "# Sessions shorter than this are not replicated (recomputing them is cheap).\n"
                f"replicate_min_tokens = {REPLICATE_MIN_TOKENS}\n")
    pool = max(64 << 20, 2 * plan.slots * f.context * f.kv_bytes_per_token)  # a recurrent-only model has no KV
    window = f", sliding window {f.sliding_window}" if f.sliding_window else ""
    live = (f"# {f.recurrent_layers} of its {f.layers} layers hold recurrent state: blocks hold its attention cache (if\n"
            "# any), and the recurrent state travels as a snapshot beside them (taken at block boundaries).\n"
            if f.recurrent_layers else "")
    replicate = KVShareConfig().for_context(f.context).replicate_min_tokens  # the node's own rule
    swa = (f"# Its window layers: \"full\" keeps every position (blocks restore exactly, also from disk\n"
           f"# after a restart; a full cache's memory); \"window\" keeps the last {f.sliding_window} (llama.cpp's default) and a\n"
           "# replica is bare blocks plus a snapshot of the window, sent after them (memory only).\nswa = \"full\"\n"
           if f.sliding_window else "")
    return (f"# From {f.name} ({f.arch}{window}): trained for {f.context} tokens, {f.kv_bytes_per_token} bytes of f16 KV\n"
            f"# per token ({f.context * f.kv_bytes_per_token / 2**20:.0f} MiB per full context).\n"
            f"{live}# Context per slot: the model's trained context.\nmax_context = {f.context}\n"
            f"# KV pool: two full contexts per slot ({pool / 2**30:.2f} GiB), so idle sessions stay resident.\n"
            f"cache_bytes = {pool}\n{_llamacpp_section(swa)}",
            f"# Sessions shorter than this are not replicated (recomputing them is cheap): 8192, at most a\n"
            f"# quarter of the model's {f.context}-token context, so sessions do replicate.\nreplicate_min_tokens = {replicate}\n")


def _llamacpp_section(more: str) -> str:
    """[engine.llamacpp]: the weight buffers (decided on each host at start), then `more`."""
    here = repack.decide("auto", "", repack.read_cpuinfo())  # the kernel's flags; llama.cpp may not be installed here
    return ("[engine.llamacpp]\n# llama.cpp's repacked weight buffers (REPACK, AMX): \"auto\" decides on each host at start:\n"
            "# off where the CPU reports AMX_INT8 (they segfault there, llama.cpp#20824), on elsewhere;\n"
            "# true or false forces it. /v1/stats shows each host's choice (engine.weights).\n"
            f"# On this machine: {'on' if here.extra_bufts else 'off'} ({here.reason}).\n"
            f"extra_bufts = \"auto\"\n{more}")


def _check_addr(addr: str, spec: str) -> str:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        # An all-digit last label is a mistyped IPv4 address (10.0.0.300), never a host name.
        if _HOSTNAME.match(addr) and not addr.rsplit(".", 1)[-1].isdigit():
            return addr
        raise ConfigError(f"--host {spec!r}: {addr!r} is neither an IP address nor a host name") from None
    if ip.version == 6:
        raise ConfigError(f"--host {spec!r}: IPv6 addresses are not supported yet (kvshare.listen is host:port); "
                          "use an IPv4 address or a host name")
    if ip.is_unspecified:
        raise ConfigError(f"--host {spec!r}: {addr} is not an address peers can reach; give the host's own address")
    return addr


def parse_host(spec: str) -> HostSpec:
    """`NAME=ADDR` or `NAME=ADDR,KVSHARE_ADDR` (kv_share on its own interface, e.g. to bypass a VPN)."""
    name, sep, addrs = spec.partition("=")
    if not sep or not name or not addrs:
        raise ConfigError(f"--host {spec!r}: expected NAME=ADDRESS, e.g. gpu-1=10.0.0.1")
    if not re.fullmatch(HOST_NAME_PATTERN, name) or len(name) > 64 or set(name) <= {"."}:
        raise ConfigError(f"--host {spec!r}: the name {name!r} may hold only letters, digits, '.', '_' and '-' (1-64)")
    parts = addrs.split(",")
    if len(parts) > 2:
        raise ConfigError(f"--host {spec!r}: at most two addresses (API, then kv_share)")
    api = _check_addr(parts[0].strip(), spec)
    kv = _check_addr(parts[1].strip(), spec) if len(parts) == 2 else api
    return HostSpec(name, api, kv)


def _q(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for what we write


def render_host(plan: MeshPlan, me: HostSpec, *, secret: str, admin_token: str, api_key: str) -> str:
    """The commented TOML for one host."""
    peers = "\n".join(f"[[mesh.peers]]\nname = {_q(p.name)}\napi = {_q(f'http://{p.api_addr}:{plan.api_port}')}\n"
                      f"kvshare = {_q(f'{p.kvshare_addr}:{plan.kvshare_port}')}\n" for p in plan.hosts if p != me)
    model = f"model = {_q(plan.model)}\n" if plan.model else ""
    engine_sizes, replication = _sized(plan)
    return f"""\
# kvmesh node config for host {me.name!r}, written by `kvmesh init`.
# Start it on that host with:  kvmesh node --config {me.name}.toml
# Every field is checked at start; a bad one is named with the reason.

name = {_q(me.name)}
# Bearer token for /v1/admin (drain, undrain, migrate, replicate). The console reads it from
# the admin-token file beside this one. KVMESH_ADMIN_TOKEN in the environment overrides it.
admin_token = {_q(admin_token)}

[api]
# The client APIs (OpenAI chat, completions, Responses; Anthropic Messages), peer routes, the
# cluster view and stats, and the console's event stream.
host = {_q(me.api_addr)}
port = {plan.api_port}
# Clients send one of these as `Authorization: Bearer <key>` or `x-api-key: <key>` (the same key
# on every host; it is also in the api-key file beside this one). KVMESH_API_KEY (comma-separated)
# adds more. The cluster view, stats and event stream (they name every session) want one too;
# /health, /ready and /metrics stay open.
keys = [{_q(api_key)}]

[engine]
# sim: a cost model with real KV bytes (try the mesh without a GPU); tiny: a small torch
# decoder; torch: a local Hugging Face checkpoint directory in `model`; llamacpp: a GGUF
# file in `model` (the same file on every host) or a packaged model's alias (smollm2,
# gemma3-270m), served by llama.cpp ([engine.llamacpp]).
kind = {_q(plan.engine)}
{model}slots = {plan.slots}
{engine_sizes}
[kvshare]
# The replica data plane: its own listener, so it can bind an interface that bypasses a VPN.
listen = {_q(f'{me.kvshare_addr}:{plan.kvshare_port}')}
# Replicas on disk (and this host's own long sessions), so a restart or eviction restores them.
store_dir = {_q(plan.store_dir)}
store_budget_bytes = {8 << 30}
{replication}
[mesh]
# Shared by every host of this mesh: signs peer calls and kv_share streams. Keep it secret;
# KVMESH_MESH_SECRET in the environment overrides it.
secret = {_q(secret)}
# A peer not heard from for this long is not routed to.
stale_after_s = 3.0

{peers}"""


def render_console(plan: MeshPlan, token_file: Path, key_file: Path) -> str:
    nodes = ", ".join(_q(f"http://{h.api_addr}:{plan.api_port}") for h in plan.hosts)
    return f"""\
# kvmesh-console settings, written by `kvmesh init`. Run:  kvmesh-console --config console.toml
[console]
nodes = [{nodes}]
# Without this file the console is read-only; keep it readable by you alone.
admin_token_file = {_q(str(token_file))}
# The client API key every host wants on its event stream (KVMESH_API_KEY would do instead).
api_key_file = {_q(str(key_file))}
"""


def plan_files(plan: MeshPlan, out: Path) -> dict[Path, str]:
    """Every file `init` writes, with its text; validated like a node validates its config."""
    for flag, port in (("--api-port", plan.api_port), ("--kvshare-port", plan.kvshare_port)):
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} {port}: a port is 1-65535")
    if plan.api_port == plan.kvshare_port and any(h.api_addr == h.kvshare_addr for h in plan.hosts):
        raise ConfigError(f"--api-port and --kvshare-port are both {plan.api_port} on the same address")
    names = [h.name for h in plan.hosts]
    if not names:
        raise ConfigError("name at least one host: --host NAME=ADDRESS")
    if len(set(names)) != len(names):
        raise ConfigError(f"host names must differ: {', '.join(sorted({n for n in names if names.count(n) > 1}))} given twice")
    secret, token, api_key = secrets.token_urlsafe(32), secrets.token_urlsafe(32), "sk-kvmesh-" + secrets.token_urlsafe(24)
    files = {out / f"{h.name}.toml": render_host(plan, h, secret=secret, admin_token=token, api_key=api_key)
             for h in plan.hosts}
    token_file = (out / "admin-token").resolve()
    files[out / "admin-token"] = token + "\n"
    files[out / "api-key"] = api_key + "\n"
    files[out / "console.toml"] = render_console(plan, token_file, (out / "api-key").resolve())
    return files


def _validate(path: Path, text: str) -> None:
    try:
        NodeConfig.model_validate(tomllib.loads(text))
    except ValidationError as e:  # e.g. --slots 0, or --engine torch without --model: the field is named
        raise ConfigError(describe(e, path.name)) from None


def write_files(files: dict[Path, str], *, force: bool) -> None:
    """Write all or nothing: refuse existing files unless `force`, then land each by rename (mode 0600)."""
    existing = [p for p in files if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(str(p) for p in existing)} already exist(s); pass --force to overwrite")
    for path, text in files.items():
        if path.suffix == ".toml" and path.name != "console.toml":
            _validate(path, text)
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            staged.append((Path(tmp_name), path))
            with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600: secrets are never readable by others
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)


def cmd_init(args: argparse.Namespace) -> int:
    plan = MeshPlan([parse_host(s) for s in args.host], engine=args.engine, model=args.model, slots=args.slots,
                    api_port=args.api_port, kvshare_port=args.kvshare_port, store_dir=args.store_dir,
                    facts=gguf_facts(args.engine, args.model))
    files = plan_files(plan, args.out)
    write_files(files, force=args.force)
    for path in files:
        print(path)
    first = plan.hosts[0].name
    print(f"\nnext: copy {first}.toml to host {first!r} and run `kvmesh node --config {first}.toml` there "
          f"(likewise for each host); then `kvmesh-console --config {args.out / 'console.toml'}` (it reads "
          f"{args.out / 'admin-token'} and {args.out / 'api-key'}; or `kvmesh-console --node URL "
          f"--api-key-file {args.out / 'api-key'}`)")
    return 0
