"""One CTA per weight tile for the int4 products with 256-row tiles (gate_up, lm_head), measured where users feel it:
greedy decode tokens/s of `Engine.generate` (B = 1) and `Engine.generate_batch` (B = 64), Llama-3-8B shape, random
int4 weights, 64 new tokens after 320-token prompts (prefill excluded).

Why: alone, such a product ran faster with one CTA per tile (no stream-K partials) than the shipped stream-K grid
(experiments/results/int4_64rows_h200.json: gate_up 35.1 against 40.2 us at 64 rows, 23.8 against 26.8 at 16; the
lm_head 140.8 against 155.5 at 64 rows), while qkv, o and down (32-48 tiles on 132 SMs) ran slower. A product's
own kernel time counts the partials' sum, which XLA fuses into the consumer inside a step, so only the step says
whether the gain survives. `partition` patches `int4_ws.config_for` while each engine compiles: a 256-row config
gets `ctas` = its tiles (`tile_per_cta`, shipped since it was re-adopted) or the default stream-K grid
(`stream_k`, shipped before; the run at d340a17 called it "shipped"). Another partition gives other bits; rows
stay exact by construction. Identity: prompt lookup's tokens against greedy's under each partition; the batch's
first sequence against itself run alone in the engine.

    python3 benchmarks/experiments/int4_tile_per_cta_e2e.py --out $OUT/int4_tile_per_cta_e2e_h200.json --commit <sha>
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec import Engine, PromptLookup  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params  # noqa: E402
from pallas_kernels import int4_ws  # noqa: E402

NEW, PROMPT = 64, 320


@contextlib.contextmanager
def partition(variant: str):
    """While active, `int4_ws.config_for` gives its 256-row configs the `variant` partition: "tile_per_cta" (one CTA
    per weight tile) or "stream_k" (the default grid, one CTA per SM). JAX's tracing caches are cleared first, so
    no jaxpr traced under another variant is reused. Yields the (K, N) of every 256-row config the patch set, so a
    caller can check its engines were traced under it."""
    if variant not in ("tile_per_cta", "stream_k"):
        raise ValueError(f"unknown partition {variant!r}")
    shipped = int4_ws.config_for
    patched = []

    def partitioned(k: int, n: int) -> int4_ws.Config:
        cfg = shipped(k, n)
        if cfg.wg_rows == int4_ws.Config().wg_rows:
            return cfg
        patched.append((k, n))
        return dataclasses.replace(cfg, ctas=n // cfg.tile_rows if variant == "tile_per_cta" else None)

    jax.clear_caches()
    int4_ws.config_for = partitioned
    try:
        yield patched
    finally:
        int4_ws.config_for = shipped


def decode_rate(stats) -> float:
    return stats.new_tokens / (stats.wall_time_s - stats.prefill_time_s)


def run(variant: str, params, cfg, prompts: list, batch: int) -> dict:
    """Greedy tokens/s at B = 1 and B = `batch`, the engines compiled under `variant`'s partition."""
    max_len = PROMPT + NEW + 16
    out = {}
    with partition(variant) as patched:
        single = Engine(params, cfg, max_len=max_len, k=7)
        greedy = single.generate(prompts[0], NEW, eos_id=())  # compiles
        lookup = single.generate(prompts[0], NEW, drafter=PromptLookup(), eos_id=())
        wide = Engine(params, cfg, max_len=max_len, k=7, batch_size=batch)
        wide.generate_batch(prompts[:batch], NEW, eos_id=())  # compiles
    if jax.default_backend() == "gpu" and not patched:
        raise RuntimeError(f"{variant}: no int4 product was traced under the patch (a cached trace was reused)")
    out["patched_products"] = sorted(set(patched))
    rates = [decode_rate(single.generate(prompts[0], NEW, eos_id=()).stats) for _ in range(3)]
    out["b1"] = {"decode_tok_s": float(np.median(rates)), "runs": rates}
    out["b1"]["lookup_identical"] = lookup.tokens == greedy.tokens
    results = [wide.generate_batch(prompts[:batch], NEW, eos_id=()) for _ in range(2)]
    out[f"b{batch}"] = {"decode_tok_s": max(decode_rate(r.stats) for r in results)}
    alone = wide.generate_batch(prompts[:1], NEW, eos_id=()).results[0].tokens
    out[f"b{batch}"]["first_alone_identical"] = alone == results[0].results[0].tokens
    out[f"b{batch}"]["vs_b1"] = out[f"b{batch}"]["decode_tok_s"] / out["b1"]["decode_tok_s"]
    print(f"{variant}: {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", default="stream_k,tile_per_cta")
    args = ap.parse_args()
    cfg = model_config("llama-3-8b", False)
    params = random_int4_params(cfg, 0, True)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, PROMPT)] for _ in range(args.batch)]
    result = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "commit": args.commit, "variants": {}}
    for variant in args.variants.split(","):
        result["variants"][variant] = run(variant, params, cfg, prompts, args.batch)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
