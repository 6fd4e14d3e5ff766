"""Which change made the Qwen3.5 text shape's verify(k) rows differ from its decode rows on the H200 (the steps
section at 98a05e7: verify(3) rows 1-3 not the decode steps' bits; k = 1 and 2 equal; at c11de42 all equal).

Each variant builds the steps section's executables (decode, verify(k), commit; random int4 weights, a random state
at position 384, `jspec_bench.steps._bitwise_check`) in one process, JAX's caches cleared between variants:
- head: the code as it is, twice (a nondeterministic kernel would disagree with itself);
- stream_k_wide: `int4_ws.config_for` as before c75d3f7 (256-row tiles on the stream-K grid of one CTA per SM);
- no_excess_precision: the code as it is, compiled with XLA's xla_allow_excess_precision off (on, its default, XLA
  may drop an f32 -> bf16 -> f32 round trip inside a fusion: a verify row reading an earlier row's fresh conv input
  would then see it unrounded, where a decode step reads it rounded from the cache).

    python3 benchmarks/experiments/hybrid_verify_bits.py --commit <sha> --out $OUT/hybrid_verify_bits_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.engine import compiler_options  # noqa: E402
from jspec.steps import commit  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params, random_state  # noqa: E402
from jspec_bench.steps import _bitwise_check, _decode, _verify  # noqa: E402
from pallas_kernels import ROW_TILE, get_backend, int4_ws  # noqa: E402
from pallas_kernels.prepare import prepare_params  # noqa: E402

CONTEXT = 384


@contextlib.contextmanager
def variant(name: str):
    shipped = int4_ws.config_for

    def stream_k(k: int, n: int) -> int4_ws.Config:
        return dataclasses.replace(shipped(k, n), ctas=None)

    jax.clear_caches()
    int4_ws.config_for = stream_k if name == "stream_k_wide" else shipped
    try:
        yield
    finally:
        int4_ws.config_for = shipped


def check(params, cfg, ks, extra_options: dict) -> dict:
    base = random_state(cfg, CONTEXT + 2 * ROW_TILE, CONTEXT, params["embed"].dtype, 1)
    rng = np.random.default_rng(2)
    drafts = {k: rng.integers(0, cfg.vocab_size, (k,)).astype(np.int32) for k in ks}
    options = (compiler_options() or {}) | extra_options
    jit = functools.partial(jax.jit, donate_argnums=1)
    execs = {"decode": jit(functools.partial(_decode, cfg=cfg)).lower(params, base).compile(compiler_options=options)}
    for k in ks:
        low = jit(functools.partial(_verify, cfg=cfg)).lower(params, base, jnp.asarray(drafts[k]))
        execs[f"verify{k}"] = low.compile(compiler_options=options)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    execs["commit"] = jax.jit(commit, donate_argnums=0).lower(base, scalar, scalar).compile(compiler_options=options)
    return {str(k): _bitwise_check(params, execs, k, base, drafts[k]) for k in ks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--model", default="qwen3.5")
    ap.add_argument("--variants", default="head,head,stream_k_wide,no_excess_precision")
    ap.add_argument("--ks", default="2,3")
    args = ap.parse_args()
    cfg = model_config(args.model, False)
    raw = random_int4_params(cfg, 0, True)
    params = prepare_params(raw, jnp.dtype(raw["embed"].dtype).name, get_backend())
    del raw
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "runs": []}
    for name in args.variants.split(","):
        with variant(name):
            extra = {"xla_allow_excess_precision": False} if name == "no_excess_precision" else {}
            out = check(params, cfg, tuple(int(k) for k in args.ks.split(",")), extra)
        result["runs"].append({"variant": name, "verify": out})
        print(name, json.dumps(out), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
