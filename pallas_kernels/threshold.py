"""Exact per-row thresholds without a sort: the search behind top-k and top-p (docs/design.md, rule 8).

For each row of x [R, V] (float32) find the smallest float32 threshold t with

    stat(t) = sum_v w(x_v) * [x_v >= t]   (strict: [x_v > t])   <   limit[row]

where w(x) = x (weighted: the probability mass above t, top-p) or 1 (the count above t, top-k). stat falls as t
rises, so the test is monotone (false ... true) in t. The search runs over the float32 bit patterns, ordered as
uint32 "order keys": each of `PASSES` passes splits the bracket (lo, hi] (lo fails, hi passes) into `WAYS`
intervals, evaluates the test at their upper ends, and keeps the interval where it turns true; 16 ** 8 = 2 ** 32,
so after the last pass hi is the smallest passing bit pattern. No prefix of the vocabulary is ever dropped.

Two implementations, one backend switch (`pallas_kernels.backend`):
- reference: one XLA reduction over x broadcast to [R, V, WAYS] per pass.
- pallas (interpret on CPU): one Triton launch per pass on a grid (row, vocabulary chunk). Each program first
  finishes the previous pass (sums the chunks' partial stats in a fixed order, narrows the bracket: every program
  of a row computes the same bracket), then evaluates its chunk at the new candidates. On the H200 the reference
  ran as ~9 XLA launches per pass (bench_sampling_h200.json); here a pass is one launch.
Both are row-exact: row r's stats depend on row r only, through shapes fixed by V alone. They may differ from each
other in the last bit of a mass sum (summation order), so a platform uses one of them for decode and verify alike.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.backend import get_backend

WAYS = 16  # candidate thresholds per pass (the last one is the bracket's top)
PASSES = 8  # WAYS ** PASSES = 2 ** 32: one bit pattern left


@dataclasses.dataclass(frozen=True)
class Config:
    """block: vocabulary entries per loop step of a program (a power of two); steps: loop steps per program (the
    vocabulary is cut into ceil(V / (block * steps)) chunks, one program per row and chunk); num_warps: Triton's.
    A function of nothing but itself: the rows never choose it."""

    block: int = 1024
    steps: int = 1
    num_warps: int = 8


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 whose unsigned order is x's order (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def from_order_key(u: jax.Array) -> jax.Array:
    bits = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def candidates(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Order keys lo, hi uint32 [..., 1] -> the WAYS ascending candidates uint32 [..., WAYS] splitting (lo, hi] into
    intervals of at most ceil((hi - lo) / WAYS) keys; the last is hi itself."""
    span = hi - lo
    step = jnp.maximum(span // WAYS + (span % WAYS != 0).astype(jnp.uint32), 1)
    ways = jnp.arange(1, WAYS + 1, dtype=jnp.uint32)
    return jnp.where(ways == WAYS, hi, jnp.minimum(lo + step * ways, hi))


def narrow(lo, hi, cand, ok):
    """The next bracket: hi becomes the first passing candidate, lo the last failing one (or stays). lo, hi uint32
    [..., 1]; cand uint32 [..., WAYS]; ok bool [..., WAYS] (monotone: false ... true, and true at hi)."""
    new_hi = jnp.min(jnp.where(ok, cand, hi), axis=-1, keepdims=True)
    new_lo = jnp.max(jnp.where(ok, lo, cand), axis=-1, keepdims=True)
    return new_lo, new_hi


def _stat(x, t, *, weighted: bool, strict: bool):
    """x [..., N, 1] against thresholds t [..., 1, WAYS] -> the per-threshold sums over N [..., WAYS] (float32)."""
    hit = x > t if strict else x >= t
    return jnp.sum(jnp.where(hit, x if weighted else 1.0, 0.0), axis=-2)


def smallest_passing(x, limit, lo, hi, *, weighted: bool, strict: bool, backend: str | None = None, config=None):
    """Per row of x [R, V] float32: the smallest float32 t in the order-key bracket (lo, hi] (uint32 [R]; the test
    must fail at lo and hold at hi) with stat(t) < limit (float32 [R]); see the module docstring. -> float32 [R].
    config: the kernel's `Config` (benchmarks; default Config())."""
    backend = backend or get_backend()
    lo, hi, limit = lo[:, None], hi[:, None], limit.astype(jnp.float32)[:, None]
    if backend == "reference":
        for _ in range(PASSES):
            cand = candidates(lo, hi)
            stat = _stat(x[:, :, None], from_order_key(cand)[:, None, :], weighted=weighted, strict=strict)
            lo, hi = narrow(lo, hi, cand, stat < limit)
        return from_order_key(hi[:, 0])
    cfg = config or Config()
    return _search_kernels(
        x, limit, lo, hi, weighted=weighted, strict=strict, cfg=cfg, interpret=backend == "interpret"
    )


def _layout(vocab: int, cfg: Config) -> tuple[int, int]:
    """(chunks per row, loop steps per chunk) for a vocabulary: a function of V alone (never of the rows)."""
    blocks = pl.cdiv(vocab, cfg.block)
    steps = min(cfg.steps, blocks)
    return pl.cdiv(blocks, steps), steps


def _search_kernels(x, limit, lo, hi, *, weighted, strict, cfg, interpret):
    rows, vocab = x.shape
    chunks, steps = _layout(vocab, cfg)
    width = chunks * steps * cfg.block
    # padding never counts: weighted thresholds are > 0 (lo >= the key of 0.0), count thresholds > the row minimum
    pad = 0.0 if weighted else -jnp.inf
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, width - vocab)), constant_values=pad)
    # the partial stats' block is a power of two long; the slots past `chunks` are never written and never read
    partial_ = jnp.zeros((rows, 1 << (chunks - 1).bit_length(), WAYS), jnp.float32)
    lo, hi = jnp.broadcast_to(lo, (rows, chunks)), jnp.broadcast_to(hi, (rows, chunks))
    for i in range(PASSES):
        lo, hi, partial_ = _search_pass(
            x,
            limit,
            lo,
            hi,
            partial_,
            first=i == 0,
            weighted=weighted,
            strict=strict,
            steps=steps,
            cfg=cfg,
            interpret=interpret,
        )
    lo, hi = lo[:, :1], hi[:, :1]
    cand = candidates(lo, hi)
    _, hi = narrow(lo, hi, cand, jnp.sum(partial_[:, :chunks], axis=1) < limit)
    return from_order_key(hi[:, 0])


