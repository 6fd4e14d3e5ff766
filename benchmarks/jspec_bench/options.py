"""The command line of `jspec bench`: `Options` (every knob, with the full-run defaults), `parse_args` (the flags, the
`--quick` preset for the CPU smoke run, and the checks of the values given)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import jspec_bench
from jspec_bench.e2e import E2E_CONFIGS
from jspec_bench.sections import SECTIONS
from jspec_bench.shapes import ALL_MODELS, SHAPES
from pallas_kernels import ROW_TILE


@dataclasses.dataclass
class Options:
    quick: bool = False
    models: tuple[str, ...] = ALL_MODELS
    sections: tuple[str, ...] = SECTIONS
    out: str = "benchmarks/results/bench.json"
    plots: str | None = None
    budget_s: float | None = None
    commit: str | None = None
    peer_hf: bool = False
    ks: tuple[int, ...] = (1, 3, 7, 15)
    other_ks: tuple[int, ...] = (7,)
    k: int = 7  # draft length of the end-to-end section
    e2e_configs: tuple[str, ...] = tuple(c[0] for c in E2E_CONFIGS)
    e2e_model: str = "llama-3-8b"
    peer_model: str = "qwen2.5-7b"
    context: int = 384  # cache position of the timed steps (prompt 256 + 128 new tokens)
    prompt_len: int = 128  # the random part P of the echo prompts
    new_tokens: int = 128
    peer_new_tokens: int = 64
    insert_periods: tuple[int, ...] = (1, 2, 3, 4, 6)
    repeats: int = 2  # end-to-end runs per (prompt, configuration); the median is reported
    reps: int = 20  # step calls per timing trial
    trials: int = 5
    warmup_s: float = 0.5  # seconds of untimed step calls before a step's trials (at least one call)
    roofline_bytes: int = 2 << 30
    lm_head: str = "int4"
    o_factor: float = 0.0
    compile_threads: int = 4
    prepare: str = "auto"  # int4 preparation of the timed weights: auto (Engine's default), on, off
    seed: int = 0
    prefill_models: tuple[str, ...] = ("llama-3-8b", "qwen2.5-14b")
    prefill_lengths: tuple[int, ...] = (512, 2048, 8192, 32768)
    prefill_chunks: tuple[int, ...] = (256, 512, 1024, 2048)  # the chunk sweep (first prefill model)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)  # the batch section's greedy batch sizes
    chunk_sweep_length: int = 8192
    long_prompt: int = 16384  # the echo prompt of the long-prompt speculation (0: skip)
    sampling_temperature: float = 0.7
    draft_model: str = "llama-3.2-1b"  # the draft_model section's drafter (a SHAPES name)
    draft_k: int = 4
    hybrid_steps: bool = True  # the hybrid section's step and recurrent-kernel measurements (False: its e2e alone)
    int4_wide_min_steps: int | None = None  # A/B of `int4_ws.config_for`'s crossover (None: the library's)

    @property
    def prepare_arg(self) -> bool | None:
        """`prepare` as Engine's argument (None: its default)."""
        return None if self.prepare == "auto" else self.prepare == "on"


