"""Importers from the int4 formats users bring to the native `Int4Weight` layout (pallas_kernels/int4.py).

Every importer takes the format's tensors as arrays (numpy, torch-free) and returns an `Int4Weight` standing for
W[K, N] (x @ W), N = out_features, K = in_features. Supported (4-bit only):

  ORT MatMulNBits     B uint8 [N, ceil(K/bs), bs/2] (low nibble = even k), scales [N, K/bs] (or flat),
                      zero_points packed uint8 [N, ceil(K/bs / 2)] (low nibble = even block) or unpacked [N, K/bs]
                      floats holding integers; absent: 8.   W = (q - z) * s.
  compressed-tensors  pack-quantized: weight_packed int32 [N, K/8] (nibble i of word c = k 8c+i, stored as
                      signed int4 + 8), weight_scale [N, K/g], asymmetric weight_zero_point int32 [N/8, K/g]
                      packed along N the same way (signed + 8) or unpacked signed [N, K/g], optional
                      weight_g_idx [K].   W = (q - z) * s.
  GPTQ                qweight int32 [K/8, N] (nibble j of word r = k 8r+j), qzeros int32 [K/g, N/8] (nibble j of
                      word c = n 8c+j), scales [K/g, N], g_idx [K].  v1: W = (q - (z + 1)) * s;  v2: W = (q - z) * s.
  AWQ GEMM            qweight int32 [K, N/8], qzeros int32 [K/g, N/8], both with nibble i of word c holding column
                      8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales [K/g, N].   W = (q - z) * s.

Limits (each refused with a clear error, never approximated): group / block sizes must be multiples of 32 along K
(or one group over all of K); those are converted exactly by repeating the group's scale and zero over its
32-blocks. A group index (`g_idx`) must be non-decreasing (act-order checkpoints whose g_idx is a permutation are
refused) with every 32-block inside one group. K must be a multiple of 32. Zero points must lie in 0..15, except
a GPTQ v1 stored zero of 15 (effective 16), which is re-expressed exactly (codes - 1, zero 15) when the block has
no code 0 and refused otherwise.

Scales become bfloat16 (the native format): exact for bf16 / float32 scales that are bf16 values; an fp16 or
float32 scale is rounded to nearest, a relative change of at most 2**-8 per block (far below the int4 step).
Zero points that are all 8 are stored as None (the symmetric native variant); dequantization is identical.
"""

from __future__ import annotations

import abc
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallas_kernels.int4 import BLOCK, Int4Weight, pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


class FormatError(ValueError):
    """A quantized tensor cannot be imported exactly into the native int4 layout."""


# ---------------------------------------------------------------------------------------------------------------
# Shared conversion helpers.


def unpack_nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words [A, B] -> uint8 nibbles, word w expanded into entries 8w..8w+7 (LSB first) along axis 0 or 1."""
    u = np.ascontiguousarray(words, dtype=np.int32).view(np.uint32)
    nibbles = ((u[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8)  # [A, B, 8]
    if axis == 0:
        nibbles = nibbles.transpose(0, 2, 1)  # [A, 8, B]
        return nibbles.reshape(8 * u.shape[0], u.shape[1])
    return nibbles.reshape(u.shape[0], 8 * u.shape[1])


def _group_of_block(group_of_k: np.ndarray, name: str) -> np.ndarray:
    """Group index [K] -> group index per 32-block [K/32]; refuses a non-monotone index or a split block."""
    k = group_of_k.shape[0]
    if k % BLOCK:
        raise FormatError(f"{name}: K={k} is not a multiple of {BLOCK}")
    if np.any(np.diff(group_of_k) < 0):
        raise FormatError(
            f"{name}: g_idx is not monotone (act-order / desc_act checkpoint); such a permuted group order cannot "
            f"be stored as contiguous blocks of {BLOCK} — re-quantize without act-order"
        )
    blocks = group_of_k.reshape(k // BLOCK, BLOCK)
    if np.any(blocks != blocks[:, :1]):
        first = int(np.argmax(np.any(blocks != blocks[:, :1], axis=1)))
        raise FormatError(
            f"{name}: k {first * BLOCK}..{first * BLOCK + BLOCK - 1} spans several quantization groups; only groups "
            f"that are multiples of {BLOCK} along K are supported"
        )
    return blocks[:, 0]


def _group_index(k: int, group_size: int, g_idx, name: str) -> np.ndarray:
    """The group of every k: g_idx when given, else k // group_size (group_size -1 or 0: a single group)."""
    if g_idx is not None:
        g_idx = np.asarray(g_idx).astype(np.int64).reshape(-1)
        if g_idx.shape[0] != k:
            raise FormatError(f"{name}: g_idx has {g_idx.shape[0]} entries, expected K={k}")
        return g_idx
    if group_size is None or group_size <= 0:
        return np.zeros(k, np.int64)
    return np.arange(k, dtype=np.int64) // group_size


