"""jspec: byte-exact speculative decoding of int4 LLMs in JAX/Pallas.

Speculative output is token-for-token identical to plain greedy decoding, for every drafter and every k.
Start with `jspec.load(dir).generate(text)` (docs/api.md); the pure steps and the Engine are below it.
"""

from jspec import exactness
from jspec.accept import TieGuard, greedy_accept
from jspec.batch import generate_batch_on_device
from jspec.config import ModelConfig, RopeConfig, UnsupportedModelError
from jspec.drafters import Drafter, DraftModel, MTPDrafter, PromptLookup
from jspec.engine import BatchResult, Engine, GenerationResult, compiler_options, generate
from jspec.forward import forward
from jspec.gate import HitDensityGate
from jspec.loop import DeviceGeneration, LoopSettings, generate_on_device
from jspec.memory import MemoryBudgetError
from jspec.model import Model, TextResult, checkpoints_package, load, load_hf, save
from jspec.sampling import Sampler
from jspec.state import DecodeState, init_state
from jspec.stats import BatchStats, SpecStats
from jspec.steps import commit, decode_step, prefill, verify_step

try:  # make `import jspec, checkpoints` find jspec's package even under a `checkpoints/` data folder
    checkpoints_package()
except ImportError:  # another project's regular `checkpoints` package: jspec.load / load_hf say so when called
    pass

__all__ = [
    "BatchResult",
    "BatchStats",
    "DecodeState",
    "DeviceGeneration",
    "DraftModel",
    "Drafter",
    "Engine",
    "GenerationResult",
    "HitDensityGate",
    "LoopSettings",
    "MTPDrafter",
    "MemoryBudgetError",
    "Model",
    "ModelConfig",
    "PromptLookup",
    "RopeConfig",
    "Sampler",
    "SpecStats",
    "TextResult",
    "TieGuard",
    "UnsupportedModelError",
    "commit",
    "compiler_options",
    "decode_step",
    "exactness",
    "forward",
    "generate",
    "generate_batch_on_device",
    "generate_on_device",
    "greedy_accept",
    "init_state",
    "load",
    "load_hf",
    "prefill",
    "save",
    "verify_step",
]
