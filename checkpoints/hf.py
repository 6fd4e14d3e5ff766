"""HuggingFace checkpoint import: a directory with config.json and safetensors weights -> (params, ModelConfig).

Weights are read from `model.safetensors` or a sharded `model.safetensors.index.json`; pickle files (*.bin, *.pt)
are never opened. Names are mapped to the jspec params layout (jspec/models/dense.py): torch Linear weights
[out, in] are transposed to [K, N] = [in, out]; q/k/v fuse into `qkv` [H, (Hq + 2 Hkv) D] and gate/up into
`gate_up` [H, 2I] ([gate | up]; GLM-4 ships it fused). A tied checkpoint has no `lm_head` unless it is quantized.

quantize="int4": every linear (qkv, o, gate_up, down; lm_head only with quantize_lm_head=True) becomes an
`Int4Weight` by `pallas_kernels.int4.quantize` (symmetric, round to nearest) of the checkpoint's float32 values;
biases, norms and embeddings stay dense in `dtype`. A checkpoint whose config.json has a `quantization_config`
(gptq / awq / compressed-tensors) has its quantized linears imported exactly to the native layout
(checkpoints/formats.py) whatever `quantize` says; its dense linears follow `quantize`.

MTP heads, which transformers drops, are read by checkpoints/hf_mtp.py into params["mtp"] when present.

mesh (a tensor-parallel mesh, `jspec.tensor_parallel`): each layer is split into its shards and each shard moved
to its device as soon as the layer is read (`Linears.place`), then the embedding, final norm and lm_head: no
device holds more than its shards plus the one layer being read. The params come back stacked on the mesh.

Families register a loader in FAMILY_LOADERS: loader(ckpt, cfg, linears, quantize_lm_head) -> params, reading
tensors through `Checkpoint.get` and linears through `Linears.weight` / `Linears.bias` (`linears.dtype` is the
dense dtype), and handing each layer, then the rest, to `Linears.place`; every tensor in the checkpoint must be
consumed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.formats import QuantScheme, concat_n, scheme_from_config
from jspec import tensor_parallel
from jspec.config import ModelConfig, UnsupportedModelError, read_hf_config
from pallas_kernels.int4 import quantize

int4_quantize = jax.jit(quantize)  # dense W [K, N] -> symmetric Int4Weight; one compile per shape (eager: per op)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# lm_head stays dense by default under quantize="int4": measured on 30 tiny random HF models (qwen2 / llama / glm4,
# tied and untied, 5 seeds), an int4 lm_head on top of the int4 body lowered top-1 agreement with float from 65.2%
# to 62.3% over random tokens (74.7% -> 71.5% along the float greedy path, 40-token greedy match 9.4% -> 7.0%) and
# by itself flipped 13-16% of the argmaxes. It does not keep greedy agreement, so it is opt-in.
QUANTIZE_LM_HEAD_DEFAULT = False
# Non-parameter buffers some exporters save; never needed.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint directory cannot be imported: missing / unexpected / mis-shaped tensor, unreadable file."""


class Checkpoint:
    """The tensors of a safetensors checkpoint directory by name; remembers which ones were read."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = os.fspath(hf_dir)
        self._file_of = _tensor_files(self.dir)
        self._handles: dict[str, object] = {}
        self._used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> jax.Array:
        """The tensor `name` in its stored dtype; raises CheckpointError if missing, not of `shape`, or holding a
        NaN or inf (which int4 quantization would otherwise hide: a block's scale absorbs it)."""
        if name not in self._file_of:
            raise CheckpointError(f"missing tensor {name!r} in {self.dir}")
        if shape is not None and self.shape(name) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {self.shape(name)}, expected {tuple(shape)}")
        path = self._file_of[name]
        try:
            tensor = self._handle(name).get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt data
            raise CheckpointError(f"cannot read tensor {name!r} from {path}: {e}") from e
        if jnp.issubdtype(tensor.dtype, jnp.floating):
            bad = int(jnp.size(tensor) - jnp.count_nonzero(jnp.isfinite(tensor)))
            if bad:
                raise CheckpointError(f"tensor {name!r} in {path} holds {bad} non-finite value(s) (NaN or inf)")
        self._used.add(name)
        return tensor

    def get_numpy(self, name: str) -> np.ndarray:
        return np.asarray(self.get(name))

    def unused(self) -> list[str]:
        return sorted(n for n in self._file_of if n not in self._used and not n.endswith(IGNORED_SUFFIXES))

    def skip(self, name: str) -> None:
        """Mark a tensor as deliberately not used (e.g. a duplicated tied lm_head)."""
        self._used.add(name)

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self._file_of[name]
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="flax")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
        return self._handles[path]


