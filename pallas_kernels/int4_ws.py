"""Warp-specialized Mosaic GPU int4 row-tile matmul (Hopper), on weights prepared once as signed int4 codes.

`Int4Codes` holds an `Int4Weight` (symmetric) re-biased for this kernel: every packed byte XOR 0x88, so each nibble
is the two's-complement int4 of q - 8, read as `jnp.int4` [N, K] in natural k order (XLA packs int4 low nibble
first, the native byte order). Same bytes, same memory; `to_int4_weight` undoes it exactly.

The kernel (DESIGN 2.1 row-tile rule: rows padded to ROW_TILE = 16, tiles from the shape only, split-K partials
combined outside in a fixed order, then a barrier and the slice to M rows): per CTA one TMA warpgroup streams
[2 * wg_rows, tile_k] code tiles, their [2 * wg_rows, tile_k / 32] scales and the [16, tile_k] x tile through a
`stages`-deep ring; two consumer warpgroups each load wg_rows rows of codes in the wgmma register layout, convert
them with Mosaic's int4 -> bf16 upcast (exact), multiply by the group scales (one bf16 rounding: exactly the
`pallas_kernels.int4` formula bf16(f32(q - 8) * f32(s))) and issue wgmma with the 16 tokens on N, accumulating
float32 [wg_rows, 16]. GPU only (no interpret mode); bfloat16 activations. H200 measurements and the variants
behind the defaults: benchmarks/int4_layouts.py, benchmarks/KERNEL_NOTES.md ("Prepared layouts").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE
from pallas_kernels.int4 import BLOCK, Int4Weight
from pallas_kernels.int4_matmul import _combine, pick_split


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Codes:
    """A symmetric Int4Weight W [K, N] prepared for this kernel: codes int4 [N, K] = q - 8, scales bf16 [N, K/32]."""

    codes: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (K, N)."""
        n, k = self.codes.shape
        return (k, n)

    @property
    def nbytes(self) -> int:
        return self.codes.size // 2 + self.scales.nbytes


@dataclasses.dataclass(frozen=True)
class Config:
    """tile_k: k per pipeline step (256: 128 code bytes per row, one 128B swizzle); stages: ring depth; wg_rows:
    weight rows per consumer warpgroup (CTA = 2 x wg_rows); relayout: "direct" loads the codes in the wgmma layout,
    "cast" in the int4 upcast layout and relayouts; wait: wgmma groups left in flight across steps (1 returned NaN
    with wg_rows 128 on the H200: keep 0); uneven: split K into near-equal step ranges (else a divisor)."""

    tile_k: int = 256
    stages: int = 4
    wg_rows: int = 64
    relayout: str = "direct"
    wait: int = 0
    uneven: bool = False


def prepare_codes(w: Int4Weight) -> Int4Codes:
    """Int4Weight (symmetric) -> Int4Codes; raises for asymmetric weights (the kernel has no zero points)."""
    if w.zeros is not None:
        raise ValueError("Int4Codes hold symmetric int4 weights only (this weight has per-block zero points)")
    n, half = w.packed.shape
    signed = jax.lax.bitcast_convert_type(w.packed ^ jnp.uint8(0x88), jnp.int4)  # [N, K/2, 2]
    return Int4Codes(signed.reshape(n, 2 * half), w.scales)


