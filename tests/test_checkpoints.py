"""checkpoints.load_hf (name mapping, dtypes, int4 on load, sharding, errors) and checkpoints.save / load (orbax)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_tiny_hf_model
from safetensors.numpy import load_file, save_file

import checkpoints
import jspec
from jspec.config import UnsupportedModelError
from pallas_kernels.int4 import Int4Weight, quantize

LINEARS = ("qkv", "o", "gate_up", "down")
jit_quantize = jax.jit(quantize)  # eager quantize compiles every op per shape: slow in CI


def hf_tensors(path) -> dict[str, np.ndarray]:
    return load_file(str(path / "model.safetensors"))


def copy_with(src, dst, *, edit_tensors=None, edit_config=None):
    """Copy a checkpoint directory, optionally editing its tensor dict and config dict in place."""
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = hf_tensors(dst)
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def leaves_equal_bitwise(a, b) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Name mapping.


@pytest.mark.parametrize("variant", ["qwen2", "glm4", "llama3_rope"])
def test_load_hf_maps_every_tensor(variant, tiny_hf_model):
    _, path = tiny_hf_model(variant)
    t = hf_tensors(path)
    params, cfg = checkpoints.load_hf(path)
    assert cfg.family == {"qwen2": "qwen2", "glm4": "glm4", "llama3_rope": "llama"}[variant]
    np.testing.assert_array_equal(params["embed"], t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], t["model.norm.weight"])
    if cfg.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(params["lm_head"], t["lm_head.weight"].T)
    assert len(params["layers"]) == cfg.num_layers
    for i, p in enumerate(params["layers"]):
        pre = f"model.layers.{i}"
        qkv = [t[f"{pre}.self_attn.{x}_proj.weight"].T for x in "qkv"]
        np.testing.assert_array_equal(p["qkv"], np.concatenate(qkv, axis=1))
        assert p["qkv"].shape == (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
        np.testing.assert_array_equal(p["o"], t[f"{pre}.self_attn.o_proj.weight"].T)
        if cfg.family == "glm4":
            gate_up = t[f"{pre}.mlp.gate_up_proj.weight"].T
        else:
            gate_up = np.concatenate([t[f"{pre}.mlp.gate_proj.weight"].T, t[f"{pre}.mlp.up_proj.weight"].T], axis=1)
        np.testing.assert_array_equal(p["gate_up"], gate_up)
        np.testing.assert_array_equal(p["down"], t[f"{pre}.mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(p["input_norm"], t[f"{pre}.input_layernorm.weight"])
        np.testing.assert_array_equal(p["post_attn_norm"], t[f"{pre}.post_attention_layernorm.weight"])
        if cfg.attention_bias:
            biases = [t[f"{pre}.self_attn.{x}_proj.bias"] for x in "qkv"]
            np.testing.assert_array_equal(p["qkv_bias"], np.concatenate(biases))
        else:
            assert "qkv_bias" not in p
        if cfg.post_norms:
            np.testing.assert_array_equal(p["post_self_attn_norm"], t[f"{pre}.post_self_attn_layernorm.weight"])
            np.testing.assert_array_equal(p["post_mlp_norm"], t[f"{pre}.post_mlp_layernorm.weight"])


def test_load_hf_bfloat16(tiny_hf_model):
    _, path = tiny_hf_model("qwen2")
    f32, _ = checkpoints.load_hf(path)
    bf16, _ = checkpoints.load_hf(path, dtype="bfloat16")
    assert jax.tree.structure(f32) == jax.tree.structure(bf16)
    for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))


# ---------------------------------------------------------------------------------------------------------------
# int4 on load.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_hf_int4(dtype, tiny_hf_model):
    _, path = tiny_hf_model("qwen2")
    dense, _ = checkpoints.load_hf(path)
    params, _ = checkpoints.load_hf(path, dtype=dtype, quantize="int4")
    for p, d in zip(params["layers"], dense["layers"], strict=True):
        for name in LINEARS:
            assert isinstance(p[name], Int4Weight), name
            assert leaves_equal_bitwise(p[name], jit_quantize(d[name]))  # quantized from the float32 checkpoint values
        for name in ("qkv_bias", "input_norm", "post_attn_norm"):
            assert not isinstance(p[name], Int4Weight) and p[name].dtype == jnp.dtype(dtype)
    assert params["embed"].dtype == jnp.dtype(dtype)
    assert isinstance(params["lm_head"], Int4Weight) == checkpoints.QUANTIZE_LM_HEAD_DEFAULT
    on, _ = checkpoints.load_hf(path, dtype=dtype, quantize="int4", quantize_lm_head=True)
    assert leaves_equal_bitwise(on["lm_head"], jit_quantize(dense["lm_head"]))
    off, _ = checkpoints.load_hf(path, dtype=dtype, quantize="int4", quantize_lm_head=False)
    assert off["lm_head"].dtype == jnp.dtype(dtype)


def test_load_hf_int4_tied(tiny_hf_model):
    _, path = tiny_hf_model("glm4_tied")
    dense, _ = checkpoints.load_hf(path)
    off, _ = checkpoints.load_hf(path, quantize="int4", quantize_lm_head=False)
    assert "lm_head" not in off  # tied and dense: logits use embed.T
    on, _ = checkpoints.load_hf(path, quantize="int4", quantize_lm_head=True)
    assert leaves_equal_bitwise(on["lm_head"], jit_quantize(dense["embed"].T))
    np.testing.assert_array_equal(on["embed"], dense["embed"])  # the gather still reads the dense embedding


def test_load_hf_argument_errors(tiny_hf_model):
    _, path = tiny_hf_model("qwen2")
    with pytest.raises(ValueError, match="dtype must be one of"):
        checkpoints.load_hf(path, dtype="float16")
    with pytest.raises(ValueError, match="quantize must be None or 'int4'"):
        checkpoints.load_hf(path, quantize="int8")
    with pytest.raises(ValueError, match="quantize_lm_head applies only with quantize='int4'"):
        checkpoints.load_hf(path, quantize_lm_head=True)


# ---------------------------------------------------------------------------------------------------------------
# Sharded checkpoints.


def test_sharded_checkpoint_loads_like_single_file(tiny_hf_model, tmp_path):
    _, single = tiny_hf_model("llama")
    build_tiny_hf_model("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded, cfg = checkpoints.load_hf(tmp_path)
    expected, cfg_single = checkpoints.load_hf(single)
    assert cfg == cfg_single
    assert leaves_equal_bitwise(sharded, expected)


def test_sharded_checkpoint_missing_shard(tmp_path):
    build_tiny_hf_model("llama", tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(checkpoints.CheckpointError, match=f"shard .*{shard.name} .* does not exist"):
        checkpoints.load_hf(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Errors that name the problem.


def test_unknown_model_type(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    bad = copy_with(path, tmp_path / "c", edit_config=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match=r"unknown model_type 'gpt2'; supported: .*glm4.*llama.*qwen2"):
        checkpoints.load_hf(bad)


def test_missing_tensor(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    bad = copy_with(path, tmp_path / "c", edit_tensors=lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(checkpoints.CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        checkpoints.load_hf(bad)


def test_unexpected_tensor(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    extra = np.zeros((4, 4), np.float32)
    bad = copy_with(path, tmp_path / "c", edit_tensors=lambda t: t.update({"model.layers.0.mlp.extra.weight": extra}))
    with pytest.raises(checkpoints.CheckpointError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.extra\.weight"):
        checkpoints.load_hf(bad)


def test_misshaped_tensor(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    wrong = np.zeros((32, 48), np.float32)
    bad = copy_with(
        path, tmp_path / "c", edit_tensors=lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": wrong})
    )
    with pytest.raises(
        checkpoints.CheckpointError,
        match=r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 48\), expected \(32, 64\)",
    ):
        checkpoints.load_hf(bad)


def test_unreadable_safetensors_file(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    bad = copy_with(path, tmp_path / "c")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(checkpoints.CheckpointError, match=r"cannot read safetensors file .*c/model\.safetensors"):
        checkpoints.load_hf(bad)


def test_pickle_weights_refused(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(checkpoints.CheckpointError, match=r"pickle weights \(pytorch_model\.bin\).*never unpickles"):
        checkpoints.load_hf(tmp_path)


def test_missing_config(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    bad = copy_with(path, tmp_path / "c")
    (bad / "config.json").unlink()
    with pytest.raises(checkpoints.CheckpointError, match=r"cannot read HuggingFace config .*c/config\.json"):
        checkpoints.load_hf(bad)


def test_tied_checkpoint_with_lm_head_copy(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2_tied")
    copy = copy_with(
        path, tmp_path / "c", edit_tensors=lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]})
    )
    params, _ = checkpoints.load_hf(copy)
    expected, _ = checkpoints.load_hf(path)
    assert leaves_equal_bitwise(params, expected)


# ---------------------------------------------------------------------------------------------------------------
# orbax save / load.


def asymmetric_int4(key) -> Int4Weight:
    w = jax.random.normal(key, (64, 64))  # an o_proj [Hq D, H]
    return jax.jit(quantize, static_argnames="symmetric")(w, symmetric=False)


@pytest.mark.parametrize("kind", ["float32", "int4"])
def test_save_load_round_trip_is_bit_identical(kind, tiny_hf_model, tmp_path):
    """float32 params; int4 linears (symmetric and asymmetric) with bfloat16 norms, embeddings and biases."""
    _, path = tiny_hf_model("glm4")
    if kind == "int4":
        params, cfg = checkpoints.load_hf(path, dtype="bfloat16", quantize="int4", quantize_lm_head=True)
        params["layers"][0]["o"] = asymmetric_int4(jax.random.key(0))  # zeros present next to None zeros
        params["extra"] = (jnp.arange(3, dtype=jnp.int32), [None, {"w": jnp.ones(2, jnp.bfloat16)}])
    else:
        params, cfg = checkpoints.load_hf(path)
    checkpoints.save(tmp_path / "ckpt", params, cfg)
    loaded, cfg2 = checkpoints.load(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert leaves_equal_bitwise(loaded, params)
    if kind == "int4":
        assert loaded["layers"][1]["qkv"].zeros is None and loaded["layers"][0]["o"].zeros.dtype == jnp.uint8
        assert loaded["layers"][0]["qkv"].packed.dtype == jnp.uint8
        assert isinstance(loaded["extra"], tuple) and loaded["extra"][1][0] is None
        del params["extra"], loaded["extra"]
    ids = np.arange(20) % cfg.vocab_size
    a, b = np.asarray(jspec.forward(params, cfg, ids)), np.asarray(jspec.forward(loaded, cfg, ids))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_each_array_is_checked_against_its_crc32(tiny_hf_model, tmp_path):
    """jspec.json lists zlib's CRC-32 of every array's bytes; a listed value the data does not match is an error
    naming the array; a v1 checkpoint (before checksums) loads unchecked; a v2 entry without one is refused."""
    import zlib

    _, path = tiny_hf_model("qwen2")
    params, cfg = checkpoints.load_hf(path)
    params["extra"] = np.linspace(0, 1, 5)  # float64 on the host: stored (and listed) as JAX's float32
    checkpoints.save(tmp_path / "ckpt", params, cfg)
    meta_path = tmp_path / "ckpt" / "jspec.json"
    meta = json.loads(meta_path.read_text())
    embed, extra = meta["tree"]["dict"]["embed"], meta["tree"]["dict"]["extra"]
    assert meta["version"] == 2 and extra["dtype"] == "float32"
    assert embed["crc32"] == zlib.crc32(np.asarray(params["embed"]).tobytes())

    def load_with(edit):
        edited = json.loads(json.dumps(meta))
        edit(edited)
        meta_path.write_text(json.dumps(edited))
        return checkpoints.load(tmp_path / "ckpt")

    with pytest.raises(checkpoints.CheckpointError, match="array 'params.embed' does not match the CRC-32"):
        load_with(lambda m: m["tree"]["dict"]["embed"].update(crc32=embed["crc32"] ^ 1))
    with pytest.raises(checkpoints.CheckpointError, match="lists array 'params.embed' without its crc32"):
        load_with(lambda m: m["tree"]["dict"]["embed"].pop("crc32"))

    def drop_checksums(node):
        if isinstance(node, dict):
            node.pop("crc32", None)
        for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            drop_checksums(child)

    def as_v1(m):  # v1 lists no checksums
        m["version"] = 1
        drop_checksums(m["tree"])

    loaded, _ = load_with(as_v1)
    assert leaves_equal_bitwise(loaded["embed"], params["embed"]) and loaded["extra"].dtype == jnp.float32
    with pytest.raises(checkpoints.CheckpointError, match="v3 is not jspec-params v1 or v2"):
        load_with(lambda m: m.update(version=3))


def test_save_load_errors(tiny_hf_model, tmp_path):
    _, path = tiny_hf_model("qwen2")
    params, cfg = checkpoints.load_hf(path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        checkpoints.save(tmp_path / "full", params, cfg)
    with pytest.raises(TypeError, match=r"params\.bad: cannot save a str"):
        checkpoints.save(tmp_path / "new", {**params, "bad": "text"}, cfg)
    with pytest.raises(FileNotFoundError, match="not a jspec checkpoint"):
        checkpoints.load(tmp_path / "full")
