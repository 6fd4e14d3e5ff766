"""XLA's options and the Engine: time to first token and decode tok/s of the Engine compiled with the shipped
options against variants (XLA's autotuner on; cuBLAS outside the CUDA graphs), one process, interleaved.

Why the Engine compiles with XLA's autotuner off and its products on cuBLAS: prefill's products (and the Gated
DeltaNet chunked recurrence's float32 dots) are XLA's own, and with autotuning on XLA picks their Triton tiling or
cuBLAS algorithm by timing them when it compiles, so the same prompt can leave different prefill bits, and so
different tokens, from one process to the next (`prefill_determinism.py`; docs/exactness.md). Decode and verify run
jspec's own kernels for every product.

Per model (random int4 at a bench shape, `jspec_bench.shapes`): one Engine per variant (`VARIANTS`, added to
`jspec.compiler_options()`) over the same params, its compile (first call) seconds; then `--repeats` rounds, each
running every variant (the order reversed every other round) on a `--prompt`-token prompt: time to first token
(`generate(prompt, 1)`), the decode tok/s of `generate(prompt, new)` excluding its prefill (new - 1 tokens over the
wall minus that round's time to first token), and the greedy tokens' digest.

Runs on the H100, a 4096-token prompt, each commit's own shipped options (the variants in today's names):
experiments/results/autotune_cost_qwen35_h100.json and ..._llama3_8b_h100.json (d44e48b, which shipped level 0
alone, against level 4: autotune0_triton against autotuned): time to first token 7.6x (Qwen3.5) and 10.7x
(Llama-3-8B) longer, decode the same (0.98x, 1.01x); experiments/results/autotune_cost_cublas_qwen35_h100.json
(eab233c, which shipped XLA's defaults, against level 0 with cuBLAS: autotuned against today's shipped): time to
first token 0.256 against 0.244 s, decode 281 against 282 tok/s, the same tokens;
experiments/results/autotune_cost_cublas_both_h100.json (a1e3072, both models, autotuned against shipped): time to
first token 0.154 against 0.146 s (Llama-3-8B) and 0.249 against 0.239 s (Qwen3.5), decode 310 / 308 and 291 / 293
tok/s, the same tokens; experiments/results/autotune_cost_cublas_both_rerun_h100.json (09f1982, the same): 0.151
against 0.144 s and 0.250 against 0.242 s, decode 317 / 316 and 294 / 294 tok/s, the same tokens.

Other options the same way: "no_blas_graphs" (cuBLAS calls outside the CUDA graphs; the Llama-3-8B generation's token
-5% in `sustained_load.py`'s gentime_modes run), with --on-device to time the Engine's on-device loop, where it
matters (the host loop's decode steps hold no cuBLAS call); --block N runs N calls of a variant back to back at each
turn (a user's loop calling one engine again and again) and reports the calls after each block's first apart.
experiments/results/autotune_cost_no_blas_graphs_h100.json (caba81a), ..._blocked_h100.json (d8ab82b, --block 4)
and ..._ttft_h100.json (caba81a, a 4096-token prompt, Llama-3-8B only): decode 0.993x / 0.994x (Llama-3-8B, 344 tok/s
shipped) and 1.001x / 1.002x (Qwen3.5, 320 tok/s), the time to first token 1.01-1.04x and 1.08-1.09x, the same
tokens: nothing end to end, so not shipped. The same for "host_while" (no WHILE / CONDITIONAL command buffers;
..._host_while_h100.json, 9399049: 0.986x, 0.992x) and for the prefill chunk (ENGINE_VARIANTS, chunks of 128 / 256
against the short engine's one chunk of 480; ..._prefill_chunk_h100.json, b64fe5d: decode 1.001-1.007x, time to first
token 1.2-1.9x longer, other greedy tokens). And for "dsf_verify" (the prefill's dynamic-slice copies on the main
stream, which takes `sustained_load.py`'s own jit of the generation from 2.92-2.96 to 2.77 ms a token): the Engine's
on-device decode 0.999x (Qwen3.5, 340 tok/s) and 1.003x (Llama-3-8B, 359), with 128-token chunks ("chunk128" against
"chunk128+dsf_verify") 1.000x, the same tokens (..._dsf_verify_h100.json, fc8e3fd; ..._chunk128_dsf_verify_h100.json,
5a2a104; the commands in benchmarks/README.md). That A/B is one process, and a variant's state carries to the
others': the shipped engine's first run (its prefill's async copies) slowed every later step of the process, the
variant's too; alone in fresh processes the Engine ran 2.95 against 2.75 ms a token and the option ships
(sustained_load.py's engine runs, docs/performance.md). Time A/Bs of process-wide options in separate processes.

    python3 benchmarks/experiments/autotune_cost.py --variants autotuned --commit SHA --out $OUT/autotune_cost_h200.json
    python3 benchmarks/experiments/autotune_cost.py --models llama-3-8b,qwen3.5 --variants no_blas_graphs --on-device \
        --prompt 320 --new 129 --repeats 4 --block 4 --commit SHA --out $OUT/no_blas_graphs_h200.json
    python3 benchmarks/experiments/autotune_cost.py --quick --out /tmp/autotune_cost_cpu.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: jspec_bench

import numpy as np  # noqa: E402
from device_loop_profile import DYNAMIC_SLICE_OPTIONS, without_command_buffers  # noqa: E402

import jspec  # noqa: E402
from jspec import engine as engine_module  # noqa: E402
from jspec_bench.report import bits_digest, experiment_meta, save_experiment  # noqa: E402
from jspec_bench.shapes import model_config, random_int4_params  # noqa: E402

VARIANTS = {  # added to the shipped GPU options (level 0, cuBLAS: jspec.engine.GPU_COMPILER_OPTIONS)
    "shipped": {},
    "autotuned": {"xla_gpu_autotune_level": 4, "xla_gpu_enable_triton_gemm": True},  # XLA's defaults
    "autotune0_triton": {"xla_gpu_enable_triton_gemm": True},  # XLA's default Triton tiling for every product
    # cuBLAS / cuBLASLt calls (the prefill's products, the chunked recurrence's) outside the CUDA graphs: launched
    # from the host, so a loop holding them is no WHILE command buffer either (sustained_load_gentime_modes_*.json)
    "no_blas_graphs": without_command_buffers("CUBLAS", "CUBLASLT"),
    # no WHILE / CONDITIONAL command buffers: the host drives the executable's loops, each body still a CUDA graph
    "host_while": without_command_buffers("WHILE", "CONDITIONAL"),
    **DYNAMIC_SLICE_OPTIONS,  # async_dsf, no_dsf, dsf_verify: the prefill's dynamic-slice copies
}

ENGINE_VARIANTS = {  # the shipped options with other Engine arguments (default: one prefill chunk for a short engine)
    "chunk128": dict(prefill_chunk=128),
    "chunk256": dict(prefill_chunk=256),
}

CHOICES = [*VARIANTS, *ENGINE_VARIANTS][1:]  # what --variants takes ("shipped" always runs), or several joined by "+"


def variant_parts(variant: str) -> tuple[dict, dict]:
    """(Engine arguments, XLA options added to the shipped) of a variant: one of CHOICES, or several joined by "+"
    (e.g. "chunk128+dsf_verify"), their arguments and options merged."""
    kwargs, options = {}, {}
    for part in variant.split("+"):
        kwargs |= ENGINE_VARIANTS.get(part, {})
        options |= VARIANTS.get(part, {})
    return kwargs, options


@contextlib.contextmanager
def gpu_options(extra: dict):
    """The Engine's GPU compiler options with `extra` on top while the block compiles."""
    saved = dict(engine_module.GPU_COMPILER_OPTIONS)
    engine_module.GPU_COMPILER_OPTIONS.update(extra)
    try:
        yield
    finally:
        engine_module.GPU_COMPILER_OPTIONS.clear()
        engine_module.GPU_COMPILER_OPTIONS.update(saved)