def to_native(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group_of_k: np.ndarray, name: str):
    """Integer codes q [N, K] (0..15), per-group scales [N, G] and zeros [N, G] (or None: 8) -> Int4Weight.

    group_of_k [K] maps every k to its group; each 32-block takes its group's scale and zero.
    """
    n, k = codes.shape
    groups = _group_of_block(group_of_k, name)
    num_groups = scales.shape[1]
    if groups.max(initial=0) >= num_groups:
        raise FormatError(f"{name}: group index {groups.max()} out of range for {num_groups} scale groups")
    block_scales = np.asarray(scales)[:, groups]
    if zeros is None:
        return pack(codes.astype(np.uint8), jnp.asarray(block_scales).astype(jnp.bfloat16))
    block_zeros = np.asarray(zeros).astype(np.int64)[:, groups]
    codes = codes.astype(np.int64)
    over = block_zeros > 15
    if np.any(over):
        codes, block_zeros = _lower_zero_16(codes, block_zeros, over, name)
    if block_zeros.min() < 0 or block_zeros.max() > 15:
        raise FormatError(f"{name}: zero points must lie in 0..15, found {block_zeros.min()}..{block_zeros.max()}")
    native_zeros = None if np.all(block_zeros == 8) else block_zeros.astype(np.uint8)
    return pack(codes.astype(np.uint8), jnp.asarray(block_scales).astype(jnp.bfloat16), native_zeros)


