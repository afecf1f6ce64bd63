"""`kvmesh init`: one commented, valid TOML per host, secrets fresh and private, nothing half-written."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from kvmesh.console.config import load_config_file
from kvmesh.node.config import load_config
from kvmesh.node.errors import ConfigError
from kvmesh.node.lab.launcher import NodeProcess, free_port
from kvmesh.node.meshinit import MeshPlan, parse_host, plan_files, write_files

SECRET_ENV = ("KVMESH_MESH_SECRET", "KVMESH_ADMIN_TOKEN", "KVMESH_API_KEY")


def _init(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmesh", "init", *args], capture_output=True, text=True, timeout=60)


def test_init_writes_a_valid_config_per_host_with_one_fresh_secret(tmp_path: Path) -> None:
    """Each host's file loads as a node config, lists the others as peers, and shares one mesh secret and API key."""
    r = _init("--host", "gpu-1=10.0.0.1", "--host", "gpu-2=10.0.0.2,192.168.7.2", "--host", "gpu-3=box3.lan",
              "--out", str(tmp_path / "mesh"))
    assert r.returncode == 0, r.stderr
    cfgs = {n: load_config(tmp_path / "mesh" / f"{n}.toml") for n in ("gpu-1", "gpu-2", "gpu-3")}
    assert {c.mesh.secret.get_secret_value() for c in cfgs.values() if c.mesh.secret} and \
        len({c.mesh.secret.get_secret_value() for c in cfgs.values() if c.mesh.secret}) == 1
    assert {p.name for p in cfgs["gpu-1"].mesh.peers} == {"gpu-2", "gpu-3"}
    peer2 = next(p for p in cfgs["gpu-1"].mesh.peers if p.name == "gpu-2")
    assert (peer2.api, peer2.kvshare) == ("http://10.0.0.2:8000", "192.168.7.2:9000")
    assert cfgs["gpu-2"].kvshare.listen == "192.168.7.2:9000" and cfgs["gpu-2"].api.host == "10.0.0.2"
    text = (tmp_path / "mesh" / "gpu-1.toml").read_text()
    assert text.count("\n# ") >= 8, "the file explains its fields"
    token = (tmp_path / "mesh" / "admin-token").read_text().strip()
    assert all(c.admin_token and c.admin_token.get_secret_value() == token for c in cfgs.values())
    key = (tmp_path / "mesh" / "api-key").read_text().strip()
    assert key.startswith("sk-kvmesh-") and key != token
    assert all(c.api.key_values() == [key] for c in cfgs.values()), "every host accepts the one client key"
    console = load_config_file(str(tmp_path / "mesh" / "console.toml"))
    assert console["nodes"] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://box3.lan:8000"]
    assert Path(console["admin_token_file"]) == (tmp_path / "mesh" / "admin-token").resolve()
    assert Path(console["api_key_file"]) == (tmp_path / "mesh" / "api-key").resolve(), "the console presents the key"
    assert "--api-key-file" in r.stdout, "the printed console invocation names the key file"
    for f in (tmp_path / "mesh").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f"{f.name} holds secrets and must be private"
    again = plan_files(MeshPlan([parse_host("a=10.0.0.1")]), tmp_path / "other")
    assert tomllib.loads(again[tmp_path / "other" / "a.toml"])["mesh"]["secret"] != \
        cfgs["gpu-1"].mesh.secret.get_secret_value(), "every init draws a new secret"


@pytest.mark.parametrize(("spec", "words"), [
    ("gpu-1", "expected NAME=ADDRESS"),
    ("gpu 1=10.0.0.1", "may hold only"),
    ("a=10.0.0.300", "neither an IP address nor a host name"),
    ("a=::1", "IPv6"),
    ("a=0.0.0.0", "not an address peers can reach"),
    ("a=1.2.3.4,5.6.7.8,9.9.9.9", "at most two addresses"),
])
def test_a_bad_host_is_refused_naming_it(spec: str, words: str) -> None:
    """A malformed --host is refused with a message naming the spec and what is wrong."""
    with pytest.raises(ConfigError, match=words):
        parse_host(spec)


def test_refusals_write_nothing_and_existing_files_are_kept(tmp_path: Path) -> None:
    """Duplicate names, bad fields and existing files are refused before any file is written."""
    out = tmp_path / "mesh"
    r = _init("--host", "a=10.0.0.1", "--host", "a=10.0.0.2", "--out", str(out))
    assert r.returncode == 2 and "given twice" in r.stderr and not out.exists()
    r = _init("--host", "a=10.0.0.1", "--slots", "0", "--out", str(out))
    assert r.returncode == 2 and "engine.slots" in r.stderr and not out.exists()
    r = _init("--host", "a=10.0.0.1", "--engine", "torch", "--out", str(out))
    assert r.returncode == 2 and "engine.model" in r.stderr and not out.exists()
    assert _init("--host", "a=10.0.0.1", "--out", str(out)).returncode == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    r = _init("--host", "a=10.0.0.1", "--out", str(out))
    assert r.returncode == 2 and "--force" in r.stderr
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before, "nothing overwritten, no temp file left"
    assert _init("--host", "a=10.0.0.1", "--out", str(out), "--force").returncode == 0
    assert (out / "a.toml").read_bytes() != before["a.toml"]
    with pytest.raises(ConfigError, match="a port is 1-65535"):
        write_files(plan_files(MeshPlan([parse_host("a=10.0.0.1")], api_port=70000), tmp_path / "x"), force=False)


