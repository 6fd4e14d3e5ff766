"""Hybrid Gated-DeltaNet (Qwen3-Next-like, dense MLP) on the GPU: decode_step vs verify_step(k) time, bit exactness.

Run from the repo root on the GPU:
    python3 benchmarks/hybrid_bench.py --commit <sha> --out $OUT/hybrid_h200.json
(`--tiny` runs the same code on CPU with a tiny model, to debug the script.)

Shape (random weights, int4 linears incl. lm_head, bfloat16 activations; stated in the JSON): hidden 2048, 48 layers
(3 Gated DeltaNet : 1 gated attention), 16 query / 2 KV heads of 256 (rotary 0.25), linear heads 16 key / 32 value
of 128, conv 4, SwiGLU intermediate 5632, vocab 151936.

What it measures, in one process, after prefilling a prompt of --prompt-len tokens:
- recurrent: `pallas_kernels.recurrent.gdn_rows` alone on one layer's state (rows 1..4), and its row invariance
  (one call over 4 rows == 4 chained one-row calls, bits).
- steps: jitted, state-donated decode_step and verify_step(k) for k in --ks, each timed as a chain of --iters
  calls at the same position (median per-call time of --trials chains); ratio verify / decode.
- exactness: verify_step(k) row i logits == decode_step logits at position p + i (forced tokens), bit for bit.
- e2e: `Engine.generate` (host loop) with the model's MTP head (one random Qwen3-Next-layout MTP layer) for k in
  --ks, and prompt lookup (k = 3) on an echo prompt (prompt + its greedy continuation + prompt, so lookup hits),
  each against plain greedy: tokens identical (a mismatch is an error), tok/s, mean_accepted. Random MTP weights
  draft badly (mean_accepted near 1): that row measures the cost of a miss; the echo row measures rollback by
  state selection when drafts are accepted.
Each section records its own error (if any) in the JSON and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.config import ModelConfig, RopeConfig  # noqa: E402
from jspec.exactness import bits, forced_decode_logits, mismatched_rows  # noqa: E402
from jspec.models import hybrid, quantize_linears  # noqa: E402
from jspec.models.mtp import init_mtp_params  # noqa: E402
from jspec.state import init_state  # noqa: E402
from pallas_kernels import ROW_TILE, get_backend, set_backend  # noqa: E402
from pallas_kernels.recurrent import gdn_rows, l2_normalize  # noqa: E402

FULL_SHAPE = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=48,
    num_heads=16,
    num_kv_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
)


def make_config(shape: dict, layers: int | None = None, rope_theta: float = 10_000_000.0) -> ModelConfig:
    """Qwen3-Next layout (every 4th layer gated attention, the others Gated DeltaNet; one MTP layer) at `shape`
    (ModelConfig fields, as FULL_SHAPE), `layers` overriding its layer count."""
    shape = dict(shape)
    if layers:
        shape["num_layers"] = layers
    layer_types = tuple(
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape["num_layers"])
    )
    return ModelConfig(
        family="qwen3_next",
        **shape,
        rope=RopeConfig(theta=rope_theta, partial_rotary_factor=0.25),
        layer_types=layer_types,
        attn_output_gate=True,
        norm_plus_one=True,
        linear_conv_kernel_dim=4,
        num_mtp_layers=1,
        mtp_layout="qwen3_next",
    )


def make_params(cfg: ModelConfig, dtype, int4: bool = True) -> dict:
    """Random params (one MTP layer included); with int4, every linear (and lm_head) quantized to int4."""
    params = hybrid.init_params(cfg, jax.random.PRNGKey(0), dtype)
    params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(1), dtype, cfg.num_mtp_layers)
    return quantize_linears(params) if int4 else params


def timed_chain(fn, state, iters: int, trials: int) -> tuple[float, object]:
    """Median over trials of (wall time of `iters` chained calls) / iters, in ms (after one warm-up call); returns
    the final state too."""
    state = fn(state)
    times = []
    for _ in range(trials):
        jax.block_until_ready(state)
        start = time.perf_counter()
        for _ in range(iters):
            state = fn(state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(times), state


def copy_state(state):
    return jax.tree.map(jnp.copy, state)


def bench_recurrent(cfg: ModelConfig, iters: int, trials: int) -> dict:
    """gdn_rows alone on one layer's candidate states: time for rows 1..4 and row invariance."""
    rng = np.random.default_rng(0)
    r, h, dk, dv = ROW_TILE, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    states = jnp.asarray(rng.normal(size=(r, h, dk, dv)).astype(np.float32))
    q = l2_normalize(jnp.asarray(rng.normal(size=(r, h, dk)).astype(np.float32))) * dk**-0.5
    k = l2_normalize(jnp.asarray(rng.normal(size=(r, h, dk)).astype(np.float32)))
    v = jnp.asarray(rng.normal(size=(r, h, dv)).astype(np.float32))
    g = -jnp.asarray(rng.uniform(0, 0.5, (r, h)).astype(np.float32))
    beta = jnp.asarray(rng.uniform(0, 1, (r, h)).astype(np.float32))
    slot = jnp.zeros((), jnp.int32)  # a traced argument, as DecodeState.slot in the steps
    out = dict(state_mb=states[0].nbytes / 1e6, ms={})
    fns = {}
    for rows in (1, 2, 3, 4):
        fns[rows] = jax.jit(functools.partial(gdn_rows, rows=rows), donate_argnums=0)
        out["ms"][rows], _ = timed_chain(
            lambda s, f=fns[rows]: f(s, slot, q, k, v, g, beta)[0], copy_state(states), iters, trials
        )
    all_states, all_out = fns[4](copy_state(states), slot, q, k, v, g, beta)
    s, same = copy_state(states), True
    for i in range(4):
        shifted = [jnp.roll(x, -i, axis=0) for x in (q, k, v, g, beta)]
        s, o = fns[1](s, slot, *shifted)
        same &= np.array_equal(bits(o[0]), bits(all_out[i])) and np.array_equal(bits(s[0]), bits(all_states[i]))
    out["rows_bit_identical"] = bool(same)
    return out


