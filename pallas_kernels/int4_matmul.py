"""Row-tile matmul kernels (Pallas): x [M <= 16, K] @ W [K, N] -> float32 [M, N], row-exact in M.

Rows are padded to ROW_TILE = 16 before the kernel, so decode (M=1) and verify (M=k+1) run the very same kernel on the
very same shapes and row r of the output depends only on row r of x (docs/design.md, rule 1). Inside, tiles are fixed
(no dependence on M), there are no atomics, and an optional split-K is combined outside the kernel in a fixed order on
M-independent shapes; below a full tile an optimization barrier comes before the final slice to M rows
(`backend.first_rows`, docs/design.md rule 7).

int4 weights (`Int4Weight`, physical W[n] packed as uint8 [N, K/2]) are read "swap-AB": each program owns BN output
channels, streams their packed bytes along K in steps of G blocks (G * 16 bytes per row), dequantizes in registers
by the formula of `pallas_kernels.int4` in the activation dtype, and accumulates acc[BN, 16] += W_tile @ x_tile^T in
float32 on the tensor cores. Byte j of a row holds k = 2j (low nibble) and k = 2j + 1 (high nibble), so the low and
high nibbles form two dense matrices over the even and odd k; x is split the same way (`_split_even_odd`) and the
product is two dots per step, with no interleaving shuffle in the kernel. On the GPU the bfloat16 dequantization
runs as inline PTX: nibbles are OR-ed into the mantissa of bfloat16 128.0, (128 + z) is subtracted (exact), and the
scale multiply is one correctly rounded bf16x2 multiply, i.e. exactly `bf16(f32(q - z) * f32(s))`.

Dense weights (float32 | bfloat16 [K, N]) use the same structure without the dequantization, so dense models stay
row-exact on the GPU too.

The kernel is Triton-lowered: it runs on the GPU and, unchanged, in interpret mode on CPU (CI tests this very
code). `choose_config` picks the tiles from the shape alone, never from M. The warp-specialized Mosaic GPU kernel
of `pallas_kernels.int4_ws` serves the large weights prepared as `Int4Codes` (`prepare_ws`, the GPU default for
bfloat16 models; see its module).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import ROW_TILE, first_rows
from pallas_kernels.int4 import BLOCK, Int4Weight

HALF = BLOCK // 2  # packed bytes per int4 block of 32 k


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile configuration. block_n: output channels per program; block_k: k per loop step (int4: a multiple of 32);
    split_k: programs along K (combined in a fixed order); num_warps / num_stages: Triton launch parameters;
    fast_dequant: inline-PTX bfloat16 dequantization (GPU only, bfloat16 activations)."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fast_dequant: bool = True


def rows_matmul(x: jax.Array, w, *, interpret: bool, config: Config | None = None) -> jax.Array:
    """x [M <= ROW_TILE, K] (float32 | bfloat16) @ W [K, N] (Int4Weight or dense) -> float32 [M, N], row-exact in M.

    interpret=True runs Pallas interpret mode (CPU); otherwise the kernel compiles for the GPU. `config` overrides
    the automatic tile choice (benchmarks); a config that does not fit the shape raises.
    """
    m, k = x.shape
    if m > ROW_TILE or m < 1:
        raise ValueError(f"rows_matmul takes 1..{ROW_TILE} rows, got {m}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"rows_matmul needs float32 or bfloat16 activations, got {x.dtype}")
    if w.shape[0] != k:
        raise ValueError(f"rows_matmul: x has K={k} but the weight is {tuple(w.shape)} ([K, N])")
    xp = jnp.pad(x, ((0, ROW_TILE - m), (0, 0)))
    if isinstance(w, Int4Weight):
        cfg = config or choose_config(k, w.shape[1], int4=True, interpret=interpret)
        parts = _int4_tile(xp, w, cfg, interpret)
    else:
        if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"rows_matmul: dense weight must be a float [K, N] array, got {w.dtype} {w.shape}")
        cfg = config or choose_config(k, w.shape[1], int4=False, interpret=interpret)
        parts = _dense_tile(xp, w, cfg, interpret)
    return first_rows(_combine(parts), m)


def choose_config(k: int, n: int, *, int4: bool, interpret: bool) -> Config:
    """Tiles for a shape: block_n and block_k the largest fitting powers of two (block_n <= 64, block_k <= 256);
    on the GPU, split-K where N alone gives fewer than two programs per SM (132 SMs)."""
    block_n = _largest_pow2_divisor(n, 64, 16)
    if block_n is None:
        raise ValueError(f"rows_matmul needs N divisible by 16, got N={n}")
    unit = BLOCK if int4 else 16
    block_k = _largest_pow2_divisor(k, 256, unit)
    if block_k is None:
        raise ValueError(f"rows_matmul needs K divisible by {unit}, got K={k}")
    split_k = 1 if interpret else pick_split(n // block_n, k // block_k)
    return Config(block_n=block_n, block_k=block_k, split_k=split_k)


def pick_split(programs: int, steps: int, target: int = 264) -> int:
    """Split-K factor: the smallest divisor s of `steps` (<= 8, >= 2 steps each) reaching `target` programs,
    else the largest such divisor below it; 1 when N alone reaches the target."""
    if programs >= target:
        return 1
    divisors = [s for s in range(2, 9) if steps % s == 0 and steps // s >= 2]
    reaching = [s for s in divisors if programs * s >= target]
    return min(reaching) if reaching else max(divisors, default=1)


def _largest_pow2_divisor(size: int, cap: int, unit: int) -> int | None:
    """Largest power-of-two multiple of `unit` that is <= cap and divides size, or None."""
    best, b = None, unit
    while b <= cap:
        if size % b == 0:
            best = b
        b *= 2
    return best


def _check_config(cfg: Config, k: int, n: int, unit: int) -> int:
    """Validate tiles against the shape; returns the K steps per split."""
    if n % cfg.block_n or cfg.block_n < 16:
        raise ValueError(f"block_n={cfg.block_n} must be >= 16 and divide N={n}")
    if cfg.block_k % unit or k % cfg.block_k:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of {unit} and divide K={k}")
    steps = k // cfg.block_k
    if steps % cfg.split_k:
        raise ValueError(f"split_k={cfg.split_k} must divide the {steps} K steps (K={k}, block_k={cfg.block_k})")
    return steps // cfg.split_k


def _combine(parts: jax.Array, live=None) -> jax.Array:
    """[S, 16, N] float32 partials -> [16, N], summed in the fixed order 0, 1, ..., S-1 (shapes independent of M).

    live: optional static numpy bool [S, N], which partials exist (slot 0 always); the others are never read
    into the sum (they may hold garbage)."""
    y = parts[0]
    for s in range(1, parts.shape[0]):
        if live is None or live[s].all():
            y = y + parts[s]
        else:
            y = jnp.where(live[s], y + parts[s], y)
    return y


def _compiler_params(cfg: Config, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _split_even_odd(xp: jax.Array) -> jax.Array:
    """x [16, K] -> [2, 16, K/2]: x[:, 0::2] and x[:, 1::2] (the k held by low and high nibbles)."""
    return jnp.stack([xp[:, 0::2], xp[:, 1::2]])


def _int4_tile(xp: jax.Array, w: Int4Weight, cfg: Config, interpret: bool) -> jax.Array:
    """Padded x [16, K] @ int4 W -> float32 partials [split_k, 16, N]."""
    k, n = w.shape
    steps = _check_config(cfg, k, n, BLOCK)
    groups = cfg.block_k // BLOCK
    fast = cfg.fast_dequant and not interpret and xp.dtype == jnp.bfloat16
    packed = w.packed.reshape(n, k // BLOCK, HALF)  # free: row-major view, block g of row n is [n, g, :]
    args = [_split_even_odd(xp), packed, w.scales]
    if w.zeros is not None:
        args.append(w.zeros)
    kernel = functools.partial(
        _int4_kernel, block_n=cfg.block_n, groups=groups, steps=steps, fast=fast, asym=w.zeros is not None
    )
    return pl.pallas_call(
        kernel,
        grid=(n // cfg.block_n, cfg.split_k),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, ROW_TILE, n), jnp.float32),
        interpret=interpret,
        compiler_params=_compiler_params(cfg, interpret),
        name="int4_rows_matmul",
    )(*args)


def _int4_kernel(x_ref, p_ref, s_ref, *refs, block_n, groups, steps, fast, asym):
    """One program: BN output channels x one K split. x_ref [2, 16, K/2]; p_ref [N, K/32, 16] uint8;
    s_ref (and z_ref) [N, K/32]; o_ref [S, 16, N] float32."""
    z_ref, o_ref = refs if asym else (None, refs[0])
    i, split = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_n, block_n)
    dtype = x_ref.dtype
    width = groups * HALF  # packed bytes (= even k, = odd k) per row per step

    def step(j, acc):
        g0 = (split * steps + j) * groups
        p = p_ref[rows, pl.ds(g0, groups), :]  # [BN, G, 16] uint8
        s = s_ref[rows, pl.ds(g0, groups)]  # [BN, G] bfloat16
        z = None if z_ref is None else z_ref[rows, pl.ds(g0, groups)]
        low, high = (_dequant_fast if fast else _dequant)(p, s, z, dtype)
        x_even = x_ref[0, :, pl.ds(g0 * HALF, width)]  # [16, G*16]
        x_odd = x_ref[1, :, pl.ds(g0 * HALF, width)]
        acc = acc + _dot_nt(low.reshape(block_n, width), x_even)
        return acc + _dot_nt(high.reshape(block_n, width), x_odd)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_n, ROW_TILE), jnp.float32))
    o_ref[split, :, rows] = acc.T


def _dot_nt(a, b):
    """a [R, C] @ b [T, C]^T -> float32 [R, T]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dequant(p, s, z, dtype):
    """Reference-formula dequantization of packed bytes p [BN, G, 16]: (q - z) * f32(s) in float32, cast to dtype.
    Returns (low-nibble weights, high-nibble weights), each [BN, G, 16]."""
    zf = jnp.float32(8.0) if z is None else z.astype(jnp.float32)[:, :, None]
    sf = s.astype(jnp.float32)[:, :, None]
    low = ((p & 0xF).astype(jnp.float32) - zf) * sf
    high = ((p >> 4).astype(jnp.float32) - zf) * sf
    return low.astype(dtype), high.astype(dtype)


