"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention): the recurrent step, the causal depthwise conv1d and the
chunked prefill. All recurrent arithmetic is float32.

The recurrence, per value head (state S [dk, dv], query q / key k [dk] L2-normalised, q scaled by dk**-0.5, value
v [dv], log-decay g <= 0, write strength beta in (0, 1)):
    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   out = S^T q

Exactness (docs/design.md, rule 3): `gdn_rows` advances a row tile one position at a time with the step arithmetic and
keeps the post-state after every valid row in its own candidate slot (the conv cache, which it also writes, holds every
candidate's window); a commit then selects one by index. Decode and verify run the very same compiled loop (the row
count is a runtime value), so row i's post-state and output are the bits of the decode at that position. Everything
outside the loop works on full fixed-shape row tiles. Backends: "reference" is a jnp while loop; "pallas" (GPU) /
"interpret" a Pallas kernel, one program per (value head, block of value columns), that keeps its state block in
registers across the rows: it reads the committed state once and writes each post-state once (an XLA loop makes several
passes over the state per row).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend

L2_EPS = 1e-6  # as the FLA library / transformers: x * rsqrt(sum(x^2) + eps)
CHUNK = 64  # positions per block of the chunked (WY) form of the recurrence
BLOCK_V = 32  # value columns per program of the recurrent kernel (state block [dk, BLOCK_V] float32 in registers)
# Upper bound on one program's candidate-state block [R, dk, block_v] float32, and the warps of a program. On the
# H200 (jax 0.11.2, Triton) a 256 KiB block (R=16, dk=128, block_v=32) failed to compile ("Shared memory size limit
# exceeded: requested 262144, available: 232448"); 128 KiB (block_v=16) with one warp cost the least per row of
# warps 1/2/4/8 x block_v 4/8/16 at the Qwen3.5 shape: 0.93 us a row, 2.7 us a one-row call, where 4 warps over
# 8 columns cost 1.83 / 4.2 us (benchmarks/experiments/results/recurrent_variants_qwen35_h200.json).
STATE_BLOCK_BYTES = 128 * 1024
NUM_WARPS = 1  # Triton warps per program
CACHE_CHUNK = 16  # conv cache columns a program of the recurrent kernel writes at a time (`cache_chunk`)
_HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array) -> jax.Array:
    """float32 x [..., d] -> x / sqrt(sum(x^2) + eps) along the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def gdn_query_key(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The conv's query and key columns, float32 [..., dk], as the recurrence reads them: L2-normalised, q scaled
    by dk**-0.5."""
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


