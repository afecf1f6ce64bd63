"""Whether llama.cpp repacks a model's weights into its "extra" buffer types on this host.

llama.cpp's CPU backend can move weights into extra buffer types (`use_extra_bufts`): REPACK
(interleaved layouts for its SIMD kernels) and, when ggml was compiled for it, AMX (Intel's tile
matrix unit). On hosts that report `AMX_INT8 = 1` (Sapphire Rapids and later Xeons) the first
`llama_decode` of a repacked Q4 model segfaults in `ggml_backend_amx_mul_mat` (llama.cpp#20824,
open; llama-cpp-python's own `Llama` crashes the same way), and nothing a Python process does can
survive a segfault in native code. With `use_extra_bufts = False` the weights stay in the plain CPU
buffer and the same model runs.

`decide` is the whole policy, a pure function of the setting and the host's two reports of its
CPU, so it is tested for both kinds of host without owning one:
- `true` / `false`: the operator's word, always honoured (with the risk said on an AMX host);
- `auto`: repacked buffers except where the CPU reports AMX_INT8, in ggml's system info (AMX
  kernels compiled in) or the kernel's CPU flags (the CPU has the unit, whatever this build says).

Why detection and not a canary decode in a child process: the crash's signature is precise (the
AMX path, present exactly when AMX_INT8 is), a canary would load the weights a second time at
every start (minutes for a 20 GB model, double the page-cache pressure while both run), and a
canary that survives proves little: the fault depends on shapes and thread counts, so one short
decode passing would not make the real batches safe. The cost of leaving repacking off is
measured by `kvmesh bench engine --extra-bufts on|off`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Setting = Literal["auto"] | bool

_FEATURE = re.compile(r"([A-Z0-9_]+)\s*=\s*(\d+)")


@dataclass(frozen=True)
class WeightBuffers:
    """The choice for this host and why, as /v1/stats and the start-up log report it."""

    extra_bufts: bool
    setting: Setting
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"extra_bufts": self.extra_bufts, "setting": self.setting, "reason": self.reason}


def system_features(system_info: str) -> set[str]:
    """The features ggml's `llama_print_system_info()` reports as on (`AVX2 = 1 | AMX_INT8 = 1 | ...`)."""
    return {name for name, value in _FEATURE.findall(system_info) if value != "0"}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first CPU in a `/proc/cpuinfo` text (every core of a host reports the same)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def decide(setting: Setting, system_info: str, cpuinfo: str) -> WeightBuffers:
    """Repacked weight buffers on or off for this host (module docstring: why)."""
    amx = [where for where, hit in (("ggml system info", "AMX_INT8" in system_features(system_info)),
                                    ("/proc/cpuinfo", "amx_int8" in cpu_flags(cpuinfo))) if hit]
    if setting is True:
        risk = f"; this CPU reports AMX_INT8 ({', '.join(amx)}), where llama.cpp#20824 segfaults" if amx else ""
        return WeightBuffers(True, setting, f"extra_bufts = true in the config{risk}")
    if setting is False:
        return WeightBuffers(False, setting, "extra_bufts = false in the config")
    if amx:
        return WeightBuffers(False, setting, f"auto: this CPU reports AMX_INT8 ({', '.join(amx)}); llama.cpp's "
                             "AMX/REPACK weight buffers segfault there (llama.cpp#20824), so weights stay in the plain CPU buffer")
    return WeightBuffers(True, setting, "auto: no AMX_INT8 on this CPU; llama.cpp repacks weights for its CPU kernels")


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> str:
    """The kernel's CPU report ('' where there is none: another OS, a sandbox)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
