"""Which implementation the row-tile kernels run: compiled Pallas, Pallas interpret mode, or jnp reference.

All three obey the row-tile rule (docs/design.md, rule 1): rows are padded to ROW_TILE and row r of the output depends
only on row r of the input. The default is "pallas" on GPU and "reference" on CPU; set it explicitly with
`set_backend(...)` or the environment variable JSPEC_KERNELS. The choice is read at trace time, so set it
before the first call of a jitted function. There is no silent fallback: a backend that cannot run raises.
"""

from __future__ import annotations

import contextlib
import os

import jax

ROW_TILE = 16  # rows per tile: decode (M=1) and verify (M=k+1 <= ROW_TILE) run the same tile shapes

BACKENDS = ("pallas", "interpret", "reference")
H200_SMS = 132
SMEM_BYTES = 232448  # shared memory a CTA may take on the H100 / H200 (227 KiB): the Mosaic GPU kernels plan in it
SMEM_RESERVE = 4096  # of it, what a kernel's barriers and alignment take beyond the tiles it plans (measured:
# attention_ws at head_dim 256 planned 229,920 bytes of tiles and state and asked for 232,480)


def first_rows(y: jax.Array, m: int) -> jax.Array:
    """The first m rows of a row-tile result y [ROW_TILE, ...] (or [T * ROW_TILE, ...]: T tiles).

    Below a full tile the slice comes after an optimization barrier: XLA would otherwise sink it into the ops that
    produce y (a split-K sum, a dot) and compile a different reduction for each m (docs/design.md, rule 7). A full tile
    (what decode_step and verify_step run) has no slice and needs no barrier, so XLA may fuse those ops into y's
    consumer: the same shapes and the same graph in both steps, so the same fusion and the same bits.
    """
    return y if m == y.shape[0] else jax.lax.optimization_barrier(y)[:m]


def sm_count() -> int:
    """Streaming multiprocessors of the default device (132 on the H200), which the persistent kernels size their
    grids by; a device without a core count (the CPU, when lowering for CUDA there) gets the H200's 132. The grid
    size never changes a kernel's bits."""
    return int(getattr(jax.devices()[0], "core_count", H200_SMS))


def valid_rows(rows: int | None, m: int) -> int:
    """The valid rows of an m-row query tile (None: all m); raises unless 1 <= rows <= m."""
    rows = m if rows is None else rows
    if not 1 <= rows <= m:
        raise ValueError(f"attention: rows={rows} valid rows must be in 1..{m} (the query rows given)")
    return rows


def kv_heads(q_heads: int, kv_cache: jax.Array) -> int:
    """The KV heads of an attention cache kv_cache [S, Hkv, 2, D] (keys at [:, :, 0], values at [:, :, 1]) serving
    q_heads query heads; raises for another shape, or for query heads that are not a multiple of them."""
    if kv_cache.ndim != 4 or kv_cache.shape[2] != 2:
        raise ValueError(f"attention: expected kv_cache [S, Hkv, 2, D] (keys, values), got {kv_cache.shape}")
    hkv = kv_cache.shape[1]
    if q_heads % hkv:
        raise ValueError(f"attention: query heads {q_heads} not a multiple of KV heads {hkv}")
    return hkv


_override: str | None = None


def default_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def get_backend() -> str:
    """The active kernel backend: the override, else $JSPEC_KERNELS, else the platform default."""
    name = _override or os.environ.get("JSPEC_KERNELS") or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    if name == "pallas" and jax.default_backend() != "gpu":
        raise RuntimeError(
            f"kernel backend 'pallas' needs a GPU (JAX platform is {jax.default_backend()!r}); "
            "use 'interpret' or 'reference' on CPU"
        )
    return name


def set_backend(name: str | None) -> None:
    """Force a backend for later traces (None restores the default)."""
    global _override
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    _override = name


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager form of `set_backend`."""
    global _override
    previous = _override
    set_backend(name)
    try:
        yield
    finally:
        _override = previous