def to_int4_weight(w: Int4Codes) -> Int4Weight:
    """The exact inverse of `prepare_codes`."""
    n, k = w.codes.shape
    packed = jax.lax.bitcast_convert_type(w.codes.reshape(n, k // 2, 2), jnp.uint8)
    return Int4Weight(packed ^ jnp.uint8(0x88), w.scales)


def fits(k: int, n: int, cfg: Config = Config()) -> bool:
    """Whether the kernel's tiles divide the shape."""
    return k % cfg.tile_k == 0 and n % (2 * cfg.wg_rows) == 0


def choose_split(k: int, n: int, cfg: Config) -> int:
    """Split-K from the shape: uneven, ~264 CTAs (2 per SM of 132); else the row-tile module's divisor rule."""
    rows, steps = 2 * cfg.wg_rows, k // cfg.tile_k
    if cfg.uneven:
        return max(1, min(steps // 2, -(-264 // (n // rows))))
    return pick_split(n // rows, steps)


def rows_matmul(x: jax.Array, w: Int4Codes, *, config: Config | None = None, split: int | None = None) -> jax.Array:
    """x [M <= 16, K] bfloat16 @ W [K, N] -> float32 [M, N], row-exact in M (GPU only)."""
    cfg = config or Config()
    m, k = x.shape
    n = w.codes.shape[0]
    if not 1 <= m <= ROW_TILE:
        raise ValueError(f"rows_matmul takes 1..{ROW_TILE} rows, got {m}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU int4 kernel takes bfloat16 activations, got {x.dtype}")
    if w.shape[0] != k or not fits(k, n, cfg):
        raise ValueError(f"Int4Codes {w.shape} (K, N) do not fit x K={k} or the kernel tiles {cfg}")
    split = split or choose_split(k, n, cfg)
    parts = _tile(jnp.pad(x, ((0, ROW_TILE - m), (0, 0))), w.codes, w.scales, cfg=cfg, split=split)
    return jax.lax.optimization_barrier(_combine(parts))[:m]


@functools.partial(jax.jit, static_argnames=("cfg", "split"))
def _tile(xp, codes, scales, *, cfg: Config, split: int):
    """Padded x [16, K] -> float32 partials [split, 16, N]. Jitted so each shape is lowered once per executable."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    k = xp.shape[1]
    n = codes.shape[0]
    tile_k, wg_rows = cfg.tile_k, cfg.wg_rows
    cta_rows, groups, steps_total = 2 * wg_rows, tile_k // BLOCK, k // tile_k
    if not cfg.uneven and steps_total % split:
        raise ValueError(f"split {split} does not divide the {steps_total} K steps (use uneven)")
    steps = -(-steps_total // split)
    code_swizzle, x_swizzle = min(128, tile_k // 2), min(128, tile_k * 2)
    code_tf = (plgpu.TilingTransform((8, code_swizzle * 2)), plgpu.SwizzleTransform(code_swizzle))
    x_tf = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def kernel(x_gmem, c_gmem, s_gmem, o_gmem, o_smem):
        ni, si, wg = jax.lax.axis_index("n"), jax.lax.axis_index("s"), jax.lax.axis_index("wg")
        rows = pl.ds(wg * wg_rows, wg_rows)
        lo = si * steps_total // split
        count = (si + 1) * steps_total // split - lo

        def kstep(j):  # a short split re-loads its last tile and skips the product (uneven only)
            return lo + jnp.minimum(j, count - 1)

        def body(idx, c_smem, s_smem, x_smem, acc_ref):
            if cfg.relayout == "cast":
                q = plgpu.load(c_smem.at[rows], layout=plgpu.Layout.WGMMA_UPCAST_4X)
                q = plgpu.layout_cast(q, plgpu.Layout.WGMMA)
            else:
                q = plgpu.load(c_smem.at[rows], layout=plgpu.Layout.WGMMA)
            w = q.astype(jnp.bfloat16)
            parts = []
            for g in range(groups):
                sg = plgpu.load(s_smem.at[rows, g], layout=row_layout)
                parts.append(w[:, g * BLOCK : (g + 1) * BLOCK] * jax.lax.broadcast_in_dim(sg, (wg_rows, BLOCK), [0]))
            wd = jnp.concatenate(parts, axis=1) if groups > 1 else parts[0]
            if cfg.uneven:

                @pl.when(idx[0] < count)
                def _():
                    plgpu.wgmma(acc_ref, wd, x_smem.T)

            else:
                plgpu.wgmma(acc_ref, wd, x_smem.T)
            plgpu.wgmma_wait(cfg.wait)
            return acc_ref

        def compute_context(eval_pipeline):
            def acc_scope(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                o_smem[wg] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[si, pl.ds(ni * cta_rows + wg * wg_rows, wg_rows)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pl.run_scoped(acc_scope, plgpu.ACC((wg_rows, ROW_TILE), jnp.float32))

        release = cfg.wait
        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_rows, tile_k), lambda j: (ni, kstep(j)), transforms=code_tf, delay_release=release
                ),
                plgpu.BlockSpec((cta_rows, groups), lambda j: (ni, kstep(j)), delay_release=release),
                plgpu.BlockSpec((ROW_TILE, tile_k), lambda j: (0, kstep(j)), transforms=x_tf, delay_release=release),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.stages,
            compute_context=compute_context,
        )(c_gmem, s_gmem, x_gmem)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((split, n, ROW_TILE), jnp.float32),
        grid=(n // cta_rows, split),
        grid_names=("n", "s"),
        num_threads=3,
        thread_name="wg",
        scratch_types=dict(o_smem=plgpu.SMEM((2, wg_rows, ROW_TILE), jnp.float32)),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(xp, codes, scales)
    return jnp.swapaxes(out, 1, 2)
