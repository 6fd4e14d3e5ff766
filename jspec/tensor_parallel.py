"""Tensor parallelism (Megatron-style) over a one-axis JAX device mesh (axis TP_AXIS = "tp").

Each of the mesh's n devices holds one shard of the model and runs the ordinary forward on it inside `jax.shard_map`,
with the config of one shard (`shard_config`: heads, KV heads, Gated DeltaNet heads and the intermediate size divided
by n). qkv, gate_up and Gated DeltaNet's in_proj (and its conv) are column-parallel: shard s keeps the columns of its
heads / its intermediate slice of every segment ([q | k | v], [gate | up], [q | k | v | z | b | a]). o, down and
out are row-parallel: the shard's K rows, one all-reduce of the float32 partial products (`layers.row_parallel_linear`).
The embedding and lm_head are vocabulary-parallel (vocab_size / n rows each): the lookup is one all-reduce, the logits
one all-gather into [rows, vocab] (`layers.embed_tokens`, `layers.logits`), so the argmax and the sampler run
unchanged on global vocabulary indices. Norms, biases of row-parallel weights and an MTP head's fc are replicated.

Layout of params on a mesh ("stacked"): every leaf gains a leading axis of n, sharded over the mesh
(NamedSharding(mesh, P("tp"))); leaf[s], on device s, is shard s's, so shard s is a params tree of the shard config
(replicated leaves hold one copy per device). The loop state keeps its caches and the drafter's state (per-device
data) stacked the same way; everything else in it (tokens, position, counters) is replicated.

Exactness (docs/design.md, "Tensor parallelism"): every collective runs on the row tile's fixed shape, so decode and
verify run the same all-reduces on the same shapes and verify row i equals decode at position p + i bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.config import TP_AXIS, ModelConfig
from jspec.loop import Loop
from jspec.state import DecodeState
from pallas_kernels.int4 import BLOCK, Int4Weight

AXIS = TP_AXIS
SHARDED, REPLICATED = P(AXIS), P()
# The specs of a DecodeState and a Loop (pytree prefixes): caches and drafter state stacked by device, the rest
# replicated (a batch of Loops, jspec.batch, has the same specs: its [B] axis follows the stacking axis).
STATE_SPECS = DecodeState(
    cache=SHARDED, tokens=REPLICATED, position=REPLICATED, hidden=REPLICATED, slot=REPLICATED, drafter=SHARDED
)
LOOP_SPECS = Loop(**{f.name: REPLICATED for f in dataclasses.fields(Loop) if f.name != "state"}, state=STATE_SPECS)


def mesh_size(mesh) -> int:
    """The devices of a tensor-parallel mesh: one axis named AXIS; raises ValueError for any other mesh."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (jax.make_mesh((n,), ({AXIS!r},))), not {mesh!r}")
    if tuple(mesh.axis_names) != (AXIS,):
        raise ValueError(
            f"tensor parallelism needs a mesh with the one axis {AXIS!r}; got axes {tuple(mesh.axis_names)} of sizes "
            f"{tuple(mesh.devices.shape)} (jax.make_mesh((n,), ({AXIS!r},)))"
        )
    return int(mesh.devices.size)