def _tensor_files(hf_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file path, from the shard index or the single file."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"checkpoint directory {hf_dir!r} does not exist")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read shard index {index}: {e}") from e
        files = {name: os.path.join(hf_dir, shard) for name, shard in weight_map.items()}
        for path in sorted(set(files.values())):
            if not os.path.exists(path):
                raise CheckpointError(f"shard {path} listed in {index} does not exist")
        return files
    if os.path.exists(single):
        from safetensors import safe_open

        try:
            with safe_open(single, framework="flax") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as e:
            raise CheckpointError(f"cannot read safetensors file {single}: {e}") from e
    pickles = sorted(f for f in os.listdir(hf_dir) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickles:
        raise CheckpointError(
            f"{hf_dir} holds only pickle weights ({', '.join(pickles)}); jspec never unpickles (it can run "
            "arbitrary code). Convert them to safetensors first (e.g. transformers' save_pretrained)"
        )
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")


class Linears:
    """Loads linear layers in the jspec layout: dense [K, N] in `dtype`, or Int4Weight (imported or quantized).
    mesh: where `place` puts a params subtree: None (as it is), or its shards on a tensor-parallel mesh."""

    def __init__(self, ckpt: Checkpoint, scheme: QuantScheme | None, quantize: bool, dtype, cfg=None, mesh=None):
        self.ckpt, self.scheme, self.quantize, self.dtype = ckpt, scheme, quantize, dtype
        self.cfg, self.mesh = cfg, mesh

    def place(self, tree):
        """A params subtree (a layer, an MTP head, the embedding and lm_head) as it is, or stacked on the mesh."""
        return tree if self.mesh is None else tensor_parallel.shard_params(tree, self.cfg, self.mesh)

    def weight(self, prefixes: list[str], k: int, ns: list[int], *, quantize: bool | None = None):
        """HF Linears `prefix.weight` [n, k] for each prefix, fused along N -> [K, sum(ns)]."""
        if self.scheme is not None and self.scheme.is_quantized(self.ckpt.has, prefixes[0]):
            return concat_n(
                [
                    self.scheme.load(self.ckpt.get_numpy, self.ckpt.has, p, k, n)
                    for p, n in zip(prefixes, ns, strict=True)
                ]
            )
        dense = jnp.concatenate(
            [self.ckpt.get(f"{p}.weight", (n, k)).T for p, n in zip(prefixes, ns, strict=True)], axis=1
        )
        if self.quantize if quantize is None else quantize:
            return int4_quantize(dense.astype(jnp.float32))
        return dense.astype(self.dtype)

    def bias(self, prefixes: list[str], ns: list[int]) -> jax.Array:
        return jnp.concatenate([self.ckpt.get(f"{p}.bias", (n,)) for p, n in zip(prefixes, ns, strict=True)]).astype(
            self.dtype
        )


def load_dense(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, quantize_lm_head: bool) -> dict:
    """qwen2 / llama / glm4 tensors -> the params layout of jspec/models/dense.py."""
    layers = [linears.place(dense_layer_params(ckpt, cfg, linears, f"model.layers.{i}")) for i in range(cfg.num_layers)]
    return dict(outer_params(ckpt, cfg, linears, quantize_lm_head), layers=layers)


def outer_params(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, quantize_lm_head: bool) -> dict:
    """embed, final_norm and lm_head (`lm_head_weight`), placed."""
    h, dt = cfg.hidden_size, linears.dtype
    embed = ckpt.get("model.embed_tokens.weight", (cfg.vocab_size, h))
    params = dict(embed=embed.astype(dt), final_norm=ckpt.get("model.norm.weight", (h,)).astype(dt))
    lm_head = lm_head_weight(ckpt, cfg, linears, embed, quantize_lm_head)
    if lm_head is not None:
        params["lm_head"] = lm_head
    return linears.place(params)


def dense_layer_params(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, pre: str) -> dict:
    """One dense decoder layer `pre` (e.g. "model.layers.3", or a DeepSeek-layout MTP layer) -> its params."""
    h, inter, dt = cfg.hidden_size, cfg.intermediate_size, linears.dtype

    def vec(name: str, size: int) -> jax.Array:
        return ckpt.get(name, (size,)).astype(dt)

    attn, mlp = f"{pre}.self_attn", f"{pre}.mlp"
    qkv = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
    qkv_n = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    gate_up = [f"{mlp}.gate_up_proj"] if cfg.family == "glm4" else [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
    gate_up_n = [2 * inter] if cfg.family == "glm4" else [inter, inter]
    p = dict(
        input_norm=vec(f"{pre}.input_layernorm.weight", h),
        qkv=linears.weight(qkv, h, qkv_n),
        o=linears.weight([f"{attn}.o_proj"], cfg.q_size, [h]),
        post_attn_norm=vec(f"{pre}.post_attention_layernorm.weight", h),
        gate_up=linears.weight(gate_up, h, gate_up_n),
        down=linears.weight([f"{mlp}.down_proj"], inter, [h]),
    )
    if cfg.attention_bias:
        p["qkv_bias"] = linears.bias(qkv, qkv_n)
    if cfg.o_bias:
        p["o_bias"] = linears.bias([f"{attn}.o_proj"], [h])
    if cfg.mlp_bias:
        p["gate_up_bias"] = linears.bias(gate_up, gate_up_n)
        p["down_bias"] = linears.bias([f"{mlp}.down_proj"], [h])
    if cfg.post_norms:
        p["post_self_attn_norm"] = vec(f"{pre}.post_self_attn_layernorm.weight", h)
        p["post_mlp_norm"] = vec(f"{pre}.post_mlp_layernorm.weight", h)
    return p


def lm_head_weight(ckpt: Checkpoint, cfg: ModelConfig, linears: Linears, embed: jax.Array, quantize_lm_head: bool):
    """lm_head [H, V]: the checkpoint's, or for tied embeddings None (use embed.T) unless int4 is wanted."""
    h, v = cfg.hidden_size, cfg.vocab_size
    if not cfg.tie_word_embeddings:
        return linears.weight(["lm_head"], h, [v], quantize=quantize_lm_head)
    if ckpt.has("lm_head.weight"):
        ckpt.skip("lm_head.weight")  # some exporters save the tied copy too
    return int4_quantize(embed.astype(jnp.float32).T) if quantize_lm_head else None


FAMILY_LOADERS: dict[str, Callable[..., dict]] = {"qwen2": load_dense, "llama": load_dense, "glm4": load_dense}


def load_hf(
    hf_dir: str | os.PathLike,
    dtype: str = "float32",
    quantize: str | None = None,
    quantize_lm_head: bool | None = None,
    mesh=None,
) -> tuple[dict, ModelConfig]:
    """Import a HuggingFace checkpoint directory -> (params, cfg). See the module docstring.

    dtype: "float32" | "bfloat16" for dense weights, norms, biases and embeddings.
    quantize: None | "int4". quantize_lm_head: None (QUANTIZE_LM_HEAD_DEFAULT) | bool; only with quantize="int4".
    mesh: None, or a tensor-parallel mesh: the params come back stacked on it, each shard loaded onto its device.
    """
    dt = _dtype(dtype)
    if quantize not in (None, "int4"):
        raise ValueError(f"quantize must be None or 'int4', got {quantize!r}")
    if quantize is None and quantize_lm_head is not None:
        raise ValueError("quantize_lm_head applies only with quantize='int4'")
    try:
        hf_config = read_hf_config(os.path.join(hf_dir, "config.json"))
    except (OSError, ValueError) as e:  # the message names the file: a checkpoint that cannot be imported
        raise CheckpointError(str(e)) from e
    cfg = ModelConfig.from_hf(hf_config)
    if mesh is not None:  # a bad mesh or sizes it cannot split raise before any tensor is read
        tensor_parallel.shard_config(cfg, tensor_parallel.mesh_size(mesh))
    loader = FAMILY_LOADERS.get(cfg.family)
    if loader is None:
        raise UnsupportedModelError(
            f"no checkpoint importer for family {cfg.family!r}; importers exist for: {', '.join(FAMILY_LOADERS)}"
        )
    scheme = scheme_from_config(hf_config.get("quantization_config"))
    ckpt = Checkpoint(hf_dir)
    q_head = quantize == "int4" and (QUANTIZE_LM_HEAD_DEFAULT if quantize_lm_head is None else quantize_lm_head)
    linears = Linears(ckpt, scheme, quantize == "int4", dt, cfg, mesh)
    params = loader(ckpt, cfg, linears, q_head)
    from checkpoints.hf_mtp import load_mtp  # the MTP head(s), which transformers drops (imports this module)

    cfg, params = load_mtp(ckpt, cfg, linears, params)
    unused = ckpt.unused()
    if unused:
        more = f" (+{len(unused) - 8} more)" if len(unused) > 8 else ""
        raise CheckpointError(
            f"unexpected tensors in {ckpt.dir} for family {cfg.family!r}: {', '.join(unused[:8])}{more}"
        )
    return params, cfg


def _dtype(dtype):
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    dt = jnp.dtype(dtype)
    if dt.name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dt.name!r}")
    return DTYPES[dt.name]
