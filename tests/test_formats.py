"""int4 format importers (checkpoints/formats.py) against numpy dequantizers written from each format's description,
and quantized HF checkpoints (GPTQ v1/v2, AWQ, compressed-tensors) loaded by `load_hf` against transformers.

Each reference below decodes element by element as the format's documentation states it; an importer is right when
`dequantize(imported)` equals the reference with its scales rounded to bfloat16 (the native scale dtype), exactly.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import build_tiny_hf_model

import checkpoints
import jspec
from checkpoints.formats import FormatError
from pallas_kernels.int4 import Int4Weight, dequantize

K, N = 128, 48
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: nibble i of a word holds column 8c + order[i]


def nibble(word, i: int) -> np.ndarray:
    """The i-th 4-bit field (bits 4i..4i+3) of int32 / uint32 words."""
    return (np.asarray(word).astype(np.int64) >> (4 * i)) & 0xF


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


# ---------------------------------------------------------------------------------------------------------------
# Reference dequantizers: W [K, N] float64, from the format descriptions.


def ref_matmul_nbits(b, scales, zero_points, k, n, block):
    """ORT MatMulNBits: B[n, blk, j] holds k = blk*bs + 2j (low nibble) and + 1 (high); zero points packed two
    blocks per byte (even block low), or unpacked floats; default 8. W = (q - z) * s."""
    w = np.zeros((k, n))
    for kk in range(k):
        blk, j = divmod(kk, block)
        q = nibble(b[:, blk, j // 2], j % 2)
        if zero_points is None:
            z = 8
        elif zero_points.dtype == np.uint8:
            z = nibble(zero_points[:, blk // 2], blk % 2)
        else:
            z = zero_points[:, blk]
        w[kk] = (q - z) * scales[:, blk]
    return w


def ref_compressed_tensors(packed, scale, zero_point, g_idx, k, n):
    """pack-quantized: word c of row n holds k = 8c + i in nibble i, value = signed int4 + 8; zero points packed
    along n the same way (signed + 8), absent = signed 0. W = (q_signed - z_signed) * scale[n, g_idx[k]]."""
    w = np.zeros((k, n))
    for kk in range(k):
        q = nibble(packed[:, kk // 8], kk % 8) - 8
        g = g_idx[kk]
        if zero_point is None:
            z = 0
        else:
            z = np.array([nibble(zero_point[nn // 8, g], nn % 8) for nn in range(n)]) - 8
        w[kk] = (q - z) * scale[:, g]
    return w


def ref_gptq(qweight, qzeros, scales, g_idx, version):
    """GPTQ: qweight[r, n] holds k = 8r + j in nibble j; qzeros[g, c] holds n = 8c + j in nibble j.
    v1: W = (q - (z + 1)) * s;  v2: W = (q - z) * s."""
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    w = np.zeros((k, n))
    for kk in range(k):
        q = nibble(qweight[kk // 8], kk % 8)
        g = g_idx[kk]
        z = np.array([nibble(qzeros[g, nn // 8], nn % 8) for nn in range(n)]) + (1 if version == 1 else 0)
        w[kk] = (q - z) * scales[g]
    return w


def ref_awq(qweight, qzeros, scales, group):
    """AWQ GEMM: qweight[k, c] nibble i holds column 8c + AWQ_PACK_ORDER[i]; qzeros likewise. W = (q - z) * s."""
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    w = np.zeros((k, n))
    for kk in range(k):
        g = kk // group
        for c in range(n // 8):
            for i, col in enumerate(AWQ_PACK_ORDER):
                q = nibble(qweight[kk, c], i)
                z = nibble(qzeros[g, c], i)
                w[kk, 8 * c + col] = (q - z) * scales[g, 8 * c + col]
    return w


# ---------------------------------------------------------------------------------------------------------------
# Random format tensors.


def rand_words(rng, shape) -> np.ndarray:
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def rand_scales(rng, shape, dtype=np.float16, std=0.05) -> np.ndarray:
    return (std * rng.uniform(0.2, 1.0, size=shape)).astype(dtype)


def assert_imports_exactly(w: Int4Weight, ref: np.ndarray, ref_bf16: np.ndarray) -> None:
    """dequantize(w) equals the reference with bf16 scales bit for bit, and the raw reference within 2**-8."""
    assert isinstance(w, Int4Weight) and w.shape == ref.shape
    got = np.asarray(dequantize(w, jnp.float32))
    np.testing.assert_array_equal(got, ref_bf16.astype(np.float32))
    assert np.all(np.abs(got - ref) <= 2.0**-8 * np.abs(ref) + 1e-12)


# ---------------------------------------------------------------------------------------------------------------
# ORT MatMulNBits.


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("zp_kind", ["none", "packed", "float"])
def test_matmul_nbits_matches_reference(block, zp_kind):
    rng = np.random.default_rng(block)
    k = 96 if block == 32 else 192  # 3 blocks of 32 (odd: exercises the packed zero-point padding), 3 of 64
    blocks = k // block
    b = rng.integers(0, 256, size=(N, blocks, block // 2), dtype=np.uint8)
    scales = rand_scales(rng, (N, blocks), np.float32)
    zp = {
        "none": None,
        "packed": rng.integers(0, 256, size=(N, (blocks + 1) // 2), dtype=np.uint8),
        "float": rng.integers(0, 16, size=(N, blocks)).astype(np.float32),
    }[zp_kind]
    w = checkpoints.from_matmul_nbits(b, scales, zp, k=k, n=N, block_size=block)
    ref = ref_matmul_nbits(b, scales, zp, k, N, block)
    assert_imports_exactly(w, ref, ref_matmul_nbits(b, bf16(scales), zp, k, N, block))
    assert (w.zeros is None) == (zp_kind == "none")


def test_matmul_nbits_flat_scales_and_errors():
    rng = np.random.default_rng(1)
    b = rng.integers(0, 256, size=(N, 4, 16), dtype=np.uint8)
    scales = rand_scales(rng, (N, 4), np.float32)
    flat = checkpoints.from_matmul_nbits(b, scales.reshape(-1), k=128, n=N, block_size=32)
    full = checkpoints.from_matmul_nbits(b, scales, k=128, n=N, block_size=32)
    np.testing.assert_array_equal(np.asarray(flat.packed), np.asarray(full.packed))
    np.testing.assert_array_equal(np.asarray(flat.scales), np.asarray(full.scales))
    with pytest.raises(FormatError, match="block_size 16"):
        checkpoints.from_matmul_nbits(b.reshape(N, 8, 8), scales, k=128, n=N, block_size=16)
    with pytest.raises(FormatError, match=r"B has shape \(48, 4, 16\), expected \(48, 2, 32\)"):
        checkpoints.from_matmul_nbits(b, scales, k=128, n=N, block_size=64)
    with pytest.raises(FormatError, match="only 4-bit"):
        checkpoints.from_matmul_nbits(b, scales, k=128, n=N, block_size=32, bits=8)
    with pytest.raises(FormatError, match="integers"):
        checkpoints.from_matmul_nbits(b, scales, np.full((N, 4), 7.5, np.float32), k=128, n=N, block_size=32)


# ---------------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized.


@pytest.mark.parametrize("group", [32, 64, None])  # None: strategy "channel" (one group over K)
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_matches_reference(group, symmetric):
    rng = np.random.default_rng(7)
    groups = 1 if group is None else K // group
    packed = rand_words(rng, (N, K // 8))
    scale = rand_scales(rng, (N, groups), np.float32)
    zp = None if symmetric else rand_words(rng, (N // 8, groups))
    g_idx = np.zeros(K, np.int64) if group is None else np.arange(K) // group
    w = checkpoints.from_compressed_tensors(packed, scale, zp, shape=(N, K), group_size=group)
    ref = ref_compressed_tensors(packed, scale, zp, g_idx, K, N)
    assert_imports_exactly(w, ref, ref_compressed_tensors(packed, bf16(scale), zp, g_idx, K, N))
    assert (w.zeros is None) == symmetric  # symmetric: signed zero 0 == native zero point 8


def test_compressed_tensors_zero_point_rows_not_multiple_of_8():
    rng = np.random.default_rng(3)
    n = 44  # zero points packed along N: ceil(44 / 8) = 6 words, the last one half padding
    packed, scale, zp = rand_words(rng, (n, K // 8)), rand_scales(rng, (n, 4), np.float32), rand_words(rng, (6, 4))
    w = checkpoints.from_compressed_tensors(packed, scale, zp, shape=(n, K), group_size=32)
    g_idx = np.arange(K) // 32
    ref = ref_compressed_tensors(packed, scale, zp, g_idx, K, n)
    assert_imports_exactly(w, ref, ref_compressed_tensors(packed, bf16(scale), zp, g_idx, K, n))


def test_compressed_tensors_unpacked_zero_points():
    """Older versions store signed int8 zero points [N, groups] unpacked; same weights as the packed form."""
    rng = np.random.default_rng(9)
    packed, scale, zp = rand_words(rng, (N, K // 8)), rand_scales(rng, (N, 4), np.float32), rand_words(rng, (N // 8, 4))
    signed = np.stack([nibble(zp[nn // 8], nn % 8) for nn in range(N)]).astype(np.int8) - 8
    unpacked = checkpoints.from_compressed_tensors(packed, scale, signed, shape=(N, K), group_size=32)
    g_idx = np.arange(K) // 32
    ref = ref_compressed_tensors(packed, scale, zp, g_idx, K, N)
    assert_imports_exactly(unpacked, ref, ref_compressed_tensors(packed, bf16(scale), zp, g_idx, K, N))


def test_compressed_tensors_g_idx():
    rng = np.random.default_rng(4)
    packed, scale = rand_words(rng, (N, K // 8)), rand_scales(rng, (N, 2), np.float32)
    g_idx = np.arange(K) // 64
    w = checkpoints.from_compressed_tensors(packed, scale, None, g_idx, shape=(N, K), group_size=64)
    assert_imports_exactly(
        w,
        ref_compressed_tensors(packed, scale, None, g_idx, K, N),
        ref_compressed_tensors(packed, bf16(scale), None, g_idx, K, N),
    )
    with pytest.raises(FormatError, match="not monotone"):
        checkpoints.from_compressed_tensors(packed, scale, None, rng.permutation(g_idx), shape=(N, K), group_size=64)


# ---------------------------------------------------------------------------------------------------------------
# GPTQ.


def gptq_tensors(rng, group, *, v1_zero_15=False):
    groups = K // group
    qweight = rand_words(rng, (K // 8, N))
    qzeros = rand_words(rng, (groups, N // 8))
    if not v1_zero_15:  # avoid stored 15 (effective 16 in v1), tested separately
        qzeros = (qzeros.view(np.uint32) & np.uint32(0x77777777)).view(np.int32)
    return qweight, qzeros, rand_scales(rng, (groups, N))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("group", [32, 128])
def test_gptq_matches_reference(version, group):
    rng = np.random.default_rng(version * 100 + group)
    qweight, qzeros, scales = gptq_tensors(rng, group)
    g_idx = np.arange(K) // group
    w = checkpoints.from_gptq(qweight, qzeros, scales, g_idx, group_size=group, version=version)
    ref = ref_gptq(qweight, qzeros, scales, g_idx, version)
    assert_imports_exactly(w, ref, ref_gptq(qweight, qzeros, bf16(scales), g_idx, version))
    w_no_gidx = checkpoints.from_gptq(qweight, qzeros, scales, group_size=group, version=version)
    np.testing.assert_array_equal(np.asarray(w_no_gidx.packed), np.asarray(w.packed))


def test_gptq_v1_symmetric_becomes_native_symmetric():
    rng = np.random.default_rng(5)
    qweight, _, scales = gptq_tensors(rng, 32)
    qzeros = np.full((K // 32, N // 8), 0x77777777, np.int32)  # stored 7 = zero point 8 in v1
    w = checkpoints.from_gptq(qweight, qzeros, scales, group_size=32, version=1)
    assert w.zeros is None
    g_idx = np.arange(K) // 32
    assert_imports_exactly(
        w, ref_gptq(qweight, qzeros, scales, g_idx, 1), ref_gptq(qweight, qzeros, bf16(scales), g_idx, 1)
    )


def test_gptq_v1_zero_16():
    """A v1 stored zero 15 means 16: exact as (q - 1) - 15 when the block has no code 0, refused otherwise."""
    rng = np.random.default_rng(6)
    qweight, qzeros, scales = gptq_tensors(rng, 32, v1_zero_15=True)
    qzeros[:] = -1  # every stored zero 15
    u = qweight.view(np.uint32)
    no_zero_code = u | np.uint32(0x11111111)  # every code odd, so none is 0
    w = checkpoints.from_gptq(no_zero_code.view(np.int32), qzeros, scales, group_size=32, version=1)
    g_idx = np.arange(K) // 32
    ref = ref_gptq(no_zero_code.view(np.int32), qzeros, scales, g_idx, 1)
    assert_imports_exactly(w, ref, ref_gptq(no_zero_code.view(np.int32), qzeros, bf16(scales), g_idx, 1))
    with_zero_code = (u & np.uint32(0xFFFFFFF0)).view(np.int32)  # k = 0 mod 8 has code 0
    with pytest.raises(FormatError, match="zero point of 16"):
        checkpoints.from_gptq(with_zero_code, qzeros, scales, group_size=32, version=1)


def test_gptq_refusals():
    rng = np.random.default_rng(8)
    qweight, qzeros, scales = gptq_tensors(rng, 32)
    act_order = rng.permutation(np.arange(K) // 32)
    with pytest.raises(FormatError, match="act-order"):
        checkpoints.from_gptq(qweight, qzeros, scales, act_order, group_size=32)
    q16, z16, s16 = rand_words(rng, (K // 8, N)), rand_words(rng, (K // 16, N // 8)), rand_scales(rng, (K // 16, N))
    with pytest.raises(FormatError, match="multiples of 32"):
        checkpoints.from_gptq(q16, z16, s16, group_size=16)
    with pytest.raises(FormatError, match="qzeros has shape"):
        checkpoints.from_gptq(qweight, qzeros[:1], scales, group_size=32)


# ---------------------------------------------------------------------------------------------------------------
# AWQ.


@pytest.mark.parametrize("group", [32, 64])
def test_awq_matches_reference(group):
    rng = np.random.default_rng(group)
    qweight, qzeros = rand_words(rng, (K, N // 8)), rand_words(rng, (K // group, N // 8))
    scales = rand_scales(rng, (K // group, N))
    w = checkpoints.from_awq(qweight, qzeros, scales, group_size=group)
    ref = ref_awq(qweight, qzeros, scales, group)
    assert_imports_exactly(w, ref, ref_awq(qweight, qzeros, bf16(scales), group))


def test_awq_nibble_order():
    """Column j of a word sits in nibble [0, 4, 1, 5, 2, 6, 3, 7][j]: word 0x76543210 holds columns 0,2,4,6,1,3,5,7."""
    qweight = np.full((32, 1), 0x76543210, np.int64).astype(np.uint32).view(np.int32)
    qzeros = np.zeros((1, 1), np.int32)
    w = checkpoints.from_awq(qweight, qzeros, np.ones((1, 8), np.float16), group_size=32)
    np.testing.assert_array_equal(np.asarray(dequantize(w))[0], [0, 4, 1, 5, 2, 6, 3, 7])


# ---------------------------------------------------------------------------------------------------------------
# Config detection.


def test_scheme_from_config():
    s = checkpoints.scheme_from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq"}
    )
    assert (s.method, s.version, s.group_size) == ("gptq", 1, 128)
    assert checkpoints.scheme_from_config({"quant_method": "gptq", "bits": 4, "format": "gptq_v2"}).version == 2
    assert checkpoints.scheme_from_config({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"})
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}
        },
    }
    assert checkpoints.scheme_from_config(ct).group_size == 32
    assert checkpoints.scheme_from_config(None) is None
    bad = [
        ({"quant_method": "gptq", "bits": 8}, "only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({**ct, "format": "float-quantized"}, "float-quantized"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ]
    for config, message in bad:
        with pytest.raises(FormatError, match=message):
            checkpoints.scheme_from_config(config)


# ---------------------------------------------------------------------------------------------------------------
# Quantized HF checkpoints through load_hf, against transformers running the reference-dequantized weights.

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def quantized_linear(rng, method: str, n: int, k: int, group: int):
    """Random format tensors of one Linear (out n, in k) -> (tensors by suffix, reference W [k, n])."""
    std = 1.0 / (4.6 * k**0.5)  # codes - zero ~ uniform over 16 values (std 4.6): W ~ N(0, 1/k)-sized
    groups = k // group
    g_idx = np.arange(k) // group
    # bf16-valued fp16 scales: every format dequantizes exactly in the native layout, so logits can be compared.
    scales = bf16(rand_scales(rng, (groups, n), std=std)).astype(np.float16)
    if method in ("gptq", "gptq_v2"):
        version = 1 if method == "gptq" else 2
        qweight, qzeros = rand_words(rng, (k // 8, n)), rand_words(rng, (groups, n // 8))
        qzeros = (qzeros.view(np.uint32) & np.uint32(0x77777777) | np.uint32(0x44444444)).view(np.int32)
        tensors = dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx.astype(np.int32))
        return tensors, ref_gptq(qweight, qzeros, scales, g_idx, version)
    if method == "awq":
        qweight, qzeros = rand_words(rng, (k, n // 8)), rand_words(rng, (groups, n // 8))
        return dict(qweight=qweight, qzeros=qzeros, scales=scales), ref_awq(qweight, qzeros, scales, group)
    packed, zp = rand_words(rng, (n, k // 8)), rand_words(rng, (n // 8, groups))
    tensors = dict(
        weight_packed=packed,
        weight_scale=scales.T.astype(np.float32),
        weight_zero_point=zp,
        weight_shape=np.array([n, k], np.int64),
    )
    return tensors, ref_compressed_tensors(packed, scales.T.astype(np.float64), zp, g_idx, k, n)


QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "checkpoint_format": "gptq"},
    "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64},
            }
        },
        "ignore": ["lm_head"],
    },
}


def write_quantized_checkpoint(variant: str, method: str, out_dir, tmp_path):
    """A tiny HF model whose decoder linears are random `method` tensors; returns the torch model holding the
    reference-dequantized weights (the oracle)."""
    import torch
    from safetensors.numpy import save_file

    model = build_tiny_hf_model(variant, tmp_path / "float")
    rng = np.random.default_rng(0)
    tensors = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        for lin in LINEARS:
            prefix = f"model.layers.{i}.{lin}"
            n, k = tensors.pop(f"{prefix}.weight").shape
            parts, ref = quantized_linear(rng, method, n, k, group=64)
            tensors.update({f"{prefix}.{suffix}": value for suffix, value in parts.items()})
            with torch.no_grad():
                model.get_submodule(prefix).weight.copy_(torch.from_numpy(ref.T.astype(np.float32)))
    out_dir.mkdir()
    # safetensors.numpy writes the raw buffer: a non-contiguous (transposed) array would be saved scrambled.
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[method]
    (out_dir / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(
    ("method", "variant"), [("gptq", "qwen2"), ("gptq_v2", "llama"), ("awq", "llama"), ("compressed-tensors", "qwen2")]
)
def test_quantized_checkpoint_matches_transformers(method, variant, tmp_path):
    import torch

    model = write_quantized_checkpoint(variant, method, tmp_path / "q", tmp_path)
    params, cfg = checkpoints.load_hf(tmp_path / "q")
    layer = params["layers"][0]
    for name in ("qkv", "o", "gate_up", "down"):
        assert isinstance(layer[name], Int4Weight), name
    assert not isinstance(params["lm_head"], Int4Weight)  # dense in the checkpoint, quantize=None
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 72)
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)[None]).logits[0].numpy()
    got = np.asarray(jspec.forward(params, cfg, ids))
    assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected))
    q_head, _ = checkpoints.load_hf(tmp_path / "q", quantize="int4", quantize_lm_head=True)
    assert isinstance(q_head["lm_head"], Int4Weight)
    np.testing.assert_array_equal(
        np.asarray(q_head["layers"][1]["down"].packed), np.asarray(params["layers"][1]["down"].packed)
    )


def test_quantized_checkpoint_act_order_refused(tmp_path):
    write_quantized_checkpoint("llama", "gptq", tmp_path / "q", tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"  # K = 128: two groups of 64
    tensors[name] = np.random.default_rng(0).permutation(tensors[name])
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.down_proj: g_idx is not monotone"):
        checkpoints.load_hf(tmp_path / "q")