def bench_steps(cfg: ModelConfig, params: dict, dtype, args) -> dict:
    max_len = args.prompt_len + 64
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, args.prompt_len).astype(np.int32)
    t0 = time.perf_counter()
    state = init_state(cfg, max_len, dtype)
    state, _ = jax.jit(jspec.prefill, static_argnums=1)(params, cfg, state, prompt, args.prompt_len)
    jax.block_until_ready(state)
    out = dict(prompt_len=args.prompt_len, prefill_compile_and_run_s=time.perf_counter() - t0, ms={}, compile_s={})

    force = jax.jit(lambda s, t: jspec.commit(s, jnp.int32(0), t), donate_argnums=0)
    draft = np.random.default_rng(2).integers(0, cfg.vocab_size, max(args.ks)).astype(np.int32)

    def compile_step(name, fn, *step_args):
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=1).lower(params, *step_args).compile()
        out["compile_s"][name] = time.perf_counter() - t0
        return compiled

    decode = compile_step("decode", lambda p, s: jspec.decode_step(p, cfg, s), state)
    verify = {
        k: compile_step(f"verify_k{k}", lambda p, s, d: jspec.verify_step(p, cfg, s, d), state, draft[:k])
        for k in args.ks
    }
    out["ms"]["decode"], _ = timed_chain(lambda s: decode(params, s)[0], copy_state(state), args.iters, args.trials)
    for k in args.ks:
        out["ms"][f"verify_k{k}"], _ = timed_chain(
            lambda s, k=k: verify[k](params, s, draft[:k])[0], copy_state(state), args.iters, args.trials
        )
    out["ratio"] = {f"verify_k{k}": out["ms"][f"verify_k{k}"] / out["ms"]["decode"] for k in args.ks}

    def step(s, token):
        s, logits = decode(params, s)
        return force(s, jnp.int32(token)), logits

    decoded = forced_decode_logits(step, copy_state(state), np.append(draft, 0))
    out["verify_rows_bit_identical_to_decode"] = {
        f"k{k}": not mismatched_rows(verify[k](params, copy_state(state), draft[:k])[1], decoded) for k in args.ks
    }
    return out