def gdn_columns(conv: jax.Array, key_heads: int, dk: int, dv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The conv's output rows [T, 2 nk dk + h dv] (query | key | value columns, nk = key_heads) split per head ->
    (q, k [T, nk, dk], v [T, h, dv]); value head i reads key head i // (h // nk)."""
    t = conv.shape[0]
    q, k, v = jnp.split(conv, [key_heads * dk, 2 * key_heads * dk], axis=-1)
    return q.reshape(t, key_heads, dk), k.reshape(t, key_heads, dk), v.reshape(t, -1, dv)


def gdn_gates(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The in_proj's gate columns a, b [..., h] (any float dtype) and the layer's a_log, dt_bias [h] -> float32
    (g, beta) [..., h]: the log-decay g = -exp(a_log) softplus(a + dt_bias) <= 0 and the write strength
    beta = sigmoid(b), both computed in float32 (transformers' Qwen3.5 computes the sigmoid in b's dtype)."""
    f32 = jnp.float32
    g = -jnp.exp(a_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b.astype(f32))


def stored_values(x: jax.Array, dtype) -> jax.Array:
    """float32 [...]: x's values rounded to `dtype`, the values a `dtype` buffer would hold, whatever XLA fuses.

    `x.astype(dtype).astype(float32)` does not promise that: with xla_allow_excess_precision on (XLA's default) the
    GPU compiler's SimplifyFPConversions removes f32 -> bf16 -> f32 convert pairs, depending on the whole graph.
    `lax.reduce_precision` is removed only where it is a no-op. docs/design.md, rule 7. dtype: float32 or bfloat16
    (float32's exponent range; reduce_precision does not round float16's subnormals as a convert does).
    """
    info = jnp.finfo(dtype)
    if info.nexp != jnp.finfo(jnp.float32).nexp:
        raise ValueError(f"stored_values takes float32 or bfloat16, got {jnp.dtype(dtype).name}")
    return jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant)


def causal_conv(window: jax.Array, x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d + SiLU over new inputs x [T, C] preceded by the window [W-1, C] of earlier inputs.

    weight [W, C] (tap W-1 multiplies the current input). Returns (float32 [T, C], seq [W-1+T, C] = window ++ x in
    x.dtype, from which `conv_window` reads later windows). Taps are summed in float32 in a fixed order, over the
    inputs' `stored_values`: a verify row reads an earlier row's fresh input exactly as the decode step at its
    position reads it from the cached window.
    """
    width = weight.shape[0]
    seq = jnp.concatenate([window.astype(x.dtype), x], axis=0)
    seqf, wf = stored_values(seq, x.dtype), weight.astype(jnp.float32)
    t = x.shape[0]
    acc = seqf[0:t] * wf[0]
    for j in range(1, width):
        acc = acc + seqf[j : j + t] * wf[j]
    return jax.nn.silu(acc), seq


def conv_window(seq: jax.Array, consumed, width: int) -> jax.Array:
    """Rows consumed .. consumed + W-2 of seq [*, C] (static or traced consumed): of `causal_conv`'s seq, the conv
    window after its first `consumed` inputs; of a Gated DeltaNet conv cache (jspec.models.hybrid), candidate slot
    `consumed`'s window."""
    return jax.lax.dynamic_slice_in_dim(seq, consumed, width - 1, axis=0)


def gdn_step(state, q, k, v, g, beta):
    """One position of one value head: state [dk, dv], q/k [dk], v [dv], g/beta [] (float32) -> (state, out [dv])."""
    state = state * jnp.exp(g)
    kv = jnp.sum(state * k[:, None], axis=0)
    delta = (v - kv) * beta
    state = state + k[:, None] * delta[None, :]
    return state, jnp.sum(state * q[:, None], axis=0)


def gdn_rows(cache, slot, inputs, a_log, dt_bias, rows: int, *, key_heads: int):
    """Advance the first `rows` rows of a row tile from candidate state `slot`, keeping every post-state.

    cache: a Gated DeltaNet layer's candidate states, {"ssm": float32 [R, h, dk, dv] (ssm[slot] the committed
    recurrent state), "conv": [R + W - 2, C] (candidate slot s's conv window: rows s .. s + W - 2), C = 2 nk dk + h dv}.
    inputs float32 [R, 2 C + 2 h]: per row the conv's output (query | key | value columns; nk = key_heads key heads,
    value head i reads key head i // (h // nk)), the in_proj's gate columns b and a (h each), then the conv's inputs
    (C columns, the values the conv cache holds); a_log, dt_bias [h]. The recurrence's inputs (`gdn_query_key`,
    `gdn_gates`) are computed per row inside the loop, so no XLA arithmetic stands between the conv, the in_proj and
    the recurrence (the gate columns only change dtype, exactly, on their way into `inputs`). R = ROW_TILE, the full
    row tile. Returns (cache, out float32 [R, h, dv] with rows >= `rows` zero): ssm with the post-state after row i
    in slot i for i < rows; conv = slot's window less its first row ++ the R rows' inputs, valid or not, so candidate
    slot i's window is the one after row i (docs/design.md, rule 7: nothing written depends on the row count).

    The conv cache is written here, in place, rather than by an XLA op after the kernel: a whole-buffer write that
    reads the same buffer at another offset cannot run in place, so XLA wrote it to a temporary and copied it back,
    two launches a layer (docs/kernels.md, "Gated DeltaNet row step").

    `rows` is static, but the loop gets it as a runtime value hidden behind an optimization barrier: decode (1 row)
    and verify (k + 1 rows) run the very same compiled loop body, a fusion boundary for XLA, so row i's arithmetic
    cannot depend on the row count or on the calling context. Without the barrier XLA can prove the count where
    `slot` is a known constant (in `generate_on_device`'s greedy while loop slot is always 0: prefill and every
    decode commit set it to 0), see a trip count of 1, inline the loop body and fuse it differently; on XLA:CPU
    that changed which product of `exp(g) S + k u^T` is contracted into an FMA (interpret mode).
    """
    states, conv = cache["ssm"], cache["conv"]
    r, h, dk, dv = states.shape
    if not 1 <= rows <= r or inputs.shape[0] != r:
        raise ValueError(f"rows={rows} must be in 1..{r} and the tile must have {r} rows, got {inputs.shape[0]}")
    channels = 2 * key_heads * dk + h * dv
    if h % key_heads or inputs.shape[1] != 2 * channels + 2 * h:
        raise ValueError(
            f"gdn_rows: {h} value heads of {dk} x {dv} over {key_heads} key heads need {2 * channels + 2 * h} input "
            f"columns (query | key | value | b | a | conv inputs), got {inputs.shape[1]}"
        )
    if conv.shape[1] != channels or conv.shape[0] < r:
        raise ValueError(
            f"gdn_rows: the conv cache must be [{r} + W - 2, {channels}] ({r} candidate slots), got {conv.shape}"
        )
    slot, count = jax.lax.optimization_barrier((slot, jnp.asarray(rows, jnp.int32)))
    name = _backend.get_backend()
    args = (states, conv, slot, inputs.astype(jnp.float32), a_log, dt_bias, count, key_heads)
    if name == "reference":
        states, conv, out = _rows_reference(*args)
    else:
        states, conv, out = _rows_pallas(*args, interpret=name == "interpret")
    return dict(conv=conv, ssm=states), out


def _row_inputs(q, k, v, a, b, a_log, dt_bias):
    """One row's recurrence inputs from its raw ones (`gdn_query_key`, `gdn_gates`): q, k [..., dk], v [..., dv],
    a, b, a_log, dt_bias [...] -> (q, k, v, g, beta), float32."""
    q, k = gdn_query_key(q, k)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    return q, k, v.astype(jnp.float32), g, beta


def _rows_reference(states, conv_cache, slot, inputs, a_log, dt_bias, count, key_heads):
    r, h, dk, dv = states.shape
    channels = conv_cache.shape[1]
    conv, b, a, raw = jnp.split(inputs, [channels, channels + h, channels + 2 * h], axis=-1)
    window = conv_window(conv_cache, slot, conv_cache.shape[0] - r + 2)  # the slot's W - 1 rows
    conv_cache = jnp.concatenate([window[1:], raw.astype(conv_cache.dtype)], axis=0)
    q, k, v = gdn_columns(conv, key_heads, dk, dv)
    q, k = (jnp.repeat(x, h // key_heads, axis=1) for x in (q, k))

    def body(i, carry):
        state, states, out = carry
        row = _row_inputs(q[i], k[i], v[i], a[i], b[i], a_log, dt_bias)
        state, o = jax.vmap(gdn_step)(state, *row)
        return state, states.at[i].set(state), out.at[i].set(o)

    init = (jax.lax.dynamic_index_in_dim(states, slot, keepdims=False), states, jnp.zeros((r, h, dv), jnp.float32))
    _, states, out = jax.lax.fori_loop(0, count, body, init)
    return states, conv_cache, out


def _rows_kernel(
    slot_ref,
    count_ref,
    s_ref,
    c_ref,
    q_ref,
    k_ref,
    v_ref,
    a_ref,
    b_ref,
    x_ref,
    alog_ref,
    dt_ref,
    s_out,
    c_out,
    o_ref,
    *,
    grid: tuple[int, int],
):
    """One (value head, dv block) program: s_ref/s_out [R, dk, BV] (aliased), q_ref/k_ref [R, dk] (its key head's
    columns), v_ref/o_ref [R, BV], a_ref/b_ref [R], alog_ref/dt_ref [1]; c_ref/c_out the whole conv cache
    [R + W - 2, C] (aliased) and x_ref the whole inputs [R, 2 C + 2 h], for `_read_conv_cache`. The state stays in
    registers across the rows; each post-state is stored once. A row's inputs do not depend on the state, so row
    i + 1's are loaded and prepared (`_row_inputs`) before row i computes: off the rows' sequential chain (the same
    values, so the same bits)."""
    conv_cache = _read_conv_cache(slot_ref[0], c_ref, x_ref, grid=grid)  # loads issued before the rows' chain
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    last = q_ref.shape[0] - 1
    a_log, dt_bias = alog_ref[0], dt_ref[0]

    def inputs(i):
        i = jnp.minimum(i, last)  # past the tile's last row: a load nobody uses
        return _row_inputs(q_ref[i], k_ref[i], v_ref[i], a_ref[i], b_ref[i], a_log, dt_bias)

    def step(i, carry):
        state, row = carry
        ahead = inputs(i + 1)
        state, o_ref[i] = gdn_step(state, *row)
        s_out[i] = state
        return state, ahead

    jax.lax.fori_loop(0, count_ref[0], step, (s_ref[slot_ref[0]], inputs(0)))
    _store_conv_cache(conv_cache, c_out)  # after the chain: its stores wait for nothing the rows need


def _read_conv_cache(slot, c_ref, x_ref, *, grid: tuple[int, int]) -> list:
    """This program's share of the conv cache's new contents, [window rows slot + 1 .. slot + W - 2 ++ the tile's R
    rows of conv inputs (x_ref's last C columns)], loaded: column chunks p, p + P, ... of `cache_chunk` columns, p
    this program's index in the (static) grid of P programs, as (first column, valid, window rows, inputs) for
    `_store_conv_cache` (a chunk past the last, valid False, loads the last chunk and is not stored). No other
    program touches these columns, and the kernel stores them after it has read every window."""
    channels = c_ref.shape[1]
    keep = c_ref.shape[0] - x_ref.shape[0]  # W - 2
    width = cache_chunk(channels)
    chunks, programs = channels // width, grid[0] * grid[1]
    program = pl.program_id(0) * grid[1] + pl.program_id(1)
    raw_at = x_ref.shape[1] - channels
    pending = []
    for t in range(-(-chunks // programs)):
        chunk = program + t * programs
        at = pl.multiple_of(jnp.minimum(chunk, chunks - 1) * width, width)
        window = [c_ref[slot + 1 + i, pl.ds(at, width)] for i in range(keep)]
        pending.append((at, chunk < chunks, window, x_ref[:, pl.ds(raw_at + at, width)]))
    return pending


def _store_conv_cache(pending: list, c_out) -> None:
    """Store `_read_conv_cache`'s chunks into the conv cache c_out [R + W - 2, C]."""
    for at, valid, window, raw in pending:

        def store(at=at, window=window, raw=raw):
            cols = pl.ds(at, raw.shape[1])
            for i, row in enumerate(window):
                c_out[i, cols] = row
            c_out[pl.ds(len(window), raw.shape[0]), cols] = raw.astype(c_out.dtype)

        pl.when(valid)(store)


def cache_chunk(channels: int) -> int:
    """Columns of the conv cache a program writes at a time: the largest power of 2 up to CACHE_CHUNK that divides
    `channels` (Triton's loads and stores take power-of-2 shapes)."""
    return math.gcd(channels, CACHE_CHUNK)


def state_block_columns(r: int, dk: int, dv: int) -> int:
    """Value columns per program of the recurrent kernel for an r-row tile: BLOCK_V (at most dv), halved until the
    program's candidate-state block [r, dk, columns] float32 fits STATE_BLOCK_BYTES."""
    block_v = min(dv, BLOCK_V)
    while block_v > 1 and r * dk * block_v * 4 > STATE_BLOCK_BYTES:
        block_v //= 2
    return block_v


def _rows_pallas(states, conv_cache, slot, inputs, a_log, dt_bias, count, key_heads, *, interpret: bool):
    r, h, dk, dv = states.shape
    group = h // key_heads
    block_v = state_block_columns(r, dk, dv)
    if dv % block_v or dk & (dk - 1) or block_v & (block_v - 1):
        raise ValueError(f"the recurrent kernel needs power-of-2 dk and dv blocks, got dk={dk}, dv={dv}")
    grid = (h, dv // block_v)
    values_at = 2 * key_heads * dk // block_v  # the first value column, in blocks of block_v
    gates_at = 2 * key_heads * dk + h * dv  # b's first column (a's follow)
    scalar = pl.BlockSpec((1,), lambda *_: (0,))
    state_spec = pl.BlockSpec((r, None, dk, block_v), lambda i, j: (0, i, 0, j))
    q_spec = pl.BlockSpec((r, dk), lambda i, j: (0, i // group))
    k_spec = pl.BlockSpec((r, dk), lambda i, j: (0, key_heads + i // group))
    v_spec = pl.BlockSpec((r, block_v), lambda i, j: (0, values_at + i * (dv // block_v) + j))
    out_spec = pl.BlockSpec((r, None, block_v), lambda i, j: (0, i, j))
    b_spec = pl.BlockSpec((r, None), lambda i, j: (0, gates_at + i))
    a_spec = pl.BlockSpec((r, None), lambda i, j: (0, gates_at + h + i))
    head_spec = pl.BlockSpec((1,), lambda i, j: (i,))
    cache_spec = pl.BlockSpec(conv_cache.shape, lambda i, j: (0, 0))  # each program writes its columns (above)
    inputs_spec = pl.BlockSpec(inputs.shape, lambda i, j: (0, 0))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    states, conv_cache, out = pl.pallas_call(
        functools.partial(_rows_kernel, grid=grid),
        grid=grid,
        in_specs=[scalar, scalar, state_spec, cache_spec, q_spec, k_spec, v_spec, a_spec, b_spec, inputs_spec]
        + [head_spec] * 2,
        out_specs=[state_spec, cache_spec, out_spec],
        out_shape=[
            jax.ShapeDtypeStruct(states.shape, jnp.float32),
            jax.ShapeDtypeStruct(conv_cache.shape, conv_cache.dtype),
            jax.ShapeDtypeStruct((r, h, dv), jnp.float32),
        ],
        input_output_aliases={2: 0, 3: 1},
        compiler_params=params,
        interpret=interpret,
        name="jspec_gdn_rows",
    )(
        jnp.reshape(slot, (1,)).astype(jnp.int32),
        jnp.reshape(count, (1,)),
        states,
        conv_cache,
        *[inputs] * 6,  # one array, read through six block specs (query, key, value, a, b columns; the whole)
        a_log,
        dt_bias,
    )
    return states, conv_cache, out


def chunk_gated_delta(q, k, v, g, beta, chunk: int = CHUNK, state=None):
    """The recurrence over a sequence from `state` (float32 [h, dk, dv]; None: zero), chunk by chunk (the WY /
    UT-transform form).

    q/k [T, h, dk], v [T, h, dv], g/beta [T, h] float32 -> (out float32 [T, h, dv], final state [h, dk, dv]).
    A position with g = 0 and beta = 0 leaves the state unchanged (how prefill masks its padding).
    Within a chunk with cumulative log-decay G_t: u = (I + L)^-1 (beta v - beta e^G k S0), L[t, j] =
    beta_t e^(G_t - G_j) k_t.k_j (j < t); out = e^G q S0 + (q k^T * decay, lower incl. diagonal) u;
    S1 = e^(G_last) S0 + sum_j e^(G_last - G_j) k_j u_j^T.
    """
    t, h, dk = q.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t

    def blocks(x):  # [T, h, ...] -> [h, n, chunk, ...]
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        x = x.reshape((n, chunk) + x.shape[1:])
        return jnp.moveaxis(x, 2, 0)

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [h, n, C]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # [h, n, C, C]
    k_beta = k * beta[..., None]
    strict = jnp.einsum("hncd,hned->hnce", k_beta, k, precision=_HIGHEST) * decay * ~jnp.eye(chunk, dtype=bool)
    system = strict + jnp.eye(chunk, dtype=jnp.float32)

    def solve(rhs):
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    u_v = solve(v * beta[..., None])
    u_k = solve(k_beta * jnp.exp(cum)[..., None])
    attn = jnp.einsum("hncd,hned->hnce", q, k, precision=_HIGHEST) * decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [h, n]

    def body(state, xs):
        u_v_c, u_k_c, attn_c, q_c, k_c, decay_c = xs
        u = u_v_c - jnp.einsum("hcd,hde->hce", u_k_c, state, precision=_HIGHEST)
        out = jnp.einsum("hcd,hde->hce", q_c, state, precision=_HIGHEST)
        out = out + jnp.einsum("hce,hef->hcf", attn_c, u, precision=_HIGHEST)
        state = state * decay_c[:, None, None] + jnp.einsum("hcd,hce->hde", k_c, u, precision=_HIGHEST)
        return state, out

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (u_v, u_k, attn, q_decayed, k_decayed, chunk_decay))
    state = jnp.zeros((h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    state, out = jax.lax.scan(body, state, xs)  # out [n, h, C, dv]
    out = jnp.moveaxis(out, 1, 0).reshape(h, n * chunk, dv)[:, :t]
    return jnp.moveaxis(out, 0, 1), state