# Four packed bytes -> four bf16 weights from their low (shift 0) or high (shift 4) nibbles.
# Operands: $2 bytes b0..b3; $3, $4 scales (bf16x2); $5, $6 128 + z (bf16x2); $0, $1 results.
# prmt spreads b0, b1 (b2, b3) into the low byte of each 16-bit half; lop3 keeps one nibble and ORs in 0x4300
# (bf16 128.0 with the nibble as mantissa: exactly 128 + q); sub gives q - z exactly; mul.rn rounds (q - z) * s
# once, which equals bf16(f32(q - z) * f32(s)) since that f32 product is exact.
_DEQUANT_PTX = """
{{
.reg .b32 b, t0, t1;
shr.u32 b, $2, {shift};
prmt.b32 t0, b, 0, 0x4140;
prmt.b32 t1, b, 0, 0x4342;
lop3.b32 t0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 t0, t0, $5;
sub.rn.bf16x2 t1, t1, $6;
mul.rn.bf16x2 $0, t0, $3;
mul.rn.bf16x2 $1, t1, $4;
}}
"""


def _dequant_fast(p, s, z, dtype):
    """GPU inline-PTX version of `_dequant` for bfloat16 (bit-identical to it)."""
    from jax.experimental.pallas import triton as pltriton

    del dtype
    shape = p.shape
    zb = jnp.float32(136.0) if z is None else z.astype(jnp.float32)[:, :, None] + 128.0
    zb = jnp.broadcast_to(zb.astype(jnp.bfloat16), shape)
    sb = jnp.broadcast_to(s[:, :, None], shape)
    out = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return tuple(
        pltriton.elementwise_inline_asm(
            _DEQUANT_PTX.format(shift=shift),
            args=[p, sb, zb],
            constraints="=r,=r,r,r,r,r,r",
            pack=4,
            result_shape_dtypes=[out],
        )[0]
        for shift in (0, 4)
    )


