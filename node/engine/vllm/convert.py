"""A GGUF model as a Hugging Face checkpoint directory that vLLM loads (run in vLLM's venv, as a script).

vLLM's CPU build has no kernels for GGUF's quantized types, so a packaged GGUF (SmolLM2's Q4_1) is
dequantized once by transformers (`gguf_file=`) and saved as safetensors with its tokenizer. GGUF
loading leaves a `quantization_config` on the model's config that `save_pretrained` cannot
serialize; it describes the file read, not the weights written, so it is dropped. Nothing is
downloaded: the GGUF carries the tokenizer and the chat template.

Usage: python convert.py GGUF_PATH OUT_DIR   (OUT_DIR appears whole, or not at all)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    """Write the checkpoint into a temporary sibling of `out`, then rename it into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]  # the weights are dequantized already (transformers 5 refuses to save otherwise)
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, out)
        except OSError:
            # Another node converting the same file at once got there first: its folder is as whole as ours.
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
