"""Warp-specialized Mosaic GPU int4 row-tile matmul (Hopper), on weights prepared once as signed int4 codes.

`Int4Codes` holds an `Int4Weight` (symmetric) re-coded for this kernel: each code is the two's-complement int4 of q - 8
(`jnp.int4`, K padded with zero codes to a multiple of the 256-k tile and N with zero rows to a multiple of the
128-row weight tile, stored step-major like the scales so that one
(row tile, k step) block of codes is 16 contiguous KB), and inside every 32-k block
(one scale group) the codes are stored in the order `STORED_K`: a thread's 8 consecutive stored codes, which Mosaic's
int4 upcast layout hands it as one 32-bit word, are then exactly the 8 k the wgmma register layout gives that thread
(pairs 2t, 2t+1 of each 8 columns), each pair in two nibbles 16 bits apart. So the kernel converts a word straight
into the wgmma operand's registers, a shift, a lop3 and one bf16x2 FMA with the scale per pair (`_dequantize`; no
prmt, no data movement). `to_int4_weight` undoes the preparation exactly.

The kernel (docs/design.md rule 1, the row tile: rows padded to ROW_TILE = 16, or to NARROW_ROWS = 8 when there
are at most 8, tiles from the shape only, partials combined outside in a fixed order, then `backend.first_rows`): a
stream-K partition (`Partition`) gives each CTA (one per SM) an even share of the (row tile, k step) units. Per CTA
one TMA warpgroup streams [2 * wg_rows, TILE_K] code tiles, their [2 * wg_rows, TILE_K / 32] scales (each one
contiguous block: `Int4Codes` stores codes and scales step-major) and the [16 (or 8), TILE_K] x tile through a
`stages`-deep ring; two consumer warpgroups each load wg_rows rows of codes in the upcast layout (32-bit shared
memory loads), dequantize them with the group scales (one bf16 rounding: the `pallas_kernels.int4` formula
bf16(f32(q - 8) * f32(s)), times 2^-WEIGHT_SHIFT, undone on the accumulator) and issue wgmma with the 16 tokens on
N, a k chunk at a time (`Config.chunks`: the next chunk converts while the previous chunk's wgmma runs), accumulating
float32 [wg_rows, 16]; at the end of each tile's run of steps (a segment) the accumulator goes to that segment's
partial. Every step is the same straight-line code (no branch around the wgmma or the accumulator's zeroing), or
ptxas serializes the wgmma instructions. `tiles_matmul` (batches of sequences) runs up to `launch_tiles` row
tiles in one launch, all in one wgmma of N = 16 T per chunk (`Config.wide_wgmma`), each tile's columns the bits it
gets alone. GPU only (no interpret mode); bfloat16 activations. H200 measurements and
the variants behind the defaults: docs/kernels.md and benchmarks/experiments/int4_layouts.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE, SMEM_BYTES, SMEM_RESERVE, first_rows, sm_count
from pallas_kernels.int4 import BLOCK, Int4Weight, pack, unpack_codes
from pallas_kernels.int4_matmul import _combine


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Codes:
    """A symmetric Int4Weight W [K, N] prepared for this kernel, both arrays step-major (one TMA box of a (row tile,
    k step) is contiguous): codes int4 [K_pad / TILE_K, N, TILE_K] = q - 8, codes[i, n, j] the code of row n at
    k = TILE_K i + j with the k of every 32-k block in `STORED_K` order (a box: 16 KB in one piece, where [N, K_pad]
    row-major codes give 128 pieces of 128 bytes, docs/kernels.md); scales bf16 [K_pad / TILE_K, N, TILE_K / 32]:
    scales[i, n, g] is the scale of row n's 32-k block 8 i + g (a 2 KB box; from [N, K / 32] row-major scales a box
    reads 16 bytes per row: 12% of the pipeline's own bandwidth floor on the H200). K_pad is K rounded up to a
    multiple of `TILE_K`; the padding holds zero codes and zero scales, and x is padded with zeros to match, so
    every padded term of the product is 0 * 0. N is padded likewise to N_pad, a multiple of `TILE_N` (zero rows:
    e.g. a Gated DeltaNet in_proj, N = 12352, whose last 64 columns are its b and a heads), and the product's padded
    columns are sliced off; a column's dot product never meets another's, so the others keep their bits.
    k, n: the logical K and N (static)."""

    codes: jax.Array
    scales: jax.Array
    k: int = dataclasses.field(metadata=dict(static=True))
    n: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (K, N)."""
        return (self.k, self.n)

    @property
    def nbytes(self) -> int:
        return self.codes.size // 2 + self.scales.nbytes