def _dense_tile(xp: jax.Array, w: jax.Array, cfg: Config, interpret: bool) -> jax.Array:
    """Padded x [16, K] @ dense W [K, N] (cast to x.dtype in the kernel) -> float32 partials [split_k, 16, N]."""
    k, n = w.shape
    steps = _check_config(cfg, k, n, 16)
    kernel = functools.partial(_dense_kernel, block_n=cfg.block_n, block_k=cfg.block_k, steps=steps)
    return pl.pallas_call(
        kernel,
        grid=(n // cfg.block_n, cfg.split_k),
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, ROW_TILE, n), jnp.float32),
        interpret=interpret,
        compiler_params=_compiler_params(cfg, interpret),
        name="dense_rows_matmul",
    )(xp, w)


def _dense_kernel(x_ref, w_ref, o_ref, *, block_n, block_k, steps):
    """One program: BN output channels x one K split. x_ref [16, K]; w_ref [K, N]; o_ref [S, 16, N] float32."""
    i, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(i * block_n, block_n)

    def step(j, acc):
        ks = pl.ds((split * steps + j) * block_k, block_k)
        x = x_ref[:, ks]
        return acc + jax.lax.dot_general(
            x, w_ref[ks, cols].astype(x.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    o_ref[split, :, cols] = jax.lax.fori_loop(0, steps, step, jnp.zeros((ROW_TILE, block_n), jnp.float32))