def shard_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config of one of n shards; raises ValueError naming every size not divisible by n."""
    if cfg.tensor_parallel != 1:
        raise ValueError(f"cfg is already one of {cfg.tensor_parallel} tensor-parallel shards: pass the model's config")
    sizes = dict(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
    )
    if cfg.is_hybrid:
        sizes.update(linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads)
    bad = [f"{name} {size}" for name, size in sizes.items() if size % n]
    if bad:
        raise ValueError(f"tensor parallelism over {n} devices needs sizes divisible by {n}: {', '.join(bad)} are not")
    divided = {name: size // n for name, size in sizes.items() if name != "vocab_size"}
    return dataclasses.replace(cfg, **divided, tensor_parallel=n)


def split_rules(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """param name -> (axis of its logical [K, N] shape, or 0 of a vector; the segments along that axis) of every
    split param (the others are replicated). Shard s keeps the s-th of n equal parts of every segment."""
    q = 2 * cfg.q_size if cfg.is_hybrid else cfg.q_size  # hybrid: each head's query and output gate
    qkv, mlp = (q, cfg.kv_size, cfg.kv_size), (cfg.intermediate_size, cfg.intermediate_size)
    nv = cfg.linear_num_value_heads
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    return {
        "embed": (0, (cfg.vocab_size,)),
        "lm_head": (1, (cfg.vocab_size,)),
        "qkv": (1, qkv),
        "qkv_bias": (0, qkv),
        "o": (0, (cfg.q_size,)),
        "gate_up": (1, mlp),
        "gate_up_bias": (0, mlp),
        "down": (0, (cfg.intermediate_size,)),
        "in_proj": (1, (kd, kd, vd, vd, nv, nv)),
        "conv": (1, (kd, kd, vd)),
        "A_log": (0, (nv,)),
        "dt_bias": (0, (nv,)),
        "out": (0, (vd,)),
    }


def part_indices(segments: tuple[int, ...], n: int, s: int) -> np.ndarray:
    """int [sum(segments) / n]: the indices shard s keeps along a split axis, the s-th part of each segment."""
    starts = np.cumsum((0,) + segments[:-1])
    parts = zip(starts, segments, strict=True)
    return np.concatenate([start + np.arange(s * size // n, (s + 1) * size // n) for start, size in parts])


def split_weight(w, axis: int, segments: tuple[int, ...], n: int, name: str) -> list:
    """A dense array (a weight [K, N] or a vector) or an Int4Weight, of numpy arrays or tracers -> its n shards. A
    K split of an int4 weight must keep whole blocks of 32 rows; raises ValueError naming the sizes."""
    size = w.shape[axis]
    if size != sum(segments):
        raise ValueError(f"{name}: axis {axis} has {size} entries, the config's layout {sum(segments)}")
    if isinstance(w, Int4Weight):
        if axis == 1:  # N: output channels, rows of the packed layout
            return [_int4_rows(w, part_indices(segments, n, s)) for s in range(n)]
        if (size // n) % BLOCK:
            raise ValueError(
                f"{name}: int4 weight with K={size} cannot be split over {n} devices: K / {n} = {size // n} is not a "
                f"multiple of the int4 block {BLOCK}"
            )
        return [_int4_k(w, s * size // n, (s + 1) * size // n) for s in range(n)]
    if not isinstance(w, jax.Array | np.ndarray):
        raise TypeError(f"{name}: cannot split a {type(w).__name__}; shard the weights before preparing them")
    return [w[(slice(None),) * axis + (part_indices(segments, n, s),)] for s in range(n)]


def _int4_rows(w: Int4Weight, rows: np.ndarray) -> Int4Weight:
    return Int4Weight(w.packed[rows], w.scales[rows], None if w.zeros is None else w.zeros[rows])


def _int4_k(w: Int4Weight, lo: int, hi: int) -> Int4Weight:
    """The int4 weight of K rows lo..hi-1 (block aligned)."""
    blocks = slice(lo // BLOCK, hi // BLOCK)
    zeros = None if w.zeros is None else w.zeros[:, blocks]
    return Int4Weight(w.packed[:, lo // 2 : hi // 2], w.scales[:, blocks], zeros)


def split_params(params, cfg: ModelConfig, n: int) -> list:
    """A params tree (dicts and lists; the model's, one layer's or an MTP head's) -> its n shards, each a tree of
    the same structure for `shard_config(cfg, n)`: split params by `split_rules` (found by name), the rest shared.
    Arrays are split on the host (numpy: no device compute); tracers (`local_shapes`) as they are."""
    rules = split_rules(cfg)

    def walk(node, name: str | None, path: str) -> list:
        if isinstance(node, dict):
            parts = {key: walk(value, key, f"{path}[{key!r}]") for key, value in node.items()}
            return [{key: parts[key][s] for key in node} for s in range(n)]
        if isinstance(node, list | tuple):
            parts = [walk(value, name, f"{path}[{i}]") for i, value in enumerate(node)]
            return [type(node)(p[s] for p in parts) for s in range(n)]
        node = jax.tree.map(lambda x: x if isinstance(x, jax.core.Tracer) else np.asarray(x), node)
        if name in rules:
            return split_weight(node, *rules[name], n, path)
        return [node] * n

    return walk(params, None, "params")


def auto_mesh(mesh: Mesh) -> Mesh:
    """The mesh's devices and axis with Auto axis types (how jspec places arrays and runs shard_map on them)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,))


def stack(pieces, mesh: Mesh):
    """n trees of the same structure, tree s on the host or any device -> one tree whose every leaf is [n, ...]
    sharded over the mesh, piece s moved to device s (never gathered on one device; a device array moves device to
    device, not through the host)."""
    devices = list(mesh.devices.reshape(-1))
    sharding = NamedSharding(auto_mesh(mesh), SHARDED)

    def leaf(*xs):
        arrays = (x if isinstance(x, jax.Array) else np.asarray(x) for x in xs)
        blocks = [jax.device_put(x[None], d) for x, d in zip(arrays, devices, strict=True)]
        return jax.make_array_from_single_device_arrays((len(xs), *np.shape(xs[0])), sharding, blocks)

    return jax.tree.map(leaf, *pieces)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
    """params (one device's, or the host's) -> the stacked params on the mesh (see the module docstring)."""
    return stack(split_params(params, cfg, mesh_size(mesh)), mesh)


def is_stacked(params, mesh: Mesh | None) -> bool:
    """Whether params are stacked on a mesh (their embedding is [n, V / n, H]); raises ValueError when they are
    stacked for another mesh than `mesh` (or for one, and mesh is None)."""
    embed = params["embed"]
    if embed.ndim == 2:
        return False
    where = getattr(embed, "sharding", None)
    devices = getattr(getattr(where, "mesh", None), "devices", None)
    if mesh is None or devices is None or list(np.ravel(devices)) != list(mesh.devices.reshape(-1)):
        raise ValueError(
            f"params are stacked for a tensor-parallel mesh (embed {tuple(embed.shape)}): pass that mesh as mesh="
        )
    return True


def local_shapes(params, cfg: ModelConfig, n: int):
    """Abstract params of one shard (ShapeDtypeStructs) of stacked or unstacked params, computing nothing."""
    if params["embed"].ndim == 3:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    return jax.eval_shape(lambda p: split_params(p, cfg, n)[0], params)


def map_shards(fn, params, mesh: Mesh):
    """jit of fn(one shard's params) -> a tree, run by every device on its shard of stacked params; the results
    stacked (the int4 preparation: each device prepares its own weights)."""
    return jax.jit(on_mesh(fn, mesh, (SHARDED,), SHARDED))(params)


def replicate(tree, mesh: Mesh):
    """Every array of tree copied to every device of the mesh (NamedSharding, replicated)."""
    return jax.device_put(tree, NamedSharding(auto_mesh(mesh), REPLICATED))


def specs_of(arg):
    """The shard_map spec (prefix) of a step argument or result: a Loop, a DecodeState, or replicated data."""
    if isinstance(arg, Loop):
        return LOOP_SPECS
    return STATE_SPECS if isinstance(arg, DecodeState) else REPLICATED


def on_mesh(fn, mesh: Mesh, in_specs: tuple, out_specs):
    """fn(*args) run on every device of the mesh (`jax.shard_map`) with its own shard of each stacked argument
    (spec SHARDED: the leading device axis dropped inside, restored on the results)."""

    def per_device(*args):
        args = _restack(in_specs, args, lambda x: x[0])
        return _restack(out_specs, fn(*args), lambda x: x[None])

    return jax.shard_map(per_device, mesh=auto_mesh(mesh), in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _restack(specs, tree, op):
    """op on every leaf under a SHARDED spec of the prefix `specs`."""
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(op, sub) if spec == SHARDED else sub,
        specs,
        tree,
        is_leaf=lambda x: isinstance(x, P),
    )
