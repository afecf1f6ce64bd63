"""node.config.load_config: a bad file is refused with ConfigError naming the dotted field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig, load_config
from kvmesh.node.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVMESH_ADMIN_TOKEN", "KVMESH_MESH_SECRET"):
        monkeypatch.delenv(var, raising=False)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "node.toml"
    p.write_text(text)
    return p


def _field_lines(msg: str) -> set[str]:
    """The dotted field names the error message lists, one per '  field: reason' line."""
    return {line.strip().split(":", 1)[0] for line in msg.splitlines()[1:] if ":" in line}


def test_defaults_without_file() -> None:
    """No file gives the documented defaults."""
    cfg = load_config(None)
    assert isinstance(cfg, NodeConfig)
    assert cfg.engine == EngineConfig()
    assert (cfg.engine.kind, cfg.engine.slots, cfg.engine.block_size) == ("tiny", 4, 256)
    assert cfg.engine.served_model == "kvmesh-tiny"


def test_good_file_loads(tmp_path: Path) -> None:
    """A valid file's values land in the typed config, nested tables included."""
    p = _write(
        tmp_path,
        """
name = "host-a"
[api]
port = 9001
[engine]
kind = "sim"
slots = 2
block_size = 64
model_name = "m"
[engine.sim]
kv_scale = 0.25
decode_tps = 120.0
""",
    )
    cfg = load_config(p)
    assert cfg.name == "host-a" and cfg.api.port == 9001
    assert (cfg.engine.kind, cfg.engine.slots, cfg.engine.block_size) == ("sim", 2, 64)
    assert cfg.engine.served_model == "m"
    assert cfg.engine.sim.kv_scale == 0.25 and cfg.engine.sim.decode_tps == 120.0
    assert cfg.engine.sim.prefill_tps == SimConfig().prefill_tps  # untouched default


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('[engine]\nslots = "four"\n', "engine.slots"),  # wrong type
        ("[engine]\nslotz = 2\n", "engine.slotz"),  # unknown key
        ('[engine]\nkind = "huge"\n', "engine.kind"),  # bad enum
        ('[engine]\ndevice = "tpu"\n', "engine.device"),  # bad enum
        ("[engine.sim]\nkv_scale = 2.0\n", "engine.sim.kv_scale"),  # out of range, nested
        ("[api]\nport = 70000\n", "api.port"),
        ('name = "..."\n', "name"),  # custom validator
        ('name = "has space"\n', "name"),  # pattern
        ("bogus = 1\n", "bogus"),  # unknown top-level key
        ('[mesh]\nzone = "rack a"\n', "mesh.zone"),  # a label the console shows: no spaces
        ("[mesh]\nadmit_wait_s = 0\n", "mesh.admit_wait_s"),  # admission bounds are above 0
    ],
)
def test_bad_value_names_dotted_field(tmp_path: Path, toml: str, field: str) -> None:
    """Each kind of bad value raises ConfigError whose message names the file and the dotted field."""
    p = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg.splitlines()[0]
    assert field in _field_lines(msg)


def test_every_bad_field_is_reported(tmp_path: Path) -> None:
    """Several errors in one file are all listed, not just the first."""
    p = _write(tmp_path, '[engine]\nslots = 0\nkind = "huge"\n[api]\nport = -1\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert {"engine.slots", "engine.kind", "api.port"} <= _field_lines(str(ei.value))


def test_overrides_apply_over_file(tmp_path: Path) -> None:
    """Dotted-key overrides replace file values and create missing tables."""
    p = _write(tmp_path, "[engine]\nslots = 2\nblock_size = 64\n")
    cfg = load_config(p, {"engine.slots": 8, "api.port": 9100, "engine.sim.kv_scale": 0.5, "name": "n2"})
    assert cfg.engine.slots == 8
    assert cfg.engine.block_size == 64  # file value kept
    assert cfg.api.port == 9100
    assert cfg.engine.sim.kv_scale == 0.5
    assert cfg.name == "n2"


def test_bad_override_is_a_config_error() -> None:
    """An override with a bad value is refused like a bad file value, naming the field."""
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"engine.block_size": 8})
    msg = str(ei.value)
    assert "defaults" in msg.splitlines()[0]
    assert "engine.block_size" in _field_lines(msg)


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    """A missing file or invalid TOML is a ConfigError that names the path."""
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(missing)
    bad = _write(tmp_path, "[engine\nslots = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML") as ei:
        load_config(bad)
    assert str(bad) in str(ei.value)


def test_config_is_frozen() -> None:
    """A loaded config cannot be mutated in place."""
    cfg = load_config(None)
    with pytest.raises(Exception):
        cfg.engine.slots = 9  # type: ignore[misc]
    assert cfg.engine.slots == 4


@pytest.mark.parametrize(("scale", "want"), [(1.0, 20480), (0.5, 10240), (1 / 1280, 16), (1e-9, 16), (0.3, 6144)])
def test_sim_kv_bytes_are_whole_16_byte_words(scale: float, want: int) -> None:
    """scaled_kv_bytes_per_token rounds down to a multiple of 16 and never below 16."""
    got = SimConfig(kv_scale=scale).scaled_kv_bytes_per_token()
    assert got == want and got % 16 == 0


def test_override_into_scalar_is_a_config_error(tmp_path: Path) -> None:
    """A file value that is not a table, overridden below it, is refused with a ConfigError naming the field."""
    p = _write(tmp_path, 'engine = "sim"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p, {"engine.slots": 2})
    assert "engine" in str(ei.value)


@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    """A path that is a directory or not UTF-8 text is refused with ConfigError naming the path."""
    if kind == "directory":
        p = tmp_path / "conf.d"
        p.mkdir()
    else:
        p = tmp_path / "node.toml"
        p.write_bytes(b"name = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize(("context", "fires_from"), [(2048, 512), (4096, 1024), (8192, 2048), (131072, 2048)])
def test_unset_replicate_min_tokens_fits_the_context(context: int, fires_from: int) -> None:
    """Unset, kvshare.replicate_min_tokens is 2048 but at most a quarter of the context per slot, so it can fire."""
    kv = NodeConfig().kvshare.for_context(context)
    assert kv.replicate_min_tokens == fires_from
    assert kv.never_replicates(context) is None


def test_an_explicit_replicate_min_tokens_is_kept_and_a_dead_one_named(tmp_path: Path) -> None:
    """A value set in the file is kept as given; one at or past the context is named as one that can never fire."""
    cfg = load_config(_write(tmp_path, "[kvshare]\nreplicate_min_tokens = 8192\n"))
    kv = cfg.kvshare.for_context(8192)
    assert kv.replicate_min_tokens == 8192
    why = kv.never_replicates(8192)
    assert why is not None and "= 8192" in why and "no session will ever be replicated" in why
    assert cfg.kvshare.for_context(65536).never_replicates(65536) is None