def bench_e2e(cfg: ModelConfig, params: dict, args) -> dict:
    """Speculative (MTP k in args.ks; prompt lookup k=3 on an echo prompt) vs plain greedy, host loop: identity,
    tok/s (second of two runs: the first compiles), mean_accepted."""
    n_new = args.new_tokens
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, args.prompt_len // 2)]
    max_len = 2 * args.prompt_len + 2 * n_new + 64

    def run(engine, tokens, **kw):
        engine.generate(tokens, n_new, **kw)
        t0 = time.perf_counter()
        r = engine.generate(tokens, n_new, **kw)
        return r, n_new / (time.perf_counter() - t0)

    greedy_engine = jspec.Engine(params, cfg, max_len=max_len, k=1)
    out = {"new_tokens": n_new, "runs": {}}
    greedy, greedy_tps = run(greedy_engine, prompt)
    echo = prompt + greedy.tokens + prompt
    echo_greedy, echo_greedy_tps = run(greedy_engine, echo)
    out["runs"]["greedy"] = dict(tok_s=greedy_tps)
    out["runs"]["greedy_echo"] = dict(tok_s=echo_greedy_tps)
    cases = [(f"mtp_k{k}", k, jspec.MTPDrafter(), prompt, greedy, greedy_tps) for k in args.ks]
    cases.append(("lookup_k3_echo", 3, jspec.PromptLookup(), echo, echo_greedy, echo_greedy_tps))
    for name, k, drafter, tokens, reference, reference_tps in cases:
        r, tps = run(jspec.Engine(params, cfg, max_len=max_len, k=k), tokens, drafter=drafter)
        out["runs"][name] = dict(
            k=k,
            tok_s=tps,
            speedup=tps / reference_tps,
            mean_accepted=r.stats.mean_accepted,
            identical=r.tokens == reference.tokens,
        )
        print(f"{name:16s} {tps:8.1f} tok/s  x{tps / reference_tps:.2f}  mean_accepted {r.stats.mean_accepted:.2f}"
              f"  identical={r.tokens == reference.tokens}", flush=True)  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (script debugging)")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--commit", default="unknown", help="git commit of the code measured")
    parser.add_argument("--backend", default=None, help="kernel backend (default: pallas on GPU, reference on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (compile time)")
    parser.add_argument("--ks", default="1,2,3", help="draft lengths k to time verify_step at")
    parser.add_argument("--prompt-len", type=int, default=None, help="prefill length (default 512; tiny 40)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed chain (default 50; tiny 3)")
    parser.add_argument("--trials", type=int, default=None, help="timed chains per measurement (default 5; tiny 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="e2e new tokens per run (default 128; tiny 12)")
    args = parser.parse_args()
    args.ks = tuple(int(k) for k in args.ks.split(","))
    args.prompt_len = args.prompt_len or (40 if args.tiny else 512)
    args.iters = args.iters or (3 if args.tiny else 50)
    args.new_tokens = args.new_tokens or (12 if args.tiny else 128)
    args.trials = args.trials or (2 if args.tiny else 5)
    if args.backend:
        set_backend(args.backend)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    cfg = make_config(TINY_SHAPE if args.tiny else FULL_SHAPE, args.layers)
    result = dict(
        benchmark="hybrid_steps",
        commit=args.commit,
        jax_version=jax.__version__,
        device=str(jax.devices()[0].device_kind),
        backend=get_backend(),
        dtype=jnp.dtype(dtype).name,
        weights="int4 (symmetric, block 32) for every linear incl. lm_head; random",
        config=dataclasses.asdict(cfg),
        errors={},
    )
    print(f"device {result['device']}, backend {result['backend']}, {cfg.num_layers} layers, hidden {cfg.hidden_size}")
    try:
        result["recurrent"] = bench_recurrent(cfg, args.iters, args.trials)
        rec = result["recurrent"]
        print(
            f"gdn_rows (state {rec['state_mb']:.1f} MB/layer): "
            + ", ".join(f"rows={r}: {ms:.4f} ms" for r, ms in rec["ms"].items())
            + f"; rows bit-identical: {rec['rows_bit_identical']}"
        )
    except Exception:
        result["errors"]["recurrent"] = traceback.format_exc()[-4000:]
        print(result["errors"]["recurrent"])
    try:
        t0 = time.perf_counter()
        params = make_params(cfg, dtype)
        jax.block_until_ready(params)
        result["init_params_s"] = time.perf_counter() - t0
        steps = bench_steps(cfg, params, dtype, args)
        result["steps"] = steps
        print(f"{'step':<12}{'ms':>10}{'x decode':>10}{'compile s':>11}{'bit-exact':>11}")
        print(f"{'decode':<12}{steps['ms']['decode']:>10.3f}{1.0:>10.2f}{steps['compile_s']['decode']:>11.1f}{'':>11}")
        for k in args.ks:
            name = f"verify_k{k}"
            print(
                f"{name:<12}{steps['ms'][name]:>10.3f}{steps['ratio'][name]:>10.2f}{steps['compile_s'][name]:>11.1f}"
                f"{str(steps['verify_rows_bit_identical_to_decode'][f'k{k}']):>11}"
            )
    except Exception:
        result["errors"]["steps"] = traceback.format_exc()[-4000:]
        print(result["errors"]["steps"])
    if "steps" in result:
        try:
            result["e2e"] = bench_e2e(cfg, params, args)
            bad = [name for name, r in result["e2e"]["runs"].items() if r.get("identical") is False]
            if bad:
                result["errors"]["e2e"] = f"speculative tokens differ from greedy: {bad}"
        except Exception:
            result["errors"]["e2e"] = traceback.format_exc()[-4000:]
            print(result["errors"]["e2e"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    exact = all(result.get("steps", {}).get("verify_rows_bit_identical_to_decode", {}).values())
    return 1 if result["errors"] or not exact or not result.get("recurrent", {}).get("rows_bit_identical") else 0


if __name__ == "__main__":
    sys.exit(main())