@dataclasses.dataclass(frozen=True)
class Config:
    """stages: ring depth (a pipeline step covers TILE_K k); wg_rows:
    weight rows per consumer warpgroup (a tile = 2 x wg_rows rows); ctas: CTAs of the stream-K partition (None:
    the device's SM count, one CTA per SM); min_steps: fewest pipeline steps per CTA (small shapes get fewer CTAs);
    chunks: k chunks per step, each converted and handed to its own (asynchronous) wgmma before the next is
    converted, so a chunk's conversion overlaps the previous chunk's wgmma. The chunks issue the same wgmma
    instructions in the same k order as one chunk would: the bits do not depend on `chunks` (a GPU test checks it).
    2 chunks: -4.6% int4 kernel time in the Llama-3-8B decode step, -6.0% at Qwen2.5-14B (docs/kernels.md).
    wide_wgmma: a launch of T row tiles issues one wgmma of N = 16 T per chunk, into one accumulator, rather than T
    of N = 16 (a tile's columns get the bits its own N = 16 wgmma gives: the wgmma's N columns are independent dot
    products over the same k; a GPU test checks it)."""

    stages: int = 4
    wg_rows: int = 64
    ctas: int | None = None
    min_steps: int = 4
    chunks: int = 2
    wide_wgmma: bool = True

    @property
    def tile_rows(self) -> int:
        return 2 * self.wg_rows


