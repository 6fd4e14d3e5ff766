"""Why one CTA per 256-row int4 tile (adopted in c75d3f7, reverted in fc3e0b8) made the Qwen3.5 text shape's verify
rows differ from its decode rows on the H200 — verify(2) row 2 and verify(3) rows 1-3 not the decode steps' bits,
twice alike, where the stream-K partition gave equal rows — and the fix that let it be re-adopted.

Each variant builds the steps section's executables (decode, verify(k), commit; random int4 weights, a random state
at position 384, `jspec_bench.steps._bitwise_check`) in one process, JAX's caches cleared between variants. A
variant is a partition of the 256-row tiles (`int4_tile_per_cta_e2e.partition`: `tile_per_cta` or `stream_k`),
optionally `+` changes:
- `+unrounded`: the Gated DeltaNet conv reads its inputs as `x.astype(dtype).astype(float32)` (the code before
  `recurrent.stored_values`): with xla_allow_excess_precision on (XLA's default) XLA may drop that f32 -> bf16 ->
  f32 round trip, so a verify row reads an earlier row's fresh conv input unrounded where a decode step reads it
  rounded from the cached window;
- `+no_excess_precision`: compiled with xla_allow_excess_precision off.

Runs: experiments/results/hybrid_verify_bits_h200.json (f7ad4ce: its "head" was tile_per_cta unrounded, its
"stream_k_wide" stream_k unrounded); hybrid_verify_bits_fix_h200.json (cb7cd5c, before the fix shipped: its
"shipped" was stream_k unrounded, "tile_per_cta" tile_per_cta unrounded, "+conv_rounded" the input rounding);
hybrid_verify_bits_output_rounded_h200.json (3f1c7d7: the conv's output rounded by `stored_values` too, no barrier
after the conv: every row of verify(2) and verify(3) differs, row 0 included; with "+unrounded" only the rows reading
earlier rows' inputs, as before); hybrid_verify_bits_barrier_h200.json (3b036bb: an optimization barrier on the conv's
(output, seq): every row equal under both partitions, rounded or not). A barrier on the conv's output alone shipped at
954f9db; 8b6c0b1 replaced it: decode and verify write the conv windows of every row of the tile, so nothing around the
conv depends on the row count (docs/design.md, rule 7); the bench measured every row bitwise equal
(bench_hybrid_qwen35_all_windows_h200.json, bench_hybrid_wave_fill_h200.json).

    python3 benchmarks/experiments/hybrid_verify_bits.py --commit <sha> --out $OUT/hybrid_verify_bits_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from int4_tile_per_cta_e2e import partition  # noqa: E402  (a script here: its directory is sys.path[0])

from jspec.engine import compiler_options  # noqa: E402
from jspec.models import hybrid  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params, random_state  # noqa: E402
from jspec_bench.steps import _bitwise_check, lower_steps  # noqa: E402
from pallas_kernels import ROW_TILE, get_backend, recurrent  # noqa: E402
from pallas_kernels.prepare import prepare_params  # noqa: E402

CONTEXT = 384


def unrounded(x, dtype):
    """`recurrent.stored_values` as the code read it before: a convert pair XLA may remove."""
    return x.astype(dtype).astype(jnp.float32)


@contextlib.contextmanager
def variant(name: str):
    """While active, the variant's partition (which clears JAX's caches) and changes (see the module docstring);
    yields its extra XLA options."""
    part, *changes = name.split("+")
    if not set(changes) <= {"unrounded", "no_excess_precision"}:
        raise ValueError(f"unknown variant {name!r}")
    with partition(part), contextlib.ExitStack() as stack:
        if "unrounded" in changes:
            for module in (recurrent, hybrid):
                stack.enter_context(patched(module, "stored_values", unrounded))
        yield {"xla_allow_excess_precision": False} if "no_excess_precision" in changes else {}


@contextlib.contextmanager
def patched(module, name: str, value):
    shipped = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, shipped)


def check(params, cfg, ks, extra_options: dict) -> dict:
    """`_bitwise_check` of verify(k) for each k, the steps compiled as an Engine compiles them plus extra_options."""
    base = random_state(cfg, CONTEXT + 2 * ROW_TILE, CONTEXT, params["embed"].dtype, 1)
    rng = np.random.default_rng(2)
    drafts = {k: rng.integers(0, cfg.vocab_size, (k,)).astype(np.int32) for k in ks}
    options = (compiler_options() or {}) | extra_options
    execs = {key: low.compile(compiler_options=options) for key, low in lower_steps(params, cfg, base, drafts).items()}
    return {str(k): _bitwise_check(params, execs, k, base, drafts[k]) for k in ks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--model", default="qwen3.5")
    ap.add_argument(
        "--variants",
        default="tile_per_cta,stream_k,tile_per_cta+unrounded,stream_k+unrounded,tile_per_cta+unrounded+no_excess_precision",
    )
    ap.add_argument("--ks", default="2,3")
    args = ap.parse_args()
    cfg = model_config(args.model, False)
    raw = random_int4_params(cfg, 0, True)
    params = prepare_params(raw, jnp.dtype(raw["embed"].dtype).name, get_backend())
    del raw
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "runs": []}
    for name in args.variants.split(","):
        with variant(name) as extra:
            out = check(params, cfg, tuple(int(k) for k in args.ks.split(",")), extra)
        result["runs"].append({"variant": name, "verify": out})
        print(name, json.dumps(out), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
