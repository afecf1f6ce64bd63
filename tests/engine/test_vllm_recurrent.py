"""The vLLM engine refuses models with recurrent layers at start, saying why, and the reasons it gives still hold.

The refusals run without vLLM: the generated GGUFs (hybrid-tiny: arch lfm2, mamba-tiny: arch mamba) are
refused before any conversion, a checkpoint directory by its config.json. The canaries run vLLM's own
kernels in its venv (no server): when one fails, vLLM's CPU build has changed, and the refusal of that
architecture (node.engine.vllm.recurrent.CPU_REASONS) is to be measured again.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvmesh.node.config import EngineConfig, VllmConfig
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.engine.vllm.models import checkpoint_dir
from kvmesh.node.errors import ConfigError

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is absent: run `make vllm` (make test does)")


@pytest.mark.parametrize(("alias", "arch", "cpu_says"), [("hybrid-tiny", "lfm2", "torch.ops._C.rotary_embedding"),
                                                         ("mamba-tiny", "mamba", "torch.ops._C.selective_scan_fwd")])
def test_generated_recurrent_models_refused_before_conversion(tmp_path: Path, alias: str, arch: str, cpu_says: str) -> None:
    cfg = EngineConfig(kind="vllm", model=alias, device="cpu", vllm=VllmConfig(cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError) as e:
        VllmEngine(cfg, name="test-recurrent")
    said = str(e.value)
    assert f"does not serve '{arch}'" in said and cpu_says in said and "SupportsHMA" in said and "'llamacpp'" in said
    assert not (tmp_path / "models").exists()  # refused before the GGUF was converted
    assert not (tmp_path / "run").exists()  # and before any vLLM started


def test_on_a_gpu_the_reason_is_the_connector(tmp_path: Path) -> None:
    cfg = EngineConfig(kind="vllm", model="hybrid-tiny", device="cuda", vllm=VllmConfig(cache_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="SupportsHMA") as e:
        VllmEngine(cfg, name="test-recurrent")
    assert "CPU build" not in str(e.value)


def _checkpoint(d: Path, config: dict[str, object]) -> str:
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def test_checkpoint_directories_told_by_config(tmp_path: Path) -> None:
    lfm2 = _checkpoint(tmp_path / "lfm2", {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
                                           "layer_types": ["conv", "full_attention"]})
    with pytest.raises(ConfigError, match="does not serve 'lfm2'.*rotary_embedding"):
        checkpoint_dir(lfm2, python="unused", cache_dir=tmp_path, cuda=False)
    # Not listed by type, but a layer that is not attention: recurrent all the same.
    linear = _checkpoint(tmp_path / "next", {"model_type": "somehybrid", "layer_types": ["linear_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="'somehybrid' is not measured on vLLM's CPU build.*SupportsHMA"):
        checkpoint_dir(linear, python="unused", cache_dir=tmp_path, cuda=False)
    # Attention only, sliding windows included: served as before.
    llama = _checkpoint(tmp_path / "llama", {"model_type": "llama", "layer_types": ["sliding_attention", "full_attention"]})
    assert checkpoint_dir(llama, python="unused", cache_dir=tmp_path, cuda=False) == Path(llama)


# Runs in vLLM's venv. Lfm2Attention (vllm/model_executor/models/lfm2.py) rotates q and k shaped
# [tokens, heads, head_dim]; Llama's attention hands the same kernel [tokens, heads * head_dim].
ROTARY = """
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
torch.manual_seed(0)
n, heads, hd = 21, 4, 32
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(hd, max_position=4096, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                    is_neox_style=True)
    pos, q, k = torch.arange(n), torch.randn(n, heads, hd), torch.randn(n, 2, hd)
    want = rope.forward_native(pos, q.clone(), k.clone())[0].reshape(n, heads, hd)
    flat = rope.forward_cpu(pos, q.clone().reshape(n, heads * hd), k.clone().reshape(n, 2 * hd))[0]
    shaped = rope.forward_cpu(pos, q.clone(), k.clone())[0]
    print((flat.reshape(n, heads, hd) - want).abs().max().item(), (shaped.reshape(n, heads, hd) - want).abs().max().item())
"""

SCAN = """
import torch
import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops into torch.ops._C)
print(hasattr(torch.ops._C, "rotary_embedding"), hasattr(torch.ops._C, "selective_scan_fwd"))
"""


def _in_vllm(script: str) -> str:
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@needs_vllm
def test_canary_cpu_rotary_kernel_misreads_a_3d_query() -> None:
    flat, shaped = (float(x) for x in _in_vllm(ROTARY).split())
    assert flat < 1e-5  # the 2-D call (Llama's) is right
    assert shaped > 0.1  # the 3-D call (LFM2's) is not: lfm2 stays refused on CPU while this holds


@needs_vllm
def test_canary_cpu_build_lacks_the_selective_scan() -> None:
    assert _in_vllm(SCAN) == "True False"  # vLLM's ops are loaded, Mamba's prefill scan is not among them
