"""One-time preparation of a params tree's int4 weights for a kernel backend, and the policy that decides it.

"reference" (CPU): every Int4Weight becomes its `Int4Halves` (dequantized once: 2 or 4 bytes a weight instead of
0.5, the same bits as dequantizing in every step). "pallas" (GPU) with bfloat16 activations: every symmetric one
becomes its `Int4Codes` (re-ordered for the Mosaic GPU kernel, K padded to 256 and N to 128).
`resolve_prepare` is what `jspec.Engine(prepare=None)` does: prepare by default unless the copy would not fit, and
then say so in a warning (the slower path is never taken silently).
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.int4 import Int4Weight, dequantize_halves
from pallas_kernels.int4_ws import SCALE_RANGE, padded_k, padded_n, prepare_codes
from pallas_kernels.matmul import Int4Halves


def _is_int4(w) -> bool:
    return isinstance(w, Int4Weight)


def _map_int4(fn, params):
    """params with every Int4Weight w replaced by fn(w); every other leaf unchanged."""
    return jax.tree.map(lambda w: fn(w) if _is_int4(w) else w, params, is_leaf=_is_int4)


def prepare_reference(params, dtype):
    """params with every Int4Weight replaced by its Int4Halves in `dtype` (the activation dtype), for the
    reference backend: the row-tile and prefill products give the same bits, without dequantizing per call."""
    return _map_int4(lambda w: _halves(w, jnp.dtype(dtype)), params)


# One executable per weight shape (jit's cache), run once per weight: op by op, every op of the conversion would
# compile for every shape (~80 compiles, 2.4 s of the demo-hybrid Engine's 2.7 s on a CPU). An elementwise
# conversion has the same bits compiled or eager.
@functools.partial(jax.jit, static_argnums=1)
def _halves(w: Int4Weight, dtype) -> Int4Halves:
    return Int4Halves(*dequantize_halves(w, dtype))


_codes = jax.jit(prepare_codes)


def prepare_ws(params):
    """params with every symmetric Int4Weight replaced by its Int4Codes (K padded to a multiple of the 256-k tile:
    e.g. GLM-4-9B's down, K = 13696; N to a multiple of the 128-row tile: e.g. a Gated DeltaNet in_proj). On the H200
    that kernel beat the Triton row-tile kernel on every Qwen2.5-7B / 14B linear shape: 1.28-1.58x on gate_up,
    down, lm_head (benchmarks/results/int4_matmul_h200.json) and 1.15-1.49x on qkv and o (same-process runs;
    docs/kernels.md). Raises ValueError for a weight whose scales leave the kernel's exact range
    (`int4_ws.SCALE_RANGE`)."""
    _check_scale_range(params)
    return _map_int4(lambda w: _codes(w) if _takes_ws(w) else w, params)


@jax.jit
def _scale_extremes(scales: jax.Array) -> jax.Array:
    """float32 [2]: the largest |scale| (NaN if any is NaN) and the smallest nonzero one (inf if none)."""
    s = jnp.abs(scales.astype(jnp.float32))
    return jnp.stack([jnp.max(s), jnp.min(jnp.where(s > 0, s, jnp.inf))])


def _check_scale_range(params) -> None:
    """Raise ValueError naming the first weight `prepare_ws` would take whose nonzero scales leave
    `int4_ws.SCALE_RANGE`, where the Mosaic GPU kernel's weights would not be the format's bits."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_int4)[0]
    taken = [(path, w) for path, w in flat if _is_int4(w) and _takes_ws(w)]
    extremes = jax.device_get([_scale_extremes(w.scales) for _, w in taken])  # one transfer for every weight
    low, high = SCALE_RANGE
    for (path, _), (largest, smallest) in zip(taken, extremes, strict=True):
        if not (largest < high and smallest >= low):
            raise ValueError(
                f"int4 weight {jax.tree_util.keystr(path)}: scales {smallest:g} .. {largest:g} leave the Mosaic GPU "
                f"kernel's exact range [{low:g}, {high:g}); pass prepare=False to keep it on the Triton kernel"
            )


def _takes_ws(w: Int4Weight) -> bool:
    return w.zeros is None  # any shape: prepare_codes pads K and N to the kernel's tiles


def ws_prep_nbytes(params) -> int:
    """Device bytes `prepare_ws(params)` needs: a copy of the codes it converts, K and N padded (the caller keeps the
    originals), plus the largest conversion's temporaries (~3 bytes a weight: unpacked, re-biased, re-packed)."""
    taken = [w for w in jax.tree.leaves(params, is_leaf=_is_int4) if _is_int4(w) and _takes_ws(w)]
    padded = [(w, padded_k(w.shape[0]) * padded_n(w.shape[1])) for w in taken]
    copies = sum(w.nbytes * size // (w.shape[0] * w.shape[1]) for w, size in padded)  # bytes scale with K N
    return copies + max((3 * size for _, size in padded), default=0)


def prepared_nbytes(params, dtype) -> int:
    """Bytes the Int4Halves of `prepare_reference(params, dtype)` take (the int4 weights' extra memory)."""
    leaves = jax.tree.leaves(params, is_leaf=_is_int4)
    return sum(w.shape[0] * w.shape[1] * jnp.dtype(dtype).itemsize for w in leaves if _is_int4(w))


def reference_prep_fits(params, dtype, fraction: float = 0.25) -> bool:
    """Whether the prepared halves take at most `fraction` of this machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return prepared_nbytes(params, dtype) <= fraction * physical


def prepares_by_default(backend: str, dtype: str) -> bool:
    """Whether Engine(prepare=None) prepares the int4 weights: on the reference backend, and on the GPU ("pallas")
    with bfloat16 activations, where the Mosaic GPU kernel (`prepare_ws`) is the faster one."""
    return backend == "reference" or (backend == "pallas" and dtype == "bfloat16")


def resolve_prepare(prepare: bool | None, params, dtype: str, backend: str) -> bool:
    """Engine's `prepare` argument -> whether to prepare. None: `prepares_by_default`, declined with a warning when
    the prepared copy would not fit (`prep_shortfall`)."""
    if prepare is not None:
        return bool(prepare)
    if not prepares_by_default(backend, dtype):
        return False
    short = prep_shortfall(params, dtype, backend)
    if short:
        warnings.warn(f"{short}; pass prepare=True to use it anyway or prepare=False to silence this", stacklevel=3)
    return not short


def prep_shortfall(params, dtype: str, backend: str) -> str | None:
    """Why the default preparation would not fit in memory (None: it fits or cannot be checked)."""
    if backend == "reference" and not reference_prep_fits(params, dtype):
        need = prepared_nbytes(params, dtype) / 2**30
        return (
            f"int4 weights are dequantized in every step (slower): their prepared copy ({need:.1f} GiB) would take "
            "over a quarter of this machine's memory"
        )
    free = device_free_bytes() if backend == "pallas" else None
    if free is None:
        return None
    need = ws_prep_nbytes(params)
    if need <= free:
        return None
    return (
        f"the int4 weights stay on the Triton kernel (slower): preparing them for the Mosaic GPU kernel "
        f"needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB is free"
    )


def device_free_bytes() -> int | None:
    """Free bytes of the default device's allocator (None where it reports no statistics)."""
    stats = jax.devices()[0].memory_stats()
    return stats["bytes_limit"] - stats["bytes_in_use"] if stats and "bytes_limit" in stats else None


def prepare_params(params, dtype: str, backend: str):
    """The one-time int4 preparation for a kernel backend (see Engine's `prepare`)."""
    if backend == "reference":
        return prepare_reference(params, dtype)
    if backend == "pallas" and dtype == "bfloat16":
        return prepare_ws(params)
    raise ValueError(f"prepare=True: no int4 preparation for the {backend!r} kernel backend with {dtype} activations")
