"""Checkpoints: HuggingFace safetensors import (dense and int4-quantized formats) and orbax storage.

params, cfg = checkpoints.load_hf(hf_dir, dtype="float32" | "bfloat16", quantize=None | "int4")
checkpoints.save(out_dir, params, cfg);  params, cfg = checkpoints.load(out_dir)
params, cfg = checkpoints.load(checkpoints.demo_dir())   # the bundled int4 demo model (+ tokenizer.json)
params, cfg = checkpoints.load(checkpoints.demo_hybrid_dir())   # the bundled hybrid demo (Gated DeltaNet, MTP)
jspec.DraftModel.load(checkpoints.drafter_dir())          # the bundled drafter distilled from it
"""

import os

from checkpoints import hf_hybrid  # noqa: F401  (registers the qwen3_next / qwen3_5 importers)
from checkpoints.formats import (
    FormatError,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    from_matmul_nbits,
    scheme_from_config,
)
from checkpoints.hf import QUANTIZE_LM_HEAD_DEFAULT, CheckpointError, load_hf
from checkpoints.store import load, save


def demo_dir() -> str:
    """Directory of the bundled demo checkpoint (int4 params, tokenizer.json, MODEL_CARD.md)."""
    return _bundled("demo", "demo checkpoint")


def demo_hybrid_dir() -> str:
    """Directory of the bundled hybrid demo checkpoint (`python -m checkpoints.train_demo --size hybrid --family
    qwen3_5`: Gated DeltaNet 3 : 1 gated attention with one MTP layer, the demo's tokenizer; int4 linears, bfloat16
    embedding and norms)."""
    return _bundled("demo_hybrid", "hybrid demo checkpoint")


def drafter_dir() -> str:
    """Directory of the bundled demo drafter (`python -m checkpoints.train_drafter`: distilled from the demo model,
    its tokenizer; int4 linears, bfloat16 embedding) for `jspec.DraftModel.load`."""
    return _bundled("demo_drafter", "demo drafter")


def _bundled(folder: str, what: str) -> str:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), folder)
    if not os.path.isfile(os.path.join(path, "jspec.json")):
        raise FileNotFoundError(f"the bundled {what} is missing from {path}")
    return path


__all__ = [
    "QUANTIZE_LM_HEAD_DEFAULT",
    "CheckpointError",
    "FormatError",
    "from_awq",
    "from_compressed_tensors",
    "from_gptq",
    "from_matmul_nbits",
    "demo_dir",
    "demo_hybrid_dir",
    "drafter_dir",
    "load",
    "load_hf",
    "save",
    "scheme_from_config",
]