def measure(name: str, args) -> dict:
    cfg = model_config(name, args.quick)
    params = random_int4_params(cfg, 0, True)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, args.prompt).astype(np.int32)
    engines, out = {}, {"variants": {}}
    variants = ["shipped", *args.variants]
    for variant in variants:
        kwargs, options = variant_parts(variant)
        engines[variant] = jspec.Engine(params, cfg, max_len=args.prompt + args.new + 16, **kwargs)
        with gpu_options(options):
            t0 = time.perf_counter()
            engines[variant].generate(prompt, args.new, eos_id=(), on_device=args.on_device)  # compiles every part
            compiled_s = time.perf_counter() - t0
        out["variants"][variant] = dict(
            compile_and_first_call_s=compiled_s, prefill_chunk=engines[variant].prefill_chunk, trials=[]
        )
        print(name, variant, f"compile + first call {compiled_s:.1f} s")
    for r in range(args.repeats):
        for variant in variants[:: 1 if r % 2 == 0 else -1]:
            engine = engines[variant]
            for in_block in range(args.block):
                t0 = time.perf_counter()
                engine.generate(prompt, 1, eos_id=(), on_device=args.on_device)
                ttft = time.perf_counter() - t0
                t0 = time.perf_counter()
                tokens = engine.generate(prompt, args.new, eos_id=(), on_device=args.on_device).tokens
                decode_s = time.perf_counter() - t0 - ttft
                trial = dict(ttft_s=ttft, decode_tok_s=(args.new - 1) / decode_s, tokens=bits_digest(np.int32(tokens)))
                out["variants"][variant]["trials"].append(dict(trial, round=r, in_block=in_block))
    for variant, v in out["variants"].items():
        v["ttft_s"] = statistics.median(t["ttft_s"] for t in v["trials"])
        v["decode_tok_s"] = statistics.median(t["decode_tok_s"] for t in v["trials"])
        if args.block > 1:  # the calls after a block's first: an engine called again and again, as a user's loop does
            v["decode_tok_s_repeated"] = statistics.median(t["decode_tok_s"] for t in v["trials"] if t["in_block"])
        v["deterministic_in_process"] = len({t["tokens"] for t in v["trials"]}) == 1
        print(name, variant, {k: v[k] for k in ("ttft_s", "decode_tok_s", "decode_tok_s_repeated") if k in v})
    shipped = out["variants"]["shipped"]
    out["vs_shipped"] = {
        variant: dict(
            ttft=v["ttft_s"] / shipped["ttft_s"],
            decode_tok_s=v["decode_tok_s"] / shipped["decode_tok_s"],
            **(
                {"decode_tok_s_repeated": v["decode_tok_s_repeated"] / shipped["decode_tok_s_repeated"]}
                if args.block > 1
                else {}
            ),
            same_tokens=v["trials"][0]["tokens"] == shipped["trials"][0]["tokens"],
        )
        for variant, v in out["variants"].items()
        if variant != "shipped"
    }
    print(name, "against shipped", out["vs_shipped"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--models", default="qwen3.5,llama-3-8b")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new", type=int, default=65, help="new tokens of the decode timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--variants", default="autotuned,autotune0_triton", help=f"comma list of {CHOICES} (or several joined by +)"
    )
    ap.add_argument("--on-device", action="store_true", help="time the on-device loop (default: the host loop)")
    ap.add_argument(
        "--block", type=int, default=1, help="trials a variant runs back to back at each turn (1: interleaved)"
    )
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: the tiny shrunk shapes")
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    if unknown := {part for v in args.variants for part in v.split("+")} - set(CHOICES):
        ap.error(f"unknown variants {sorted(unknown)}: pick from {CHOICES}")
    if args.block < 1:
        ap.error(f"--block takes a positive count of calls, not {args.block}")
    if args.quick:
        args.prompt, args.new, args.repeats = 40, 5, 2
    t0 = time.perf_counter()
    meta = dict(prompt=args.prompt, new=args.new, on_device=args.on_device, block=args.block)
    out = dict(meta=experiment_meta(args.commit, **meta))
    out["models"] = {}
    for name in args.models.split(","):
        out["models"][name] = measure(name, args)
        save_experiment(out, args.out, t0)


if __name__ == "__main__":
    main()
