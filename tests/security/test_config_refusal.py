"""Bad config files are refused at start: `kvmesh node --config F` exits non-zero naming the field.

In-process validation is covered by tests/test_config.py; here the real command line runs (one
subprocess per file, all started at once), and what it prints must name every bad dotted field,
carry no traceback, and never repeat a secret's value.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .helpers import clean_env

KVMESH = Path(sys.executable).parent / "kvmesh"

# Each file holds many independent mistakes: the node must name every one of them in a single refusal
# (and a node process costs seconds to start, so there are few files). Secret values must never be printed.
MANY_MISTAKES = """
colour = "blue"
admin_token = "Adm1n"

[api]
port = "eighty"
hots = "127.0.0.1"

[api.tls]
cert_file = "c.pem"

[engine]
slots = "four"

[engine.sim]
kv_scale = "big"

[kvshare]
io_timeout_s = -1

[kv_share]
listen = "127.0.0.1:0"

[mesh]
secret = "Sh0rtSecr3t"
previous_secret = "Pr3v10us"

[[mesh.peers]]
name = "b"
kvshare = "127.0.0.1:7000"
"""
MANY_FIELDS = ["colour", "admin_token", "api.port", "api.hots", "api.tls.key_file", "engine.slots", "engine.sim.kv_scale",
               "kvshare.io_timeout_s", "kv_share", "mesh.secret", "mesh.previous_secret", "mesh.peers.0.api"]
MANY_SECRETS = ["Adm1n", "Sh0rtSecr3t", "Pr3v10us"]

# Whole tables of the wrong type, and secrets from the environment (too short) over a numeric previous secret.
WRONG_SHAPES = """
api = 5

[engine]
kind = 3

[mesh]
peers = 3
previous_secret = 98765432109876543
"""
WRONG_SHAPE_FIELDS = ["api", "engine.kind", "mesh.peers", "mesh.secret", "mesh.previous_secret", "admin_token"]
WRONG_SHAPE_SECRETS = ["EnvSecr3t", "Tok3n", "98765432109876543"]


def _cmd(config: Path) -> list[str]:
    if KVMESH.exists():
        return [str(KVMESH), "node", "--config", str(config)]
    return [sys.executable, "-m", "kvmesh.node.cli", "node", "--config", str(config)]


def _run_all(workdir: Path, files: dict[str, tuple[str, dict[str, str]]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Start `kvmesh node --config F` for every file at once; wait for all."""
    procs = {}
    try:
        for name, (text, env) in files.items():
            cfg = workdir / f"{name}.toml"
            cfg.write_text(text)
            procs[name] = subprocess.Popen(_cmd(cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env=clean_env(**env), cwd=workdir)
        out = {}
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _named_fields(stderr: str) -> set[str]:
    """The dotted fields of the '  field: reason' lines under 'invalid configuration in ...:'."""
    return {ln.strip().split(":", 1)[0] for ln in stderr.splitlines() if ln.startswith("  ") and ":" in ln}


def test_bad_config_files_exit_nonzero_naming_every_field(tmp_path: Path) -> None:
    """Wrong types, unknown keys and tables, missing fields, short secrets (file and env): exit 2, each field named, no traceback, no secret echoed."""
    results = _run_all(tmp_path, {"many": (MANY_MISTAKES, {}),
                                  "shapes": (WRONG_SHAPES, {"KVMESH_MESH_SECRET": "EnvSecr3t", "KVMESH_ADMIN_TOKEN": "Tok3n"})})
    for name, fields, secrets in (("many", MANY_FIELDS, MANY_SECRETS), ("shapes", WRONG_SHAPE_FIELDS, WRONG_SHAPE_SECRETS)):
        r = results[name]
        said = r.stdout + r.stderr
        assert r.returncode == 2, (name, r.returncode, said[-2000:])
        assert "invalid configuration in" in r.stderr and "Traceback" not in said, (name, said[-2000:])
        assert "ready" not in r.stdout, (name, r.stdout)
        named = _named_fields(r.stderr)
        assert set(fields) <= named, (name, sorted(set(fields) - named), r.stderr)
        leaked = [s for s in secrets if s in said]
        assert not leaked, (name, leaked, said)
