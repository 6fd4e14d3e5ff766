"""jspec: byte-exact speculative decoding of int4 LLMs in JAX/Pallas.

Speculative output is token-for-token identical to plain greedy decoding, for every drafter and every k.
"""

from jspec.accept import TieGuard, greedy_accept
from jspec.config import ModelConfig, RopeConfig, UnsupportedModelError
from jspec.drafters import Drafter, MTPDrafter, PromptLookup
from jspec.engine import Engine, GenerationResult, compiler_options, generate
from jspec.forward import forward
from jspec.gate import HitDensityGate
from jspec.generate import DeviceGeneration, LoopSettings, generate_on_device
from jspec.state import DecodeState, init_state
from jspec.stats import SpecStats
from jspec.steps import commit, decode_step, prefill, verify_step

__all__ = [
    "DecodeState",
    "DeviceGeneration",
    "Drafter",
    "Engine",
    "GenerationResult",
    "HitDensityGate",
    "LoopSettings",
    "MTPDrafter",
    "ModelConfig",
    "PromptLookup",
    "RopeConfig",
    "SpecStats",
    "TieGuard",
    "UnsupportedModelError",
    "commit",
    "compiler_options",
    "decode_step",
    "forward",
    "generate",
    "generate_on_device",
    "greedy_accept",
    "init_state",
    "prefill",
    "verify_step",
]
