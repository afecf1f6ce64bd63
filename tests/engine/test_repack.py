"""The llama.cpp weight-buffer choice (node.engine.repack) on AMX hosts and others, from their CPU reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.node.config import LlamaCppConfig
from kvmesh.node.engine.repack import WeightBuffers, cpu_flags, decide, read_cpuinfo, system_features

# What llama_print_system_info() says on the two kinds of host these machines are (0.3.36's format).
SAPPHIRE = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
            "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
EPYC = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
        "AVX512_VNNI = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
CPUINFO_AMX = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
               "flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n\n"
               "processor\t: 1\nflags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n")
CPUINFO_PLAIN = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu vme sse sse2 avx avx2 avx512f\n"


def test_system_info_features_are_the_ones_set_to_one() -> None:
    """`AMX_INT8 = 1` is a feature that is on; `= 0` and absent ones are not."""
    assert "AMX_INT8" in system_features(SAPPHIRE) and "REPACK" in system_features(SAPPHIRE)
    assert "AMX_INT8" not in system_features(EPYC)
    assert "AMX_INT8" not in system_features("CPU : AVX2 = 1 | AMX_INT8 = 0 |")


def test_cpu_flags_come_from_the_flags_line() -> None:
    """The kernel's flags line, not a model name or another field, names the CPU's features."""
    assert "amx_int8" in cpu_flags(CPUINFO_AMX)
    assert "amx_int8" not in cpu_flags(CPUINFO_PLAIN) and "avx2" in cpu_flags(CPUINFO_PLAIN)
    assert cpu_flags("") == set()


@pytest.mark.parametrize(("info", "cpuinfo"), [(SAPPHIRE, CPUINFO_AMX), (SAPPHIRE, CPUINFO_PLAIN), (EPYC, CPUINFO_AMX)])
def test_auto_keeps_weights_plain_where_amx_int8_is_reported(info: str, cpuinfo: str) -> None:
    """auto on an AMX_INT8 host (either report says so): plain CPU buffers, and the reason names AMX and the bug."""
    w = decide("auto", info, cpuinfo)
    assert w.extra_bufts is False and w.setting == "auto"
    assert "AMX_INT8" in w.reason and "20824" in w.reason


def test_auto_repacks_where_no_amx_is_reported() -> None:
    """auto on a host without AMX_INT8: llama.cpp's repacked buffers, as llama.cpp itself defaults."""
    w = decide("auto", EPYC, CPUINFO_PLAIN)
    assert w.extra_bufts is True and "no AMX_INT8" in w.reason
    assert decide("auto", "", "").extra_bufts is True  # no report at all (another OS): llama.cpp's default


def test_the_operators_word_wins_and_the_risk_is_said() -> None:
    """true and false are honoured on any host; true on an AMX host says it may segfault."""
    assert decide(False, EPYC, CPUINFO_PLAIN) == WeightBuffers(False, False, "extra_bufts = false in the config")
    forced = decide(True, SAPPHIRE, CPUINFO_AMX)
    assert forced.extra_bufts is True and "segfault" in forced.reason
    assert "segfault" not in decide(True, EPYC, CPUINFO_PLAIN).reason
    assert forced.as_dict() == {"extra_bufts": True, "setting": True, "reason": forced.reason}


def test_config_takes_auto_true_false_and_names_anything_else() -> None:
    """engine.llamacpp.extra_bufts is auto by default; a word it does not know is refused with the field named."""
    assert LlamaCppConfig().extra_bufts == "auto"
    assert LlamaCppConfig(extra_bufts=False).extra_bufts is False
    with pytest.raises(ValueError, match="extra_bufts"):
        LlamaCppConfig(extra_bufts="sometimes")  # type: ignore[arg-type]


def test_cpuinfo_read_falls_back_to_empty(tmp_path: Path) -> None:
    """No /proc/cpuinfo (another OS, a sandbox): an empty report, never an error at start."""
    assert read_cpuinfo(tmp_path / "missing") == ""
    (tmp_path / "cpuinfo").write_text(CPUINFO_AMX)
    assert "amx_int8" in cpu_flags(read_cpuinfo(tmp_path / "cpuinfo"))
