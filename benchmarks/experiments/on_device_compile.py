"""How long `Engine.generate(..., on_device=True)` takes to compile against the prefill chunk shapes it holds.

The on-device executable holds prefill and the whole loop, so it holds one copy of the model per prefill chunk
shape (`jspec.steps.chunk_sizes`: `prefill_chunk` and its halves down to 128, up to 5) besides its rounds'. At the
27B-class hybrid shape (64 layers) that made each executable compile for minutes. This times the first call (the
compile and one short generation) of greedy and of MTP drafting at a shape's width cut to --layers layers, for
each --chunks value (`default`: `engine.default_prefill_chunk(max_len)`), one fresh engine each, all in one process.

    python3 benchmarks/experiments/on_device_compile.py --out /tmp/on_device_compile_cpu.json --commit <sha>
    python3 benchmarks/experiments/on_device_compile.py --no-quick-width --layers 16 --out $OUT/x.json --commit <sha>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec.drafters import MTPDrafter  # noqa: E402
from jspec.engine import Engine, default_prefill_chunk  # noqa: E402
from jspec.steps import chunk_sizes  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params  # noqa: E402


def first_call_s(params, cfg, max_len: int, prompt: list[int], chunk: int, drafter) -> float:
    """Seconds of a fresh engine's first on-device generation of 8 tokens (its compile and the run)."""
    engine = Engine(params, cfg, max_len=max_len, k=3, prefill_chunk=chunk)
    t0 = time.perf_counter()
    engine.generate(prompt, 8, eos_id=(), on_device=True, drafter=drafter)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--model", default="hybrid-27b", help="a jspec_bench shape with an MTP layer")
    ap.add_argument("--quick-width", action=argparse.BooleanOptionalAction, default=True,
                    help="the shape's tiny CPU width (--no-quick-width: full width, a GPU's work)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=912, help="the hybrid section's end-to-end cache length")
    ap.add_argument("--chunks", default="default,128")
    args = ap.parse_args(argv)

    cfg = model_config(args.model, args.quick_width)
    types = tuple(cfg.layer_types[i % len(cfg.layer_types)] for i in range(args.layers)) if cfg.layer_types else ()
    cfg = dataclasses.replace(cfg, num_layers=args.layers, layer_types=types)
    params = random_int4_params(cfg, 0, True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, args.max_len - 80)]
    out = {
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "commit": args.commit,
        "model": args.model,
        "quick_width": args.quick_width,
        "layers": args.layers,
        "max_len": args.max_len,
        "prompt_len": len(prompt),
        "runs": {},
    }
    for name in args.chunks.split(","):
        chunk = default_prefill_chunk(args.max_len) if name == "default" else int(name)
        run = out["runs"][name] = {"prefill_chunk": chunk, "chunk_shapes": list(chunk_sizes(chunk))}
        for label, drafter in (("greedy", None), ("mtp k=3", MTPDrafter())):
            run[label] = first_call_s(params, cfg, args.max_len, prompt, chunk, drafter)
            print(f"prefill_chunk {chunk} {run['chunk_shapes']}: {label} first call {run[label]:.1f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