@dataclasses.dataclass(frozen=True)
class Partition:
    """Stream-K split of the (tile, k-step) units, a function of the shape and the CTA count only.

    Units u = tile * steps + k_step, tile-major; CTA c takes units [c * units // ctas, (c + 1) * units // ctas).
    The run of one tile's units inside one CTA is a segment: segment s of a tile is the part computed by its s-th
    CTA. `segments[t]` is the count for tile t; the partials are summed over s = 0, 1, ... in that order.
    """

    tiles: int
    steps: int
    ctas: int

    @property
    def units(self) -> int:
        return self.tiles * self.steps

    @property
    def per_cta(self) -> int:
        """Pipeline steps every CTA runs (the CTAs with one unit fewer repeat their last unit and discard it)."""
        return -(-self.units // self.ctas)

    def cta_of(self, unit):
        """The CTA computing a unit (Python ints, numpy arrays or traced int32 alike)."""
        return _div((unit + 1) * self.ctas - 1, self.units)

    @property
    def segments(self) -> np.ndarray:
        t = np.arange(self.tiles)
        return self.cta_of((t + 1) * self.steps - 1) - self.cta_of(t * self.steps) + 1


def _div(a, b):
    """a // b for non-negative a, b. In a kernel (traced a) it is `lax.div`, truncating, which equals floor division
    there: jnp's `//` adds a sign correction whose boolean conversions each ask ptxas for its version while Mosaic
    GPU lowers them (~7 ms apiece on the H200: 8 of the 11 s a step executable took to lower)."""
    return jax.lax.div(a, b) if isinstance(a, jax.Array) else a // b


# STORED_K[p]: the k (within a 32-k block) whose code is stored at position p = 8 t + 4 b + a: k = 8 a + 2 t + b.
# Thread t of a quad reads stored positions 8t..8t+7 as one 32-bit word (nibble i at bits 4i..4i+3, upcast layout),
# and the wgmma layout gives it k = 8 a + 2 t + b (column block a of the 32, pair element b). So the pair of column
# block a lies in nibbles a and a + 4, 16 bits apart: one shift and one lop3 place it in the two bf16 halves.
STORED_K = np.array([8 * ((p % 8) % 4) + 2 * (p // 8) + (p % 8) // 4 for p in range(BLOCK)])


TILE_K = 256  # k per pipeline step (128 code bytes per row, one 128B swizzle); Int4Codes pad K to a multiple of it


TILE_N = Config().tile_rows  # weight rows of the default (narrow) tile, 128; Int4Codes pad N to a multiple of it


# The kernel's weights are the format's bf16(code s) times 2^-WEIGHT_SHIFT: `_dequantize` makes them with one bf16x2
# FMA a pair, t (s 2^(133 - WEIGHT_SHIFT)) + (-8 s 2^-WEIGHT_SHIFT) on the subnormal t = (code + 8) 2^-133, and the
# accumulator is scaled back by 2^WEIGHT_SHIFT before it is stored. The bits are the format's for every scale s with
# SCALE_RANGE[0] <= |s| < SCALE_RANGE[1] (or s = 0): there s 2^(133 - WEIGHT_SHIFT) is finite and every nonzero weight
# a normal bf16. `prepare.prepare_ws` refuses a weight with other scales.
WEIGHT_SHIFT = 16
SCALE_RANGE = (2.0 ** (WEIGHT_SHIFT - 126), 2.0 ** (WEIGHT_SHIFT - 5))
_UP, _OFFSET = 2.0 ** (133 - WEIGHT_SHIFT), -(2.0 ** (3 - WEIGHT_SHIFT))  # the FMA's operands: s _UP and s _OFFSET


def padded_k(k: int) -> int:
    """K rounded up to a multiple of TILE_K: the K of the codes `prepare_codes` makes for a weight of K rows."""
    return -(-k // TILE_K) * TILE_K


def padded_n(n: int) -> int:
    """N rounded up to a multiple of TILE_N: the N of the codes `prepare_codes` makes for a weight of N columns."""
    return -(-n // TILE_N) * TILE_N


def prepare_codes(w: Int4Weight) -> Int4Codes:
    """Int4Weight (symmetric) -> Int4Codes; raises for asymmetric weights (the kernel has no zero points)."""
    if w.zeros is not None:
        raise ValueError("Int4Codes hold symmetric int4 weights only (this weight has per-block zero points)")
    q = unpack_codes(w)
    n, k = q.shape
    stored = q.reshape(n, k // BLOCK, BLOCK)[..., STORED_K].reshape(n, k)
    rows = ((0, padded_n(n) - n), (0, 0))  # zero codes (q - 8 = 0) and zero scales
    codes = _step_major(jnp.pad(stored.astype(jnp.int8) - 8, rows), TILE_K)
    return Int4Codes(codes.astype(jnp.int4), _step_major(jnp.pad(w.scales, rows), TILE_K // BLOCK), k, n)


def to_int4_weight(w: Int4Codes) -> Int4Weight:
    """The exact inverse of `prepare_codes`."""
    k, n = w.shape
    codes, scales = w.codes[:, :n], w.scales[:, :n]
    stored = (_row_major(codes.astype(jnp.int8), k) + 8).astype(jnp.uint8).reshape(n, k // BLOCK, BLOCK)
    return pack(stored[..., np.argsort(STORED_K)].reshape(n, k), _row_major(scales, k // BLOCK))


def _step_major(a: jax.Array, per_step: int) -> jax.Array:
    """[N, C] (C columns per row: codes or scales of K) -> [C_pad / per_step, N, per_step], zero-padded to whole
    steps: the layout of both `Int4Codes` arrays."""
    n, cols = a.shape
    a = jnp.pad(a, ((0, 0), (0, -cols % per_step)))
    return a.reshape(n, -1, per_step).transpose(1, 0, 2)


def _row_major(a: jax.Array, cols: int) -> jax.Array:
    """The inverse of `_step_major`: [steps, N, per_step] -> [N, cols], the padding dropped."""
    return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, :cols]


def fits(k: int, n: int, cfg: Config = Config()) -> bool:
    """Whether the kernel's tiles divide the shape (K as stored: padded_k of the weight's)."""
    return k % TILE_K == 0 and n % cfg.tile_rows == 0


def partition(k: int, n: int, cfg: Config) -> Partition:
    """The stream-K partition of a [K, N] weight: cfg.ctas CTAs (default one per SM), at least cfg.min_steps
    pipeline steps each, never more CTAs than units."""
    tiles, steps = n // cfg.tile_rows, k // TILE_K
    ctas = cfg.ctas or sm_count()
    return Partition(tiles, steps, max(1, min(ctas, tiles * steps // cfg.min_steps)))


# Wide tiles (`config_for`): the fewest 128-row pipeline steps per CTA from which 256-row tiles pay. 24 on the H200
# with the 16-row consumer; 25 since the 8-row one, whose 256-row tiles lost at exactly 24 steps (the Qwen3.5 gate_up)
# on the H100: 7% on the kernel alone, the step's int4 kernels 2.11 -> 2.05-2.06 ms in an A/B run in both orders
# (docs/kernels.md). Untimed on the H200 since: `jspec bench --int4-wide-min-steps 24` is that A/B.
WIDE_MIN_STEPS = 25
# One CTA per wide tile where the tiles fill their waves of SMs at least this much (Llama-3-8B gate_up 85%, lm_head
# 95%: B = 64 +3.2% tokens/s, B = 1 unchanged); emptier waves cost a whole wave's time (`config_for`).
WAVE_FILL_MIN = 0.8


def config_for(k: int, n: int) -> Config:
    """The Config `rows_matmul` uses for a [K (stored), N] weight, a function of the shape and the SM count only:
    256-row tiles (two warpgroups of 128 rows: one x tile and one pipeline step per 36 KB of weights instead of 18)
    where they fit N and the default 128-row tiles give each CTA at least WIDE_MIN_STEPS steps; else the default.
    Kernel alone on the H200 with the 16-row consumer (docs/kernels.md) a 256-row step cost ~0.93x two 128-row
    steps: 1.5-10% faster on every lm_head and gate_up of the bench shapes; 7-33% slower on their qkv, o and down
    (4-17 steps per CTA), where the wider tiles' longer ramp and coarser units cost more than the steps save.
    The wide tiles run one CTA per tile (no stream-K partials to sum; several waves of CTAs) where the tiles fill
    their waves of SMs to WAVE_FILL_MIN, else the stream-K partition (one CTA per SM). One CTA per tile: the
    Llama-3-8B gate_up 35.1 against 40.2 us at 64 rows, the lm_head 140.8 against 155.5
    (experiments/results/int4_64rows_h200.json); in the whole generation, greedy B = 64 +3.2% tokens/s, B = 1
    unchanged (int4_tile_per_cta_e2e_h200.json). But a CTA streams about 1/SMs of the memory bandwidth, so a wave
    part empty runs as long as a full one: the 27B-class hybrid's gate_up (136 tiles: 2 waves, 52% full) doubled
    its time, the decode step's int4 kernels 5.08 -> 6.39 ms (bench_hybrid_27b_all_windows_h200.json); the Qwen3.5
    gate_up (96 tiles, 73%) cost ~0.06 ms a step. Another partition also moves XLA's fusion choices around the
    kernels: it made the Qwen3.5 shape's verify rows differ from decode until nothing around the Gated DeltaNet conv
    depended on the row count (docs/design.md, rule 7)."""
    narrow = Config()
    wide = dataclasses.replace(narrow, wg_rows=2 * narrow.wg_rows)
    if not (fits(k, n, wide) and partition(k, n, narrow).per_cta >= WIDE_MIN_STEPS):
        return narrow
    tiles, sms = n // wide.tile_rows, sm_count()
    waves = -(-tiles // sms)
    return dataclasses.replace(wide, ctas=tiles) if tiles >= WAVE_FILL_MIN * waves * sms else wide


NARROW_ROWS = 8  # rows a call computes when at most 8 are read (decode, verify k < 8): the wgmma's least N


def rows_matmul(x: jax.Array, w: Int4Codes, *, config: Config | None = None, live_rows: int | None = None) -> jax.Array:
    """x [M <= 16, K] bfloat16 @ W [K, N] -> float32 [M, N], row-exact in M (GPU only). config: None for
    `config_for` the weight's shape. live_rows (static): the leading rows the caller reads (None: all M). With at
    most NARROW_ROWS of them the kernel computes NARROW_ROWS rows (wgmma N = 8: half the x bytes a pipeline step
    moves into shared memory), each with the bits a 16-row tile gives it (the wgmma's N columns are independent
    dot products over the same k; a GPU test checks it); rows NARROW_ROWS.. of the result then repeat rows 0.., so
    the result has one shape and one graph whatever live_rows (docs/design.md, rule 1)."""
    m = x.shape[0]
    if not 1 <= m <= ROW_TILE:
        raise ValueError(f"rows_matmul takes 1..{ROW_TILE} rows, got {m}")
    if min(m, live_rows or m) > NARROW_ROWS:
        return tiles_matmul(x, w, config=config)
    k_stored, cfg = _layout(x, w, config)
    xp = jnp.pad(x, ((0, (NARROW_ROWS if m <= NARROW_ROWS else ROW_TILE) - m), (0, k_stored - x.shape[1])))
    return _columns(first_rows(_product(xp, w, cfg, narrow=True), m), w)


def tiles_matmul(x: jax.Array, w: Int4Codes, *, config: Config | None = None) -> jax.Array:
    """x [R, K] bfloat16 (any R >= 1: a batch's rows, `pallas_kernels.matmul`) @ W [K, N] -> float32 [R, N]: R
    padded to whole row tiles of ROW_TILE, each tile's rows the bits `rows_matmul` gives that tile alone. One launch
    takes up to `launch_tiles` tiles over each weight tile it streams: one wgmma over them all (`Config.wide_wgmma`;
    or one per tile), whose columns are the same dot products in the same k order as a tile alone, under the same
    partition (a function of the weight's shape and the config), so the weights are read once per launch instead of
    once per row tile."""
    r = x.shape[0]
    k_stored, cfg = _layout(x, w, config)
    tiles = -(-r // ROW_TILE)
    xp = jnp.pad(x, ((0, tiles * ROW_TILE - r), (0, k_stored - x.shape[1])))  # zero rows, zero k under the padded codes
    per = launch_tiles(cfg)
    ys = [_product(xp[i * ROW_TILE : (i + per) * ROW_TILE], w, cfg) for i in range(0, tiles, per)]
    return _columns(first_rows(jnp.concatenate(ys) if len(ys) > 1 else ys[0], r), w)


def _layout(x: jax.Array, w: Int4Codes, config: Config | None) -> tuple[int, Config]:
    """(K as stored, the Config) of a product of x with w, checked."""
    steps, n, _ = w.codes.shape
    k_stored = steps * TILE_K
    cfg = config or config_for(k_stored, n)
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU int4 kernel takes bfloat16 activations, got {x.dtype}")
    if w.shape[0] != x.shape[1] or not fits(k_stored, n, cfg):
        raise ValueError(f"Int4Codes {w.shape} (K, N) do not fit x K={x.shape[1]} or the kernel tiles {cfg}")
    return k_stored, cfg


def _columns(y: jax.Array, w: Int4Codes) -> jax.Array:
    """The product's logical columns: the padded ones off."""
    return y if y.shape[1] == w.n else y[:, : w.n]


def _product(xp: jax.Array, w: Int4Codes, cfg: Config, narrow: bool = False) -> jax.Array:
    """Padded x [T * ROW_TILE (or NARROW_ROWS), K_stored] bf16 @ W -> float32 [same rows, N]: one launch, partials
    combined. narrow: one tile of which only the first NARROW_ROWS rows are computed (`_tile`)."""
    steps, n, _ = w.codes.shape
    part = partition(steps * TILE_K, n, cfg)
    parts = _tile(xp, w.codes, w.scales, cfg=cfg, part=part, narrow=narrow)
    live = np.repeat(np.arange(parts.shape[0])[:, None] < part.segments[None, :], cfg.tile_rows, axis=1)
    return _combine(parts, live)


MAX_LAUNCH_TILES = 4  # row tiles per launch: [wg_rows, 4 x 16] float32 of accumulator per consumer warpgroup
MIN_RING = 3  # the fewest pipeline stages a launch of several row tiles keeps


def stage_bytes(cfg: Config, tiles: int) -> int:
    """Shared-memory bytes of one pipeline stage of a launch over `tiles` row tiles: codes, scales and x tiles (the
    kernel's only shared-memory buffers; its partials go from registers straight to global memory)."""
    return cfg.tile_rows * TILE_K // 2 + cfg.tile_rows * (TILE_K // BLOCK) * 2 + tiles * ROW_TILE * TILE_K * 2


def ring(cfg: Config, tiles: int) -> int:
    """Pipeline stages of a launch over `tiles` row tiles: cfg.stages, fewer where the x tiles leave no room in a
    CTA's shared memory (`backend.SMEM_BYTES` less its reserve). The ring depth changes the overlap only, never the
    bits."""
    return max(1, min(cfg.stages, (SMEM_BYTES - SMEM_RESERVE) // stage_bytes(cfg, tiles)))


def launch_tiles(cfg: Config) -> int:
    """Row tiles per launch: the most (<= MAX_LAUNCH_TILES) whose ring keeps MIN_RING stages (at least 1)."""
    fit = [t for t in range(1, MAX_LAUNCH_TILES + 1) if ring(cfg, t) >= min(MIN_RING, cfg.stages)]
    return max(fit, default=1)


@functools.partial(jax.jit, static_argnames=("cfg", "part", "narrow"))
def _tile(xp, codes, scales, *, cfg: Config, part: Partition, narrow: bool = False):
    """Padded x [T * 16, K] (T row tiles) -> float32 segment partials [max segments, T * 16, N] (slots past a
    tile's segment count are never written). narrow: x is one tile of 8 or 16 rows of which the kernel reads and
    computes the first NARROW_ROWS (the wgmma's N), storing them into rows 0.. and, for 16, again into rows 8..
    Jitted so each shape is lowered once per executable."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x_rows = xp.shape[0]
    rt = NARROW_ROWS if narrow else ROW_TILE  # rows of a row tile: the wgmma's N per tile
    tiles = 1 if narrow else x_rows // rt
    copies = x_rows // (rt * tiles)  # a narrow tile's rows stored this many times
    tile_k, wg_rows = TILE_K, cfg.wg_rows
    tile_rows, groups, chunk_k = cfg.tile_rows, tile_k // BLOCK, tile_k // cfg.chunks
    steps, units, ctas = part.steps, part.units, part.ctas
    code_swizzle, x_swizzle = min(128, tile_k // 2), min(128, tile_k * 2)
    code_tf = (plgpu.TilingTransform((8, code_swizzle * 2)), plgpu.SwizzleTransform(code_swizzle))
    x_tf = (plgpu.TilingTransform((8, x_swizzle // 2)), plgpu.SwizzleTransform(x_swizzle))
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def int4_ws_streamk(x_gmem, c_gmem, s_gmem, o_gmem):
        c, wg = jax.lax.axis_index("c"), jax.lax.axis_index("wg")
        rows = pl.ds(wg * wg_rows, wg_rows)
        lo = _div(c * units, ctas)
        count = _div((c + 1) * units, ctas) - lo

        def unit(j):  # a CTA with one unit fewer repeats its last unit (its product is discarded)
            u = lo + jnp.minimum(j, count - 1)
            return _div(u, steps), jax.lax.rem(u, steps)

        def scaled_chunk(q, s_smem, ch):
            """Chunk ch of the step's codes q -> bf16 [wg_rows, chunk_k] weights bf16(code s) 2^-WEIGHT_SHIFT (wgmma
            layout): per scale group, each row's two FMA operands from its scale, then `_dequantize`."""
            parts = []
            for g in range(ch * chunk_k // BLOCK, (ch + 1) * chunk_k // BLOCK):
                s = plgpu.load(s_smem.at[rows, g], layout=row_layout)
                scale, offset = (jax.lax.broadcast_in_dim(v, (wg_rows, BLOCK), [0]) for v in (s * _UP, s * _OFFSET))
                parts.append(_dequantize(q[:, g * BLOCK : (g + 1) * BLOCK], scale, offset))
            return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

        def body(idx, c_smem, s_smem, x_smem, accs):
            j = idx[0]
            t, ks = unit(j)

            # A segment starts: fresh accumulators. Every step runs the same straight-line wgmma code (a CTA past
            # its last unit repeats that unit into accumulators nobody reads, and the zeroing is a select): a
            # wgmma or an accumulator write under a branch makes ptxas serialize every wgmma instruction (C7515).
            for acc in accs:
                acc[...] = jnp.where((ks == 0) | (j == 0), jnp.float32(0), acc[...])
            q = plgpu.load(c_smem.at[rows], layout=plgpu.Layout.WGMMA_UPCAST_4X)
            for ch in range(cfg.chunks):
                w = scaled_chunk(q, s_smem, ch)
                for r, acc in enumerate(accs):  # one wgmma over every row tile (wide), or the one tile r gets alone
                    width = acc.shape[1]
                    x_tile = x_smem.at[r * width : (r + 1) * width, ch * chunk_k : (ch + 1) * chunk_k]
                    plgpu.wgmma(acc, w, x_tile.T)
            plgpu.wgmma_wait(0)

            @pl.when((j < count) & ((ks == steps - 1) | (j == count - 1)))  # a segment ends: store its partials
            def _():
                seg = c - part.cta_of(t * steps)
                cols = pl.ds(t * tile_rows + wg * wg_rows, wg_rows)
                tile_accs = [a[...][:, i * rt : (i + 1) * rt] for a in accs for i in range(a.shape[1] // rt)]
                for r, value in enumerate(tile_accs):  # the weights' scaling undone, exactly
                    value = value * 2.0**WEIGHT_SHIFT
                    for copy in range(copies):
                        _store_transposed(value, o_gmem.at[seg, pl.ds((r + copy) * rt, rt), cols])

            return accs

        def step_block(j):  # tile t's codes / scales of step ks: row block ks * tiles + t of the [steps * N, -1] views
            t, ks = unit(j)
            return (ks * part.tiles + t, 0)

        def compute_context(eval_pipeline):
            accs = (
                [plgpu.ACC((wg_rows, tiles * rt), jnp.float32)]
                if cfg.wide_wgmma
                else [plgpu.ACC((wg_rows, rt), jnp.float32)] * tiles
            )
            pl.run_scoped(lambda *accs: eval_pipeline(accs), *accs)

        plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(part.per_cta,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tile_rows, tile_k), step_block, transforms=code_tf),
                plgpu.BlockSpec((tile_rows, groups), step_block),
                plgpu.BlockSpec((tiles * rt, tile_k), lambda j: (0, unit(j)[1]), transforms=x_tf),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=ring(cfg, tiles),
            compute_context=compute_context,
        )(c_gmem, s_gmem, x_gmem)

    return plgpu.kernel(
        int4_ws_streamk,
        out_type=jax.ShapeDtypeStruct((int(part.segments.max()), x_rows, part.tiles * tile_rows), jnp.float32),
        grid=(ctas,),
        grid_names=("c",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(xp, codes.reshape(-1, tile_k), scales.reshape(-1, groups))  # [steps * N, -1]: row block ks * tiles + t


def _dequantize(codes, scale, offset):
    """One scale group: int4 codes [rows, 32] in the upcast layout, and each row's s 2^(133 - WEIGHT_SHIFT)
    (`scale`) and -8 s 2^-WEIGHT_SHIFT (`offset`) broadcast to bf16 [rows, 32] in the wgmma layout -> the weights
    bf16(code s) 2^-WEIGHT_SHIFT, exactly, in the wgmma layout.

    The upcast layout gives a thread, per 32 columns, one 32-bit word of 8 codes (nibble i = stored position 8 t + i);
    the wgmma layout wants, per 8 columns, a vector of 2. With the codes stored in `STORED_K` order the pair of
    column block a is nibbles a and a + 4: `word >> 4 a`, masked to bits 0-3 and 16-19 and xor-ed with 8 in each
    half (one lop3), is a bf16 pair of zero exponent, the subnormals t = u 2^-133 with u = code + 8. One bf16x2 FMA,
    t scale + offset = (u - 8) s 2^-WEIGHT_SHIFT = code s 2^-WEIGHT_SHIFT before its single rounding, gives the format's
    bf16(code s) scaled by a power of two (`SCALE_RANGE`): 2.75 instructions a pair, where a bias subtract and a
    scale multiply took 3.75."""
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
        return_type=plgpu.ShapeDtypeStruct(codes.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def convert(_, codes, scale, offset):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape(codes.shape), dtype=object)
        for (r, c, *rest), vec in np.ndenumerate(codes.registers):
            word = mgpu.utils.bitcast(vec, i32)
            for a in range(4):
                at = (r, 4 * c + a, *rest)
                src = word if a == 0 else arith.shrui(word, mgpu.utils.c(4 * a, i32))
                operands = [mgpu.utils.bitcast(v.registers[at], i32) for v in (scale, offset)]
                bf = llvm.inline_asm(
                    i32,
                    [src, *operands],
                    """{
                    .reg .b32 t;
                    lop3.b32 t, $1, 0x000F000F, 0x00080008, 0x6a;
                    fma.rn.bf16x2 $0, t, $2, $3;
                    }""",
                    "=r,r,r,r",
                )
                regs[at] = mgpu.utils.bitcast(bf, pair)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert(codes, scale, offset)


def _store_transposed(acc, ref):
    """Store the float32 accumulator [wg_rows, 16] (WGMMA layout) into the global memory ref [16, wg_rows] straight
    from registers: one scalar store per element, eight lanes' rows to one 32-byte sector (the kernel's output is
    token-major, so no transpose op runs after it; no shared memory, fence or TMA store to wait for)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir.dialects import memref

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, value, gmem):
        value.foreach(lambda v, idx: memref.store(v, gmem, [idx[1], idx[0]]))

    store(acc, ref)