def _lower_zero_16(codes: np.ndarray, zeros: np.ndarray, over: np.ndarray, name: str):
    """Re-express blocks with zero point 16 as (q - 1) - 15 (exact when no code in the block is 0)."""
    if zeros.max() > 16:
        raise FormatError(f"{name}: zero point {zeros.max()} out of range")
    n, k = codes.shape
    blocks = codes.reshape(n, k // BLOCK, BLOCK)
    if np.any((blocks.min(axis=-1) == 0) & over):
        raise FormatError(
            f"{name}: a GPTQ v1 zero point of 16 (stored 15) meets a code 0 in the same block; (0 - 16) * s is "
            "outside what a 4-bit zero point can express"
        )
    blocks = blocks - over[..., None]
    return blocks.reshape(n, k), np.where(over, 15, zeros)


def concat_n(parts: list[Int4Weight]) -> Int4Weight:
    """Concatenate Int4Weights with the same K along N (fusing q/k/v or gate/up); mixed zero modes are unified."""
    packed = jnp.concatenate([p.packed for p in parts], axis=0)
    scales = jnp.concatenate([p.scales for p in parts], axis=0)
    if all(p.zeros is None for p in parts):
        return Int4Weight(packed, scales, None)
    zeros = [jnp.full(p.scales.shape, 8, jnp.uint8) if p.zeros is None else p.zeros for p in parts]
    return Int4Weight(packed, scales, jnp.concatenate(zeros, axis=0))


def _expect_shape(name: str, what: str, array, shape: tuple) -> np.ndarray:
    array = np.asarray(array)
    if tuple(array.shape) != tuple(shape):
        raise FormatError(f"{name}: {what} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    return array


def _matrix(name: str, what: str, array, shape: tuple) -> np.ndarray:
    """A 2-D array of `shape`, also accepted flattened (older ONNX exports store scales as [N * blocks])."""
    array = np.asarray(array)
    if array.ndim == 1 and array.size == shape[0] * shape[1]:
        array = array.reshape(shape)
    return _expect_shape(name, what, array, shape)


def _check_bits(bits: int, name: str) -> None:
    if bits != 4:
        raise FormatError(f"{name}: only 4-bit weights are supported, got bits={bits}")


# ---------------------------------------------------------------------------------------------------------------
# The formats.


def from_matmul_nbits(b, scales, zero_points=None, *, k: int, n: int, block_size: int, bits: int = 4, name="B"):
    """ONNX Runtime com.microsoft.MatMulNBits inputs (B, scales, zero_points) with attributes K, N -> Int4Weight."""
    _check_bits(bits, name)
    if block_size % BLOCK or k % block_size:
        raise FormatError(
            f"{name}: block_size {block_size} with K={k} is not supported (needs a multiple of {BLOCK} dividing K)"
        )
    blocks = k // block_size
    b = _expect_shape(name, "B", b, (n, blocks, block_size // 2)).astype(np.uint8)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(n, k)
    scales = _matrix(name, "scales", scales, (n, blocks))
    zeros = None
    if zero_points is not None:
        zp = np.asarray(zero_points)
        if zp.dtype == np.uint8:
            zp = _matrix(name, "zero_points", zp, (n, (blocks + 1) // 2))
            zeros = np.stack([zp & 0xF, zp >> 4], axis=-1).reshape(n, -1)[:, :blocks]
        else:
            zp = _matrix(name, "zero_points", zp, (n, blocks))
            if np.any(zp != np.round(zp)):
                raise FormatError(f"{name}: float zero_points must hold integers to be stored as int4 zero points")
            zeros = zp.astype(np.int64)
    return to_native(codes, scales, zeros, np.arange(k) // block_size, name)


def from_compressed_tensors(
    weight_packed, weight_scale, weight_zero_point=None, weight_g_idx=None, *, shape, group_size, name="weight"
):
    """compressed-tensors pack-quantized int4 tensors of a Linear with weight shape (N, K) -> Int4Weight.

    group_size: the config's group_size for strategy "group"; None or -1 for strategy "channel" (one group).
    Symmetric checkpoints have no weight_zero_point (signed zero 0 = stored 8); an unpacked signed int
    weight_zero_point [N, groups] (older versions store it so) is accepted too.
    """
    n, k = (int(d) for d in shape)
    if k % 8:
        raise FormatError(f"{name}: K={k} is not a multiple of 8")
    packed = _expect_shape(name, "weight_packed", weight_packed, (n, k // 8))
    codes = unpack_nibbles(packed.astype(np.int32), axis=1)
    scales = np.asarray(weight_scale)
    if scales.ndim != 2 or scales.shape[0] != n:
        raise FormatError(f"{name}: weight_scale has shape {tuple(scales.shape)}, expected ({n}, groups)")
    zeros = None
    if weight_zero_point is not None:
        zp = np.asarray(weight_zero_point)
        if zp.shape == (n, scales.shape[1]):  # unpacked signed zero points (older compressed-tensors versions)
            zeros = zp.astype(np.int64) + 8
        else:
            zp = _expect_shape(name, "weight_zero_point", zp, (-(-n // 8), scales.shape[1]))
            zeros = unpack_nibbles(zp.astype(np.int32), axis=0)[:n]
    return to_native(codes, scales, zeros, _group_index(k, group_size, weight_g_idx, name), name)


def from_gptq(qweight, qzeros, scales, g_idx=None, *, group_size: int, version: int = 1, name="qweight"):
    """GPTQ (AutoGPTQ / GPTQModel) int4 tensors of a Linear -> Int4Weight. version 1 adds the stored-zero + 1."""
    if version not in (1, 2):
        raise FormatError(f"{name}: unknown GPTQ checkpoint version {version} (1: 'gptq', 2: 'gptq_v2')")
    qweight = np.asarray(qweight)
    if qweight.ndim != 2:
        raise FormatError(f"{name}: qweight must be 2-D [K/8, N], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    codes = unpack_nibbles(qweight.astype(np.int32), axis=0).T  # [N, K]
    scales = np.asarray(scales)
    if scales.ndim != 2 or scales.shape[1] != n:
        raise FormatError(f"{name}: scales has shape {tuple(scales.shape)}, expected (groups, {n})")
    zp = _expect_shape(name, "qzeros", qzeros, (scales.shape[0], n // 8)).astype(np.int32)
    zeros = unpack_nibbles(zp, axis=1).astype(np.int64) + (1 if version == 1 else 0)  # [G, N]
    return to_native(codes, scales.T, zeros.T, _group_index(k, group_size, g_idx, name), name)


def from_awq(qweight, qzeros, scales, *, group_size: int, name="qweight"):
    """AutoAWQ GEMM-version int4 tensors of a Linear -> Int4Weight (nibble order AWQ_ORDER within each word)."""
    qweight = np.asarray(qweight)
    if qweight.ndim != 2:
        raise FormatError(f"{name}: qweight must be 2-D [K, N/8], got shape {tuple(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    inverse = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble inverse[j]

    def columns(words):
        nib = unpack_nibbles(words.astype(np.int32), axis=1)
        return nib.reshape(nib.shape[0], -1, 8)[:, :, inverse].reshape(nib.shape[0], -1)

    scales = np.asarray(scales)
    if scales.ndim != 2 or scales.shape[1] != n:
        raise FormatError(f"{name}: scales has shape {tuple(scales.shape)}, expected (groups, {n})")
    zp = _expect_shape(name, "qzeros", qzeros, (scales.shape[0], n // 8))
    codes = columns(qweight).T  # [N, K]
    zeros = columns(zp).T  # [N, G]
    return to_native(codes, scales.T, zeros, _group_index(k, group_size, None, name), name)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint-level schemes: which tensors a quantized Linear has and how to import them.


class QuantScheme(abc.ABC):
    """A quantized HF checkpoint's format (from config.json `quantization_config`)."""

    method: str
    suffixes: tuple[str, ...]  # tensors of one quantized Linear (prefix + "." + suffix), first one required

    def is_quantized(self, has, prefix: str) -> bool:
        """Whether the Linear at `prefix` is stored quantized (`has(name)` tells whether a tensor exists)."""
        return has(f"{prefix}.{self.suffixes[0]}")

    @abc.abstractmethod
    def load(self, get, has, prefix: str, k: int, n: int) -> Int4Weight:
        """Import the Linear at `prefix` (in K, out N); `get(name)` returns a tensor as numpy."""


class GPTQScheme(QuantScheme):
    method = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, group_size: int, version: int):
        self.group_size, self.version = group_size, version

    def load(self, get, has, prefix, k, n):
        g_idx = get(f"{prefix}.g_idx") if has(f"{prefix}.g_idx") else None
        w = from_gptq(
            get(f"{prefix}.qweight"),
            get(f"{prefix}.qzeros"),
            get(f"{prefix}.scales"),
            g_idx,
            group_size=self.group_size,
            version=self.version,
            name=prefix,
        )
        return _check_kn(w, prefix, k, n)


class AWQScheme(QuantScheme):
    method = "awq"
    suffixes = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int):
        self.group_size = group_size

    def load(self, get, has, prefix, k, n):
        w = from_awq(
            get(f"{prefix}.qweight"),
            get(f"{prefix}.qzeros"),
            get(f"{prefix}.scales"),
            group_size=self.group_size,
            name=prefix,
        )
        return _check_kn(w, prefix, k, n)


class CompressedTensorsScheme(QuantScheme):
    method = "compressed-tensors"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

    def __init__(self, group_size: int | None):
        self.group_size = group_size

    def load(self, get, has, prefix, k, n):
        def opt(suffix):
            return get(f"{prefix}.{suffix}") if has(f"{prefix}.{suffix}") else None

        shape = tuple(int(d) for d in np.asarray(get(f"{prefix}.weight_shape")).reshape(-1))
        if shape != (n, k):
            raise FormatError(f"{prefix}: weight_shape is {shape}, expected {(n, k)}")
        w = from_compressed_tensors(
            get(f"{prefix}.weight_packed"),
            get(f"{prefix}.weight_scale"),
            opt("weight_zero_point"),
            opt("weight_g_idx"),
            shape=shape,
            group_size=self.group_size,
            name=prefix,
        )
        return _check_kn(w, prefix, k, n)


def _check_kn(w: Int4Weight, prefix: str, k: int, n: int) -> Int4Weight:
    if w.shape != (k, n):
        raise FormatError(f"{prefix}: quantized weight is [K, N] = {w.shape}, expected {(k, n)}")
    return w


def scheme_from_config(quantization_config: dict[str, Any] | None) -> QuantScheme | None:
    """The QuantScheme of a config.json `quantization_config` (None: not quantized). Unsupported -> FormatError."""
    if not quantization_config:
        return None
    qc = quantization_config
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        _check_bits(int(qc.get("bits", 4)), "quantization_config")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        versions = {"gptq": 1, "gptq_v2": 2}
        if fmt not in versions:
            raise FormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return GPTQScheme(int(qc.get("group_size", 128)), versions[fmt])
    if method == "awq":
        _check_bits(int(qc.get("bits", qc.get("w_bit", 4))), "quantization_config")
        fmt = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if fmt != "gemm":
            raise FormatError(f"AWQ version {fmt!r} is not supported (only 'gemm')")
        return AWQScheme(int(qc.get("group_size", qc.get("q_group_size", 128))))
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise FormatError(f"quantization_config quant_method {method!r} is not supported (gptq, awq, compressed-tensors)")


def _compressed_tensors_scheme(qc: dict[str, Any]) -> CompressedTensorsScheme:
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise FormatError(f"compressed-tensors format {fmt!r} is not supported (only 'pack-quantized')")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if len(weights) != 1:
        raise FormatError(f"compressed-tensors: exactly one config group is supported, found {len(weights)}")
    w = weights[0]
    _check_bits(int(w.get("num_bits", 4)), "compressed-tensors config")
    if w.get("type", "int") != "int":
        raise FormatError(f"compressed-tensors: weight type {w.get('type')!r} is not supported (only 'int')")
    strategy = w.get("strategy")
    if strategy == "group":
        return CompressedTensorsScheme(int(w["group_size"]))
    if strategy == "channel":
        return CompressedTensorsScheme(None)
    raise FormatError(f"compressed-tensors: strategy {strategy!r} is not supported (group, channel)")