def parse_args(argv: list[str] | None) -> tuple[Options, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="jspec bench", description=jspec_bench.__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on tiny shrunk shapes (CI): not performance")
    ap.add_argument("--models", help=f"comma list, subset of {','.join(ALL_MODELS)}")
    ap.add_argument("--sections", help=f"comma list in priority order, subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", help="results JSON path (default benchmarks/results/bench.json)")
    ap.add_argument("--plots", help="directory for the PNG plots (needs matplotlib)")
    ap.add_argument("--budget-s", type=float, help="wall-clock budget; sections past it are skipped and recorded")
    ap.add_argument("--commit", help="git commit of the code under test (default: git rev-parse HEAD if possible)")
    ap.add_argument("--peer-hf", action="store_true", help="run the HuggingFace transformers peer section")
    ap.add_argument("--ks", help="verify draft lengths of the steps section (default 1,3,7,15)")
    ap.add_argument("--k", type=int, help="draft length of the end-to-end section (default 7)")
    ap.add_argument("--e2e-configs", help="comma list of end-to-end configurations (default: all)")
    ap.add_argument("--new-tokens", type=int, help="new tokens per end-to-end run (default 128)")
    ap.add_argument("--repeats", type=int, help="end-to-end runs per configuration and prompt (default 2, median)")
    ap.add_argument("--lm-head", choices=["int4", "bf16"], help="lm_head format of the random models (default int4)")
    ap.add_argument("--o-factor", type=float, help="e2e: attention output scale (default 0: Markov model)")
    ap.add_argument("--compile-threads", type=int, help="executables compiled concurrently (default 4)")
    ap.add_argument(
        "--prepare",
        choices=["auto", "on", "off"],
        help="one-time int4 preparation of the timed weights (default auto: what Engine does by default)",
    )
    ap.add_argument(
        "--prefill-models", help="comma list: the prefill section's models (default llama-3-8b,qwen2.5-14b)"
    )
    ap.add_argument("--prefill-lengths", help="comma list of prompt lengths (default 512,2048,8192,32768)")
    ap.add_argument("--prefill-chunks", help="comma list: chunk sizes of the sweep (default 256,512,1024,2048)")
    ap.add_argument("--batch-sizes", help="comma list: the batch section's greedy batch sizes (default 1,4,16,64)")
    ap.add_argument("--long-prompt", type=int, help="tokens of the long echo prompt (default 16384; 0: skip)")
    ap.add_argument("--sampling-temperature", type=float, help="the sampling section's temperature (default 0.7)")
    ap.add_argument("--draft-model", choices=sorted(SHAPES), help="the draft_model section's drafter (llama-3.2-1b)")
    ap.add_argument("--draft-k", type=int, help="the draft_model section's draft length (default 4)")
    ap.add_argument(
        "--hybrid-e2e-only",
        action="store_true",
        help="hybrid: the last model's end-to-end runs alone, without its step measurements",
    )
    ap.add_argument(
        "--int4-wide-min-steps",
        type=int,
        metavar="N",
        help="A/B only: int4 256-row tiles from N pipeline steps a CTA (default: int4_ws.WIDE_MIN_STEPS)",
    )
    ap.add_argument("--readme-table", metavar="RESULTS.json", help="print the README markdown table of a results JSON")
    ap.add_argument("--replot", metavar="RESULTS.json", help="draw the plots of a results JSON into --plots")
    args = ap.parse_args(argv)
    opts = Options()
    if args.quick:
        opts = dataclasses.replace(
            opts,
            quick=True,
            models=("llama-3-8b", "glm-4-9b", "qwen3.5"),
            out=os.path.join(tempfile.gettempdir(), "jspec_bench_quick.json"),
            ks=(3,),
            other_ks=(3,),
            e2e_configs=("greedy/host", "lookup+gate/host", "greedy/device", "lookup/device", "greedy/host-per-round"),
            context=40,
            prompt_len=16,
            new_tokens=16,
            peer_new_tokens=12,
            insert_periods=(1, 3),
            repeats=1,
            reps=2,
            trials=2,
            warmup_s=0.0,
            roofline_bytes=8 << 20,
            compile_threads=2,
            prefill_models=("llama-3-8b",),
            prefill_lengths=(40, 100),
            prefill_chunks=(16, 64),
            chunk_sweep_length=100,
            long_prompt=120,
            batch_sizes=(1, 4),
        )
    if args.models:
        opts.models = _names(args.models, ALL_MODELS, "--models")
    if args.sections:
        opts.sections = _names(args.sections, SECTIONS, "--sections")
    fields = ("out", "plots", "budget_s", "commit", "k", "new_tokens", "repeats", "lm_head", "o_factor", "prepare",
              "long_prompt", "sampling_temperature", "draft_model", "draft_k", "int4_wide_min_steps")  # fmt: skip
    for field in (*fields, "compile_threads"):
        value = getattr(args, field)
        if value is not None:
            setattr(opts, field, value)
    opts.peer_hf = args.peer_hf
    opts.hybrid_steps = not args.hybrid_e2e_only
    if args.ks:
        try:
            opts.ks = tuple(int(k) for k in args.ks.split(","))
        except ValueError:
            raise SystemExit(f"jspec bench: --ks {args.ks!r}: expected a comma list of integers like 1,3,7") from None
    if args.prefill_models:
        opts.prefill_models = _names(args.prefill_models, ALL_MODELS[:4], "--prefill-models")
    for flag in ("prefill_lengths", "prefill_chunks", "batch_sizes"):
        text = getattr(args, flag)
        if text:
            try:
                values = tuple(int(x) for x in text.split(","))
            except ValueError:
                raise SystemExit(f"jspec bench: --{flag.replace('_', '-')} {text!r}: expected integers") from None
            if min(values) < 1:
                raise SystemExit(f"jspec bench: --{flag.replace('_', '-')} {text!r}: must be >= 1")
            setattr(opts, flag, values)
    if args.e2e_configs:
        opts.e2e_configs = _names(args.e2e_configs, tuple(c[0] for c in E2E_CONFIGS), "--e2e-configs")
    if "greedy/host" not in opts.e2e_configs:
        raise SystemExit("jspec bench: --e2e-configs must include greedy/host (the identity reference)")
    for k in (*opts.ks, *opts.other_ks, opts.k, opts.draft_k):
        if not 1 <= k <= ROW_TILE - 1:
            raise SystemExit(f"jspec bench: draft length k={k} out of range 1..{ROW_TILE - 1}")
    if opts.int4_wide_min_steps is not None and opts.int4_wide_min_steps < 1:
        raise SystemExit(f"jspec bench: --int4-wide-min-steps {opts.int4_wide_min_steps}: must be >= 1")
    if opts.compile_threads < 1 or opts.repeats < 1 or opts.new_tokens < 2:
        raise SystemExit("jspec bench: --compile-threads and --repeats must be >= 1, --new-tokens >= 2")
    return opts, args


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"jspec bench: {flag} {text!r}: unknown {bad}; choose from {','.join(allowed)}")
    return names