def test_two_hosts_from_init_form_a_mesh(tmp_path: Path) -> None:
    """Two nodes started from `init`'s files (two loopback addresses) see each other and serve a turn."""
    api, kv = free_port(), free_port()
    out = tmp_path / "mesh"
    r = _init("--host", "a=127.0.0.1", "--host", "b=127.0.0.2", "--api-port", str(api), "--kvshare-port", str(kv),
              "--store-dir", str(tmp_path / "store"), "--slots", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    nodes = [NodeProcess(n, out / f"{n}.toml", tmp_path, env=env, inherit_env=False) for n in ("a", "b")]
    try:
        for n in nodes:
            n.start()
        for n in nodes:
            n.wait_ready(90)
        with pytest.raises(openai.AuthenticationError):  # init wrote a client key: the API wants it
            openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="unused", max_retries=0).models.list()
        key = (out / "api-key").read_text().strip()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8,
                                               messages=[{"role": "user", "content": "hello from init"}],
                                               extra_headers={"X-Session-Id": "init-test"})
        assert reply.choices[0].message.content
        assert httpx.get(f"http://127.0.0.1:{api}/v1/cluster", timeout=10).status_code == 401, "it names sessions"
        deadline, names = time.monotonic() + 30, set()
        while time.monotonic() < deadline and names != {"a", "b"}:
            snap = httpx.get(f"http://127.0.0.1:{api}/v1/cluster", headers={"x-api-key": key}, timeout=10).json()
            names = {h["name"] for h in snap["hosts"] if h.get("up", True)}
            time.sleep(0.2)
        assert names == {"a", "b"}, snap
    finally:
        for n in nodes:
            n.stop()


def test_init_sizes_a_gguf_host_from_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model smollm2` (llama.cpp implied) writes the model's trained context, a pool sized from its KV bytes per
    token and a replication threshold that can fire on it, each commented; the file loads as it was written."""
    for var in SECRET_ENV:
        monkeypatch.delenv(var, raising=False)
    r = _init("--host", "a=10.0.0.1", "--host", "b=10.0.0.2", "--model", "smollm2", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m" / "a.toml").read_text()
    assert "trained for 8192 tokens, 23040 bytes of f16 KV" in text
    cfg = load_config(tmp_path / "m" / "a.toml")
    assert (cfg.engine.kind, cfg.engine.model, cfg.engine.max_context) == ("llamacpp", "smollm2", 8192)
    assert cfg.engine.cache_bytes == 2 * 4 * 8192 * 23040
    assert cfg.kvshare.replicate_min_tokens == 2048
    assert cfg.kvshare.never_replicates(cfg.engine.max_context) is None


@pytest.mark.parametrize("model", ["smollm2", "/models/qwen3-8b-q4_k_m.gguf"])
def test_init_explains_the_weight_buffer_choice(tmp_path: Path, model: str) -> None:
    """A llama.cpp host's config sets extra_bufts = "auto", says it is off on AMX_INT8 CPUs and why, and what
    this machine would pick; a sim host's config has no llama.cpp section."""
    r = _init("--host", "a=10.0.0.1", "--model", model, "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m" / "a.toml").read_text()
    assert "off where the CPU reports AMX_INT8" in text and "llama.cpp#20824" in text and "# On this machine: o" in text
    assert load_config(tmp_path / "m" / "a.toml").engine.llamacpp.extra_bufts == "auto"
    assert "extra_bufts" in load_config(tmp_path / "m" / "a.toml").engine.llamacpp.model_fields_set
    r = _init("--host", "a=10.0.0.1", "--engine", "sim", "--out", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert "extra_bufts" not in (tmp_path / "s" / "a.toml").read_text()


@pytest.mark.parametrize(("alias", "recurrent", "says"), [("mamba-tiny", "2 of its 2 layers", "travels as a snapshot"),
                                                         ("hybrid-tiny", "2 of its 4 layers", "travels as a snapshot")])
def test_init_says_how_a_model_with_recurrent_state_replicates(tmp_path: Path, alias: str, recurrent: str, says: str) -> None:
    """A recurrent or hybrid GGUF's config says which layers hold recurrent state and that it travels as snapshots;
    the pool loads even when the model has no KV at all."""
    r = _init("--host", "a=10.0.0.1", "--host", "b=10.0.0.2", "--model", alias, "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m" / "a.toml").read_text()
    assert f"{recurrent} hold recurrent state" in text and says in text
    assert load_config(tmp_path / "m" / "a.toml").engine.cache_bytes >= 64 << 20


def test_init_names_a_sliding_window_models_two_cache_modes(tmp_path: Path) -> None:
    """Gemma 3's config writes [engine.llamacpp] swa = "full", explaining "window" and its 512-token window; it loads."""
    r = _init("--host", "a=10.0.0.1", "--model", "gemma3-270m", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m" / "a.toml").read_text()
    assert '"window" keeps the last 512' in text
    assert load_config(tmp_path / "m" / "a.toml").engine.llamacpp.swa == "full"


def test_init_with_a_gguf_not_on_this_machine_says_its_sizes_are_defaults(tmp_path: Path) -> None:
    """A GGUF path that only the hosts hold is written as given, with the default sizes and a comment saying so."""
    r = _init("--host", "a=10.0.0.1", "--model", "/models/qwen3-8b-q4_k_m.gguf", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m" / "a.toml").read_text()
    assert "/models/qwen3-8b-q4_k_m.gguf is not on this machine: sizes are defaults" in text
    cfg = load_config(tmp_path / "m" / "a.toml")
    assert (cfg.engine.kind, cfg.engine.model) == ("llamacpp", "/models/qwen3-8b-q4_k_m.gguf")
    assert "max_context" not in cfg.engine.model_fields_set  # the node takes the model's own
    assert "replicate_min_tokens" not in cfg.kvshare.model_fields_set  # and fits the threshold to it