def _search_pass(x, limit, lo, hi, partial_, *, first, weighted, strict, steps, cfg, interpret):
    """One launch: finish the previous pass (unless first), then this pass's partial stats [R, P, WAYS] (P: the
    chunks rounded up to a power of two)."""
    rows, chunks = lo.shape
    kernel = functools.partial(
        _pass_kernel, first=first, weighted=weighted, strict=strict, chunks=chunks, steps=steps, block=cfg.block
    )
    row_scalar = pl.BlockSpec((1, 1), lambda r, c: (r, 0))
    mine = pl.BlockSpec((1, 1), lambda r, c: (r, c))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=2)
    return pl.pallas_call(
        kernel,
        grid=(rows, chunks),
        in_specs=[
            row_scalar,
            row_scalar,
            row_scalar,
            pl.BlockSpec((1, partial_.shape[1], WAYS), lambda r, c: (r, 0, 0)),
            pl.BlockSpec((1, steps * cfg.block), lambda r, c: (r, c)),
        ],
        out_specs=[mine, mine, pl.BlockSpec((1, 1, WAYS), lambda r, c: (r, c, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((rows, chunks), jnp.uint32),
            jax.ShapeDtypeStruct((rows, chunks), jnp.uint32),
            jax.ShapeDtypeStruct(partial_.shape, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params,
        name="threshold_search_pass",
    )(limit, lo, hi, partial_, x)


def _pass_kernel(
    limit_ref,
    lo_ref,
    hi_ref,
    partial_ref,
    x_ref,
    lo_out,
    hi_out,
    partial_out,
    *,
    first,
    weighted,
    strict,
    chunks,
    steps,
    block,
):
    """One program (row r, chunk c). limit/lo/hi refs [1, 1]; partial_ref [1, P, WAYS] (the previous pass; slots
    from `chunks` on unwritten); x_ref [1, steps * block]; outputs: this pass's bracket [1, 1] and the chunk's stats
    [1, 1, WAYS]. The stats accumulate per lane ([block, WAYS], step after step), reduced across lanes at the end."""
    lo, hi = lo_ref[...], hi_ref[...]
    if not first:
        parts = partial_ref[0]  # [P, WAYS]
        live = jax.lax.broadcasted_iota(jnp.int32, parts.shape, 0) < chunks
        ok = jnp.sum(jnp.where(live, parts, 0.0), axis=0, keepdims=True) < limit_ref[...]  # [1, WAYS]
        lo, hi = narrow(lo, hi, candidates(lo, hi), ok)
    t = from_order_key(candidates(lo, hi))  # [1, WAYS]

    def stats(xb):  # [block] -> [block, WAYS]
        hit = xb[:, None] > t if strict else xb[:, None] >= t
        return jnp.where(hit, xb[:, None] if weighted else 1.0, 0.0)

    if steps == 1:
        acc = stats(x_ref[0, :])
    else:
        step = lambda b, acc: acc + stats(x_ref[0, pl.ds(pl.multiple_of(b * block, block), block)])  # noqa: E731
        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block, WAYS), jnp.float32))
    lo_out[...], hi_out[...] = lo, hi
    partial_out[...] = jnp.sum(acc, axis=0, keepdims=True)[:, None, :]
