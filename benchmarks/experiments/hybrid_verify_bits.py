"""Why one CTA per 256-row int4 tile (adopted in c75d3f7, reverted in fc3e0b8) made the Qwen3.5 text shape's verify
rows differ from its decode rows on the H200: verify(2) row 2 and verify(3) rows 1-3 not the decode steps' bits,
twice alike, where the stream-K partition gave equal rows (experiments/results/hybrid_verify_bits_h200.json, run at
f7ad4ce when one CTA per tile was the code, so its "head" is `tile_per_cta` below and "stream_k_wide" `shipped`).
Row 0 always agrees; the rows that differ read earlier rows' fresh values in the same call.

Each variant builds the steps section's executables (decode, verify(k), commit; random int4 weights, a random state
at position 384, `jspec_bench.steps._bitwise_check`) in one process, JAX's caches cleared between variants. A
variant is a partition, optionally `+` a change:
- partitions: `shipped` (256-row tiles on the stream-K grid), `tile_per_cta` (256-row tiles, one CTA each);
- `+no_excess_precision`: compiled with XLA's xla_allow_excess_precision off (on, its default, XLA may drop an
  f32 -> bf16 -> f32 round trip inside a fusion: a verify row reading an earlier row's fresh conv input would then
  see it unrounded, where a decode step reads it rounded from the cache);
- `+conv_rounded`: the Gated DeltaNet conv's inputs rounded explicitly to the activation dtype
  (`lax.reduce_precision`, which XLA keeps whatever its precision setting), the candidate fix if the above is why.

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
from pallas_kernels import ROW_TILE, get_backend  # noqa: E402
from pallas_kernels.prepare import prepare_params  # noqa: E402

CONTEXT = 384


SHIPPED_CONV = hybrid.causal_conv


def rounded_conv(window, x, weight):
    """`recurrent.causal_conv` on x's float32 copy rounded to x's dtype by `lax.reduce_precision`, so every tap reads
    the rounded input however XLA fuses the converts (the windows it returns are float32 holding those values; the
    cache stores them back in x's dtype exactly)."""
    info = jnp.finfo(x.dtype)
    return SHIPPED_CONV(window, jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant), weight)


@contextlib.contextmanager
def variant(name: str):
    """While active, the variant's partition (`int4_tile_per_cta_e2e.partition`, which clears JAX's caches) and
    change (see the module docstring); yields its extra XLA options."""
    part, _, change = name.partition("+")
    if part not in ("shipped", "tile_per_cta") or change not in ("", "no_excess_precision", "conv_rounded"):
        raise ValueError(f"unknown variant {name!r}")
    with partition(part):
        hybrid.causal_conv = rounded_conv if change == "conv_rounded" else SHIPPED_CONV
        try:
            yield {"xla_allow_excess_precision": False} if change == "no_excess_precision" else {}
        finally:
            hybrid.causal_conv = SHIPPED_CONV


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
        "--variants", default="tile_per_cta,shipped,tile_per_cta+no_excess_precision,tile_per_cta+conv_rounded"
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
