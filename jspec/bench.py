"""`jspec bench`: what jspec buys on a GPU — step costs against the HBM roofline, end-to-end speedup against
acceptance with byte-identity checked in every run, and the HuggingFace peer side by side (issue 7, DESIGN 5).

Sections, in priority order; each checks the remaining `--budget-s` before it starts (and before each model or
sub-step), and whatever is skipped is recorded in the JSON with the reason:
  roofline     HBM read bandwidth: the best of torch `x.sum()` and XLA `jnp.sum` over a 2 GB bf16 array.
  steps        decode_step and verify_step (k = 1, 3, 7, 15) at the Qwen2.5-14B and Llama-3-8B shapes: time (median
               over trials of back-to-back calls of a jitted step with donated state), bytes read, % of the roofline,
               verify/decode ratio (= the break-even mean_accepted), compiles, and a bitwise check that verify row i
               equals the decode step at position + i.
  e2e          Engine tok/s at the Llama-3-8B shape: greedy vs PromptLookup (gate on and off; host loop and on-device
               loop) on echo prompts (see `echo_prompt`) whose echo pattern sets the acceptance from ~1 to ~k + 1
               tokens per verify; every run's tokens are compared with plain greedy.
  other_steps  decode_step and verify_step (k = 7) at the other shapes: Qwen2.5-7B, GLM-4-9B, the bundled demo model.
  peer         (--peer-hf) HuggingFace transformers, bf16 eager (greedy timed with a static cache),
               `prompt_lookup_num_tokens`, at the Qwen2.5-7B shape: tok/s, and whether its prompt-lookup output
               equals its own greedy output on the same (dynamic) cache.

Weights are random (no downloads): `jspec.models.dense.init_params` in bf16, every linear weight (and by default the
lm_head) quantized to int4 on the device with `pallas_kernels.quantize`. Values do not change the cost of a step. For
the end-to-end section the attention output projection is scaled by `--o-factor` (default 0: zeroed), which makes the
random model Markov: its next token is a function of the last token, so an echo prompt makes it repeat its own
continuation and the prompt sets the prompt-lookup acceptance. Attention still runs at full cost (its weights are
runtime values). The steps section uses the unscaled weights, so its bitwise verify-vs-decode check exercises the
attention kernel fully.

Exit status: 0; 1 when any identity check failed (speculative tokens differ from greedy, or verify rows differ from
decode rows in any bit); 2 when a section raised (its error is in the JSON; the other sections still ran).
`--readme-table RESULTS.json` prints the README's markdown table; `--replot RESULTS.json --plots DIR` redraws plots.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.drafters import PromptLookup
from jspec.engine import ROUNDS_PER_CALL, Engine, compiler_options, prepare_params, resolve_prepare
from jspec.exactness import forced_decode_logits, mismatched_rows
from jspec.gate import HitDensityGate
from jspec.models import dense, quantize_linears
from jspec.state import init_state, physical_length
from jspec.stats import common_prefix
from jspec.steps import commit, decode_step, verify_step
from pallas_kernels import ROW_TILE, Int4Codes, Int4Halves, Int4Weight, get_backend, quantize

SCHEMA = 1
SECTIONS = ("roofline", "steps", "e2e", "other_steps", "peer")

# Shapes typed in from the models' HuggingFace config.json files (no downloads).
SHAPES: dict[str, dict] = {
    "qwen2.5-14b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "glm-4-9b": dict(  # GLM-4-9B-0414 (Glm4ForCausalLM)
        model_type="glm4",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=13696,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=True,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
}
# Quick mode (CPU, CI): every shape shrunk to this size, family features (bias, rope layout, post norms) kept.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)

STEP_MODELS = ("qwen2.5-14b", "llama-3-8b")
OTHER_MODELS = ("qwen2.5-7b", "glm-4-9b", "demo")
ALL_MODELS = STEP_MODELS + OTHER_MODELS

# External references measured on this H200 (DESIGN 5), quoted, not measured by this bench.
REFERENCES = {
    "gpt_fast_int4_g32_llama3_8b_tok_s": 228.8,
    "gpt_fast_bf16_llama3_8b_tok_s": 172.3,
    "hf_transformers_bf16_eager_qwen2.5_7b_tok_s": 16.8,
    "earlier_engine_qwen2.5_14b_decode_ms": 7.9,
}
TARGETS = {  # DESIGN 5 / issue 7
    "decode_roofline_14b": 0.55,
    "verify7_over_decode": 1.25,
    "speedup_at_mean_accepted_3": 2.0,
    "gate_no_hit_vs_greedy": 0.97,
    "greedy_tok_s_llama3_8b": 460.0,
}


E2E_CONFIGS = (  # (label, drafter?, gate?, on_device, host-loop rounds per device call), in priority order
    ("greedy/host", False, False, False, ROUNDS_PER_CALL),
    ("lookup/host", True, False, False, ROUNDS_PER_CALL),
    ("lookup+gate/host", True, True, False, ROUNDS_PER_CALL),
    ("greedy/device", False, False, True, ROUNDS_PER_CALL),
    ("lookup+gate/device", True, True, True, ROUNDS_PER_CALL),
    ("lookup/device", True, False, True, ROUNDS_PER_CALL),
    ("greedy/host-per-round", False, False, False, 1),  # the host loop syncing after every round
)


# --------------------------------------------------------------------------------------------------- options
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

    @property
    def prepare_arg(self) -> bool | None:
        """`prepare` as Engine's argument (None: its default)."""
        return None if self.prepare == "auto" else self.prepare == "on"


def parse_args(argv: list[str] | None) -> tuple[Options, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="jspec bench", description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--readme-table", metavar="RESULTS.json", help="print the README markdown table of a results JSON")
    ap.add_argument("--replot", metavar="RESULTS.json", help="draw the plots of a results JSON into --plots")
    args = ap.parse_args(argv)
    opts = Options()
    if args.quick:
        opts = dataclasses.replace(
            opts,
            quick=True,
            models=("llama-3-8b", "glm-4-9b"),
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
        )
    if args.models:
        opts.models = _names(args.models, ALL_MODELS, "--models")
    if args.sections:
        opts.sections = _names(args.sections, SECTIONS, "--sections")
    fields = ("out", "plots", "budget_s", "commit", "k", "new_tokens", "repeats", "lm_head", "o_factor", "prepare")
    for field in (*fields, "compile_threads"):
        value = getattr(args, field)
        if value is not None:
            setattr(opts, field, value)
    opts.peer_hf = args.peer_hf
    if args.ks:
        try:
            opts.ks = tuple(int(k) for k in args.ks.split(","))
        except ValueError:
            raise SystemExit(f"jspec bench: --ks {args.ks!r}: expected a comma list of integers like 1,3,7") from None
    if args.e2e_configs:
        opts.e2e_configs = _names(args.e2e_configs, tuple(c[0] for c in E2E_CONFIGS), "--e2e-configs")
    if "greedy/host" not in opts.e2e_configs:
        raise SystemExit("jspec bench: --e2e-configs must include greedy/host (the identity reference)")
    for k in (*opts.ks, *opts.other_ks, opts.k):
        if not 1 <= k <= ROW_TILE - 1:
            raise SystemExit(f"jspec bench: draft length k={k} out of range 1..{ROW_TILE - 1}")
    if opts.compile_threads < 1 or opts.repeats < 1 or opts.new_tokens < 2:
        raise SystemExit("jspec bench: --compile-threads and --repeats must be >= 1, --new-tokens >= 2")
    return opts, args


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"jspec bench: {flag} {text!r}: unknown {bad}; choose from {','.join(allowed)}")
    return names


# ---------------------------------------------------------------------------------------------------- report
class Budget:
    """Wall-clock budget from the start of the run (None: unlimited)."""

    def __init__(self, total_s: float | None):
        self.total_s = total_s
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return float("inf") if self.total_s is None else self.total_s - self.elapsed()

    def why_not(self, estimate_s: float, what: str) -> str | None:
        """None if `what` (estimated at estimate_s) fits in the remaining budget, else the reason to skip it."""
        left = self.left()
        if estimate_s <= left:
            return None
        return (
            f"budget: {what} estimated {estimate_s:.0f} s, {max(left, 0):.0f} s of --budget-s {self.total_s:.0f} left"
        )


class Report:
    """The results JSON, written atomically after every sub-step (a run cut short keeps what it measured)."""

    def __init__(self, path: str, meta: dict):
        self.path = Path(path)
        self.data = {"schema": SCHEMA, "meta": meta, "sections": {}, "identity": {"ok": True, "checks": 0}}
        self.data["identity"]["failures"] = []
        self.errors = 0

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {"status": "running"})

    def check_identity(self, ok: bool, what: str) -> bool:
        self.data["identity"]["checks"] += 1
        if not ok:
            self.data["identity"]["ok"] = False
            self.data["identity"]["failures"].append(what)
            print(f"IDENTITY FAILURE: {what}", flush=True)
        return ok

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x)}")


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))[-3000:]


class CompileCounter:
    """Counts XLA backend compiles (a jax.monitoring listener) — to show that timed runs compile nothing."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # compiles run on several threads

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration


# ------------------------------------------------------------------------------------------------- helpers
def hf_config_dict(name: str, quick: bool) -> dict:
    """The typed-in HF config of a bench shape (quick: shrunk to TINY, family features kept)."""
    hf = dict(SHAPES[name])
    if quick:
        hf.update(TINY, **TINY_HEADS)
    return hf


def model_config(name: str, quick: bool) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_dict(name, quick))


def random_int4_params(cfg: ModelConfig, seed: int, lm_head_int4: bool) -> dict:
    """Random params on the device: `dense.init_params` (bf16, scale 0.02) with every linear weight (and the lm_head
    when lm_head_int4) quantized to int4 by `pallas_kernels.quantize`.

    Built one layer at a time by two jitted functions (a 1-layer config with a 32-token vocab for the layers, a
    0-layer config for embed / final_norm / lm_head), so only one layer's dense weights exist at a time and the
    compiles do not grow with the depth."""
    key = jax.random.PRNGKey(seed)
    one_layer = dataclasses.replace(cfg, num_layers=1, vocab_size=32)
    no_layers = dataclasses.replace(cfg, num_layers=0)

    @jax.jit
    def layer(key):
        p = dense.init_params(one_layer, key, jnp.bfloat16, scale=0.02)["layers"][0]
        return quantize_linears(p)

    @jax.jit
    def outer(key):
        p = dense.init_params(no_layers, key, jnp.bfloat16, scale=0.02)
        if lm_head_int4 and "lm_head" in p:
            p["lm_head"] = quantize(p["lm_head"])
        return p

    params = outer(jax.random.fold_in(key, cfg.num_layers))
    params["layers"] = [layer(jax.random.fold_in(key, i)) for i in range(cfg.num_layers)]
    return jax.block_until_ready(params)


def scale_attention_output(params: dict, factor: float) -> dict:
    """Dense params whose attention sub-block adds `factor` times its output to the residual stream (factor 0: the
    model is a Markov chain over tokens). Every leaf is shared but the scaled one per layer: the o projection (an
    int4 weight's scales), or, where a post-attention norm follows it (glm4), that norm's weight: the norm would
    undo a scaled o."""

    def scaled(w):
        if isinstance(w, Int4Weight):
            return dataclasses.replace(w, scales=(w.scales.astype(jnp.float32) * factor).astype(jnp.bfloat16))
        return (w.astype(jnp.float32) * factor).astype(w.dtype)

    key = "post_self_attn_norm" if "post_self_attn_norm" in params["layers"][0] else "o"
    layers = [dict(layer, **{key: scaled(layer[key])}) for layer in params["layers"]]
    return dict(params, layers=layers)


def tree_nbytes(tree) -> int:
    """Bytes of a params tree; int4 weights (native or prepared) count their own `nbytes` (jax counts an int4
    array's elements as whole bytes)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (Int4Weight, Int4Codes, Int4Halves)))
    return int(sum(x.nbytes for x in leaves))


def step_bytes(params: dict, cfg, state, rows: int) -> dict:
    """HBM bytes one step reads: every weight but the embedding table (+ one embedding row; the whole table when
    the lm_head is tied), and the cache: KV rows 0..position + rows - 1 of every attention layer (the row tile's
    reach), recurrent states in full. The MTP head is not read by decode/verify."""
    weights = sum(tree_nbytes(v) for key, v in params.items() if key not in ("embed", "mtp"))
    embed = params["embed"]
    weights += embed.nbytes if "lm_head" not in params else cfg.hidden_size * embed.dtype.itemsize

    length = physical_length(state.max_len)
    reach = min(int(state.position) + rows, length)
    cache = 0
    for leaf in jax.tree.leaves(state.cache):
        if leaf.ndim >= 1 and leaf.shape[0] == length:
            cache += reach * (leaf.nbytes // length)
        else:
            cache += leaf.nbytes
    return {"weights": int(weights), "cache": int(cache), "total": int(weights + cache)}


def random_state(cfg, max_len: int, position: int, dtype, seed: int):
    """A DecodeState at `position` with a random cache and random tokens (step timing needs no real prefix)."""
    state = init_state(cfg, max_len, dtype)
    leaves, treedef = jax.tree.flatten(state.cache)
    key = jax.random.PRNGKey(seed)
    filled = [
        (0.5 * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for i, x in enumerate(leaves)
    ]
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, state.tokens.shape), jnp.int32)
    return dataclasses.replace(
        state, cache=jax.tree.unflatten(treedef, filled), tokens=tokens, position=jnp.asarray(position, jnp.int32)
    )


def copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


def run_parallel(tasks: dict[str, Callable], threads: int) -> dict[str, tuple[object, float]]:
    """Run zero-argument callables (compiles, warm-ups) on `threads` threads: {name: (result, seconds)}.

    XLA compiles outside the GIL, so executables compile concurrently. Exceptions propagate."""

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    if threads <= 1 or len(tasks) <= 1:
        return {name: timed(fn) for name, fn in tasks.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as pool:
        futures = {name: pool.submit(timed, fn) for name, fn in tasks.items()}
        return {name: f.result() for name, f in futures.items()}


class CompileEstimator:
    """Predicts an executable's compile time from those measured so far (seconds per layer), for the budget."""

    def __init__(self, prior_s_per_layer: float):
        self.rates: list[float] = []
        self.prior = prior_s_per_layer

    def observe(self, seconds: float, layers: int, weight: float = 1.0) -> None:
        self.rates.append(seconds / (max(layers, 1) * weight))

    def estimate(self, layers: int, weight: float = 1.0) -> float:
        rate = statistics.mean(self.rates) if self.rates else self.prior
        return 2.0 + rate * layers * weight


# ---------------------------------------------------------------------------------------------- sections
@dataclasses.dataclass
class Context:
    opts: Options
    budget: Budget
    report: Report
    compiles: CompileCounter
    estimator: CompileEstimator
    roofline_Bps: float | None = None
    kept: dict = dataclasses.field(default_factory=dict)  # params kept for a later section: name -> (params, cfg)


def section_roofline(ctx: Context, sec: dict) -> None:
    """Best HBM read bandwidth of torch `x.sum()` and XLA `jnp.sum` over a bf16 array of opts.roofline_bytes.

    Each is timed over BATCH back-to-back calls (so host dispatch overlaps), median of 5 such trials."""
    n = ctx.opts.roofline_bytes // 2
    sec["bytes"] = 2 * n
    sec["xla_sum_Bps"] = _xla_sum_Bps(n)
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        sec["torch_sum_Bps"] = _torch_sum_Bps(n, device)
        sec["torch_device"] = device
        sec["torch"] = torch.__version__
        if device == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:  # torch is a reference here, not the product: record and use XLA's number
        sec["torch_error"] = _error_text(e)
    best = max(("xla_sum_Bps", "torch_sum_Bps"), key=lambda k: sec.get(k, 0.0))
    sec["roofline_Bps"] = sec[best]
    sec["best"] = best.removesuffix("_Bps")
    ctx.roofline_Bps = sec["roofline_Bps"]
    print(f"  roofline {sec['roofline_Bps'] / 1e12:.3f} TB/s ({sec['best']}; xla {sec['xla_sum_Bps'] / 1e12:.3f})")


def _xla_sum_Bps(n: int) -> float:
    a = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return 2 * n * BATCH / _median_wall(lambda: jax.block_until_ready([f(a) for _ in range(BATCH)]), 5)


def _torch_sum_Bps(n: int, device: str) -> float:
    import torch

    t = torch.ones(n, dtype=torch.bfloat16, device=device)
    return 2 * n * BATCH / torch_median(lambda: [t.sum() for _ in range(BATCH)], 5, device)


BATCH = 8


def _median_wall(fn: Callable, repeats: int) -> float:
    """Median wall seconds of fn() (which must block) over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_median(fn: Callable, repeats: int, device: str = "cuda", warmup: int = 1) -> float:
    """Median seconds of fn() on the torch device (CUDA events on a GPU), after `warmup` calls.

    The one torch timer of the benchmarks (benchmarks/*.py import it)."""
    import torch

    if device != "cuda":
        return _median_wall(fn, repeats)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _decode(params, state, *, cfg):
    return decode_step(params, cfg, state)


def _verify(params, state, draft, *, cfg):
    return verify_step(params, cfg, state, draft)


# Kernel-name substrings of the GPU time groups a step's kernels are summed into (first match wins; else "XLA ops").
KERNEL_GROUPS = (
    ("int4 Mosaic GPU", ("int4_ws",)),
    ("int4 Triton", ("int4_rows", "dense_rows")),
    ("attention", ("jspec_attention",)),
    ("recurrent", ("jspec_gdn",)),
)


def kernel_times(profile, calls: int) -> dict:
    """GPU kernel time per call from a `jax.profiler.ProfileData` of `calls` calls: every kernel event on the GPU
    planes' stream lines, summed by name and by `KERNEL_GROUPS` group, in microseconds per call."""
    by_name: dict[str, float] = {}
    launches = 0
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                by_name[event.name] = by_name.get(event.name, 0.0) + event.duration_ns / 1e3 / calls
                launches += 1
    groups: dict[str, float] = {}
    for name, us in by_name.items():
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "XLA ops")
        groups[group] = groups.get(group, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "kernel_us": round(sum(by_name.values()), 1),
        "launches": launches // calls,
        "groups_us": {g: round(us, 1) for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels_us": {name[:80]: round(us, 1) for name, us in top},
    }


def profile(run: Callable[[], None]):
    """A `jax.profiler.ProfileData` of what run() does (an XLA profiler trace in a temporary directory)."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        (path,) = Path(log_dir).rglob("*.xplane.pb")
        return jax.profiler.ProfileData.from_file(str(path))


def _time_chain(fn, params, state, extra: tuple, reps: int, trials: int, warmup_s: float):
    """Seconds per call of state, out = fn(params, state, *extra) chained (state donated): median over trials of
    `reps` back-to-back calls, after `warmup_s` seconds of untimed calls (at least one: on the H200 the first timed
    trials of a step ran up to 30% slow after a single warm-up call, KERNEL_NOTES). Returns (median, all trial
    times, the GPU kernel times of 3 more calls under the XLA profiler (`kernel_times`; None off the GPU))."""
    end = time.perf_counter() + warmup_s
    while True:
        state, out = fn(params, state, *extra)
        jax.block_until_ready(out)
        if time.perf_counter() >= end:
            break
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            state, out = fn(params, state, *extra)
        jax.block_until_ready((state, out))
        times.append((time.perf_counter() - t0) / reps)
    kernels = None
    if jax.default_backend() == "gpu":

        def three_calls():
            nonlocal state, out
            for _ in range(3):
                state, out = fn(params, state, *extra)
            jax.block_until_ready((state, out))

        try:
            kernels = kernel_times(profile(three_calls), 3)
        except Exception as e:  # the profiler is an add-on (another tool may hold CUPTI): record why, keep the timing
            kernels = {"error": _error_text(e)}
    return statistics.median(times), times, kernels


def measure_steps(ctx: Context, name: str, params: dict, cfg: ModelConfig, ks: tuple[int, ...], entry: dict) -> None:
    """decode_step and verify_step(k) costs of one model at position opts.context, and the bitwise check; with
    prepared int4 weights (--prepare) also the decode step on the weights as loaded, for the ratio."""
    opts = ctx.opts
    dtype = jnp.dtype(params["embed"].dtype).name
    prepared = resolve_prepare(opts.prepare_arg, params, dtype, get_backend())
    entry["prepared"] = prepared
    raw, params = params, prepare_params(params, dtype, get_backend()) if prepared else params
    max_len = opts.context + 2 * ROW_TILE
    base = random_state(cfg, max_len, opts.context, params["embed"].dtype, opts.seed + 1)
    rng = np.random.default_rng(opts.seed + 2)
    drafts = {k: rng.integers(0, cfg.vocab_size, (k,)).astype(np.int32) for k in ks}
    t0 = time.perf_counter()
    lowered = {"decode": jax.jit(functools.partial(_decode, cfg=cfg), donate_argnums=1).lower(params, base)}
    for k in ks:
        fn = jax.jit(functools.partial(_verify, cfg=cfg), donate_argnums=1)
        lowered[f"verify{k}"] = fn.lower(params, base, jnp.asarray(drafts[k]))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    lowered["commit"] = jax.jit(commit, donate_argnums=0).lower(base, scalar, scalar)
    if prepared:
        lowered["decode_unprepared"] = jax.jit(functools.partial(_decode, cfg=cfg), donate_argnums=1).lower(raw, base)
    entry["lower_s"] = time.perf_counter() - t0
    before = ctx.compiles.count
    options = compiler_options()  # what an Engine compiles with
    built = run_parallel(
        {key: functools.partial(low.compile, compiler_options=options) for key, low in lowered.items()},
        opts.compile_threads,
    )
    entry["executables"] = list(lowered)
    entry["num_compiles"] = ctx.compiles.count - before  # backend compiles (an identical program may be cached)
    entry["compile_s"] = {key: seconds for key, (_, seconds) in built.items()}
    for key, seconds in entry["compile_s"].items():
        if key != "commit":
            ctx.estimator.observe(seconds + entry["lower_s"] / len(lowered), cfg.num_layers)
    execs = {key: ex for key, (ex, _) in built.items()}
    slowest = max(entry["compile_s"].values())
    print(f"  {name}: lowered in {entry['lower_s']:.1f} s, {len(built)} executables compiled (slowest {slowest:.1f} s)")
    roof = ctx.roofline_Bps
    entry.update(context=opts.context, roofline_Bps=roof, compiles_during_timing=0)
    nbytes = step_bytes(params, cfg, base, ROW_TILE)  # decode and verify run the same row tile: same bytes

    def timed(exec_, extra: tuple, weights=params) -> dict:
        state = copy_tree(base)
        count = ctx.compiles.count
        seconds, times, kernels = _time_chain(exec_, weights, state, extra, opts.reps, opts.trials, opts.warmup_s)
        entry["compiles_during_timing"] += ctx.compiles.count - count
        read = nbytes if weights is params else step_bytes(weights, cfg, base, ROW_TILE)
        out = {"time_s": seconds, "trial_times_s": times, "bytes": read, "achieved_Bps": read["total"] / seconds}
        if kernels:
            out["gpu_kernels"] = kernels
        if roof:
            out["roofline_fraction"] = read["total"] / seconds / roof
            out["roofline_time_s"] = read["total"] / roof
        return out

    entry["decode"] = timed(execs["decode"], ())
    decode_s = entry["decode"]["time_s"]
    print(f"  {name} decode {decode_s * 1e3:.3f} ms {_pct(entry['decode'])}{_kernels(entry['decode'])}", flush=True)
    if prepared:
        raw_entry = entry["decode_unprepared"] = timed(execs["decode_unprepared"], (), raw)
        raw_entry["prepared_speedup"] = raw_entry["time_s"] / decode_s
        print(f"  {name} decode on unprepared weights {raw_entry['time_s'] * 1e3:.3f} ms {_pct(raw_entry)}")
    entry["verify"] = {}
    for k in ks:
        v = timed(execs[f"verify{k}"], (jnp.asarray(drafts[k]),))
        v["ratio_vs_decode"] = v["time_s"] / decode_s
        v["break_even_mean_accepted"] = v["ratio_vs_decode"]
        v.update(_bitwise_check(params, execs, k, base, drafts[k]))
        ctx.report.check_identity(v["bitwise_equal_decode"], f"steps/{name}: verify(k={k}) rows != decode rows")
        entry["verify"][str(k)] = v
        print(
            f"  {name} verify k={k} {v['time_s'] * 1e3:.3f} ms ({v['ratio_vs_decode']:.3f}x decode) "
            f"{_pct(v)} bitwise {'equal' if v['bitwise_equal_decode'] else 'DIFFERENT'}{_kernels(v)}",
            flush=True,
        )
        ctx.report.save()


def _kernels(r: dict) -> str:
    """', GPU kernels X ms (group Y, ...)' from a timed step's `gpu_kernels` (empty off the GPU)."""
    k = r.get("gpu_kernels")
    if not k:
        return ""
    if "error" in k:
        return "; GPU kernels: profiler failed (see the JSON)"
    groups = ", ".join(f"{g} {us / 1e3:.2f}" for g, us in k["groups_us"].items())
    return f"; GPU kernels {k['kernel_us'] / 1e3:.2f} ms in {k['launches']} launches ({groups})"


def _pct(r: dict) -> str:
    return f"{100 * r['roofline_fraction']:.1f}% of roofline" if "roofline_fraction" in r else ""


def _bitwise_check(params: dict, execs: dict, k: int, base, draft: np.ndarray) -> dict:
    """verify_step's k+1 logits rows vs k+1 decode_steps committing the draft one token at a time, bit for bit."""
    _, verify_logits = execs[f"verify{k}"](params, copy_tree(base), jnp.asarray(draft))

    def step(state, token):
        state, logits = execs["decode"](params, state)
        return execs["commit"](state, np.int32(0), np.int32(token)), logits

    # k + 1 decode steps; the token committed after the last one is never used.
    rows = forced_decode_logits(step, copy_tree(base), np.append(draft, 0))
    mismatch = mismatched_rows(verify_logits, rows)
    verify_rows = np.asarray(verify_logits)
    return {
        "bitwise_equal_decode": not mismatch,
        "mismatch_rows": mismatch,
        "argmax_equal_rows": sum(int(np.argmax(verify_rows[i])) == int(np.argmax(rows[i])) for i in range(k + 1)),
    }


def _load_model(ctx: Context, name: str, *, keep: bool = False):
    """(params, cfg, info) of a bench model: random int4 at a typed-in shape, or the bundled demo checkpoint."""
    if name in ctx.kept:
        params, cfg = ctx.kept[name] if keep else ctx.kept.pop(name)
        return params, cfg, {"source": "kept from an earlier section", "config": cfg.to_dict()}
    t0 = time.perf_counter()
    if name == "demo":
        import checkpoints

        params, cfg = checkpoints.load(checkpoints.demo_dir())
        params = jax.device_put(params)
        info = {"source": "bundled demo checkpoint", "path": checkpoints.demo_dir()}
    else:
        cfg = model_config(name, ctx.opts.quick)
        params = random_int4_params(cfg, ctx.opts.seed, ctx.opts.lm_head == "int4")
        info = {"source": "random int4" + (" (quick: tiny shrunk shape)" if ctx.opts.quick else "")}
    info["init_s"] = time.perf_counter() - t0
    info["config"] = cfg.to_dict()
    info["param_bytes"] = tree_nbytes(params)
    head = params.get("lm_head")
    info["lm_head"] = "tied" if head is None else "int4" if isinstance(head, Int4Weight) else str(head.dtype)
    if keep:
        ctx.kept[name] = (params, cfg)
    return params, cfg, info


def _steps_for_models(ctx: Context, sec: dict, names: list[str], ks: tuple[int, ...]) -> None:
    models = sec.setdefault("models", {})
    for name in names:
        missing = _demo_missing() if name == "demo" else None
        if missing:
            models[name] = {"status": "skipped", "reason": missing}
            continue
        layers = model_config(name, ctx.opts.quick).num_layers if name != "demo" else 4
        estimate = _init_estimate(ctx, name) + ctx.estimator.estimate(layers) * (1 + len(ks)) / min(
            ctx.opts.compile_threads, 1 + len(ks)
        )
        why = ctx.budget.why_not(estimate, f"{name} steps")
        if why:
            models[name] = {"status": "skipped", "reason": why}
            ctx.report.save()
            continue
        entry = models[name] = {"status": "running"}
        try:
            keep = ctx.opts.e2e_model == name and "e2e" in ctx.opts.sections
            params, cfg, info = _load_model(ctx, name, keep=keep)
            entry.update(info)
            measure_steps(ctx, name, params, cfg, ks, entry)
            entry["status"] = "done"
        except Exception as e:
            entry.update(status="error", error=_error_text(e))
            ctx.report.errors += 1
            print(f"  {name}: ERROR {e!r}", flush=True)
        finally:
            params = None
            gc.collect()
        ctx.report.save()


def _init_estimate(ctx: Context, name: str) -> float:
    return 3.0 if ctx.opts.quick or name in ctx.kept else 15.0


def _demo_missing() -> str | None:
    """Why the bundled demo model cannot be benchmarked here, or None."""
    try:
        import checkpoints

        checkpoints.demo_dir()
    except Exception as e:  # not bundled, or `checkpoints` cannot import here (e.g. orbax missing on this machine)
        return f"no bundled demo model: {e!r}"
    return None


def section_steps(ctx: Context, sec: dict) -> None:
    names = [n for n in STEP_MODELS if n in ctx.opts.models]
    sec["ks"] = list(ctx.opts.ks)
    _steps_for_models(ctx, sec, names, ctx.opts.ks)


def section_other_steps(ctx: Context, sec: dict) -> None:
    names = [n for n in OTHER_MODELS if n in ctx.opts.models]
    if ctx.opts.quick and "demo" not in ctx.opts.models:
        sec["note"] = "quick mode: the demo model runs only when named in --models"
    sec["ks"] = list(ctx.opts.other_ks)
    _steps_for_models(ctx, sec, names, ctx.opts.other_ks)


# ----------------------------------------------------------------------------------------------------- e2e
def echo_prompt(p: np.ndarray, g, period: int | None, rng: np.random.Generator, vocab: int, length: int) -> np.ndarray:
    """pad + P + G' + P, `length` tokens, where G' is greedy's own continuation G of the prompt with one random token
    inserted after every `period` tokens (None: G' = G) and pad is random tokens. Prompt lookup then drafts G' and
    is right up to the next inserted token: ~`period` tokens committed per verify step (period 1: every draft misses;
    None: ~k + 1), with no decode steps between.

    All prompts get the same length so that they share one prefill executable and the last prompt token sits at the
    same row of the prefill matmuls (a GEMM may sum rows of different tiles in different orders); to the Markov model
    the pad changes nothing, and random pad tokens are (almost) never matched by prompt lookup."""
    echoed = []
    for i, token in enumerate(g):
        echoed.append(int(token))
        if period and (i + 1) % period == 0:
            echoed.append(int(rng.integers(0, vocab)))
    return pad_prompt(np.concatenate([p, np.asarray(echoed, np.int64), p]), length, rng, vocab)


def random_filler(rng: np.random.Generator, vocab: int, plen: int, n: int, length: int):
    """(P, pad + P + R + P): a random prompt P of plen tokens and the filler prompt (R: n random tokens)."""
    p = rng.integers(0, vocab, plen).astype(np.int32)
    return p, pad_prompt(np.concatenate([p, rng.integers(0, vocab, n), p]), length, rng, vocab)


def acyclic_continuation(greedy: Callable, first: tuple, new_filler: Callable, attempts: int = 5):
    """(P, filler, G, attempts): the first random prompt (up to `attempts`) whose greedy continuation G repeats no
    token. For the Markov model a repeated token starts a cycle, which prompt lookup would hit without any echo.
    first: (P, filler, G) already generated; greedy(prompt) -> tokens; new_filler() -> (P, filler)."""
    p, filler, g = first
    tried = 1
    while len(set(g)) < len(g) and tried < attempts:
        p, filler = new_filler()
        g = greedy(filler)
        tried += 1
    return p, filler, list(g), tried


def pad_prompt(core: np.ndarray, length: int, rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Random tokens + core, `length` tokens in all (int32)."""
    if len(core) > length:
        raise ValueError(f"prompt of {len(core)} tokens does not fit the common length {length}")
    return np.concatenate([rng.integers(0, vocab, length - len(core)), core]).astype(np.int32)


def section_e2e(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    name = opts.e2e_model
    if name not in opts.models:
        sec.update(status="skipped", reason=f"--models does not include the end-to-end model {name}")
        return
    layers = model_config(name, opts.quick).num_layers
    n, k, plen = opts.new_tokens, opts.k, opts.prompt_len
    decode_s = _measured_decode_s(ctx, name)
    configs = [c for c in E2E_CONFIGS if c[0] in opts.e2e_configs]

    def estimate(cfgs) -> float:
        """init + concurrent compiles (+30% contention) + the first prompt's runs."""
        compiles = sum(ctx.estimator.estimate(layers, E2E_COMPILE_WEIGHT[c[3]]) for c in cfgs)
        runs = len(cfgs) * (opts.repeats + 1) * n * decode_s
        return _init_estimate(ctx, name) + 1.3 * compiles / min(opts.compile_threads, len(cfgs)) + runs

    while len(configs) > 2 and ctx.budget.why_not(estimate(configs), "e2e"):
        sec.setdefault("skipped_configs", []).append({"config": configs.pop()[0], "reason": "budget"})
    why = ctx.budget.why_not(estimate(configs), "e2e (greedy/host, lookup/host)")
    if why:
        ctx.kept.pop(name, None)
        sec.update(status="skipped", reason=why)
        return
    params, cfg, info = _load_model(ctx, name)
    sec.update(model=name, **info)
    params = scale_attention_output(params, opts.o_factor)
    length = 2 * plen + 2 * n  # every prompt: the longest echo prompt (period 1: G' has 2n tokens)
    max_len = length + n
    sec.update(o_factor=opts.o_factor, k=k, new_tokens=n, random_prompt_len=plen, prompt_len=length, max_len=max_len)
    rng = np.random.default_rng(opts.seed + 3)
    p, filler = random_filler(rng, cfg.vocab_size, plen, n, length)
    engines = {c[0]: Engine(params, cfg, max_len=max_len, k=k, prepare=opts.prepare_arg) for c in configs}
    sec["prepared"] = next(iter(engines.values())).prepared
    kwargs = {c[0]: _run_kwargs(c) for c in configs}

    def run(label: str, prompt: np.ndarray):
        return engines[label].generate(prompt, n, **kwargs[label])

    # Compile (concurrently) and run every configuration once on the filler prompt; its greedy output is G.
    before = ctx.compiles.count
    warm = run_parallel({label: functools.partial(run, label, filler) for label in engines}, opts.compile_threads)
    sec["warmup_s"] = {label: seconds for label, (_, seconds) in warm.items()}  # compile + one run
    sec["backend_compiles"] = ctx.compiles.count - before
    sec["num_compiles"] = {label: eng.num_compiles for label, eng in engines.items()}
    print(f"  e2e: {len(engines)} configurations compiled and run once in {max(sec['warmup_s'].values()):.1f} s")
    g = warm["greedy/host"][0].tokens
    for label, (result, _) in warm.items():
        ctx.report.check_identity(result.tokens == g, f"e2e/warm-up/{label}: tokens != greedy")
    p, filler, g, sec["continuation_attempts"] = acyclic_continuation(
        lambda prompt: run("greedy/host", prompt).tokens,
        (p, filler, g),
        lambda: random_filler(rng, cfg.vocab_size, plen, n, length),
    )
    sec["greedy_distinct_fraction"] = len(set(g)) / len(g)  # < 1: G repeats itself, lookup hits without the echo
    variants = [("filler", None, filler)]
    for period in (*opts.insert_periods, None):
        prompt = echo_prompt(p, g, period, rng, cfg.vocab_size, length)
        variants.append(("full" if period is None else f"insert{period}", period, prompt))
    sec["variants"] = {}
    before = ctx.compiles.count
    variant_s = len(configs) * opts.repeats * n * decode_s
    for vname, period, prompt in variants:
        why = ctx.budget.why_not(variant_s, f"e2e prompt {vname}")
        if why:
            sec["variants"][vname] = {"status": "skipped", "reason": why}
            continue
        t0 = time.perf_counter()
        sec["variants"][vname] = _run_variant(ctx, engines, kwargs, vname, period, prompt, g)
        variant_s = time.perf_counter() - t0
        ctx.report.save()
    sec["compiles_after_warmup"] = ctx.compiles.count - before
    sec["engine_compiles_after_warmup"] = {
        label: eng.num_compiles - sec["num_compiles"][label] for label, eng in engines.items()
    }


E2E_COMPILE_WEIGHT = {False: 2.2, True: 4.5}  # host: prefill + decode/verify rounds; device: all in one executable


def _measured_decode_s(ctx: Context, name: str) -> float:
    """The decode step time of `name` measured by the steps section, else a guess (for budget estimates)."""
    entry = ctx.report.data["sections"].get("steps", {}).get("models", {}).get(name, {})
    return entry["decode"]["time_s"] if "decode" in entry else (0.002 if ctx.opts.quick else 0.01)


def _run_kwargs(config: tuple) -> dict:
    _, lookup, gate, on_device, rounds_per_call = config
    return dict(
        drafter=PromptLookup() if lookup else None,
        gate=HitDensityGate() if gate else None,
        on_device=on_device,
        rounds_per_call=rounds_per_call,
    )


def _run_variant(ctx: Context, engines: dict, kwargs: dict, vname: str, period, prompt, g: list[int]) -> dict:
    """Every configuration `repeats` times on one prompt, interleaved; every run's tokens checked against greedy's.

    decode_tok_s excludes prefill: (new tokens - 1) / (wall - prefill). The host loop times its prefill itself; for
    the on-device loop (one executable) prefill is the wall time of the same executable with max_new_tokens=1."""
    runs: dict[str, list] = {label: [] for label in engines}
    prefills: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(ctx.opts.repeats):
        for label, eng in engines.items():
            runs[label].append(eng.generate(prompt, len(g), **kwargs[label]))
            if kwargs[label]["on_device"]:
                prefills[label].append(eng.generate(prompt, 1, **kwargs[label]).stats.wall_time_s)
            else:
                prefills[label].append(runs[label][-1].stats.prefill_time_s)
    greedy = runs["greedy/host"][0].tokens
    out = {
        "prompt_len": len(prompt),
        "prefill_chunks": -(-len(prompt) // engines["greedy/host"].prefill_chunk),
        "insert_period": period,
        "echo_fraction": 0.0 if vname == "filler" else period / (period + 1) if period else 1.0,
        "greedy_repeats_echo": common_prefix(greedy, g) / len(g),  # 1.0: greedy continued with G, as designed
        "configs": {},
    }
    for label, results in runs.items():
        for i, r in enumerate(results):
            ctx.report.check_identity(r.tokens == greedy, f"e2e/{vname}/{label}/run{i}: tokens != greedy")
        wall = statistics.median(r.stats.wall_time_s for r in results)
        prefill = statistics.median(prefills[label])
        s = results[0].stats
        out["configs"][label] = {
            "identical_to_greedy": all(r.tokens == greedy for r in results),
            "tok_s": len(greedy) / wall,
            "decode_tok_s": (len(greedy) - 1) / (wall - prefill) if wall > prefill else None,  # None: timing noise
            "wall_s": [r.stats.wall_time_s for r in results],
            "prefill_s": prefills[label],
            "mean_accepted": s.mean_accepted,
            "acceptance_rate": s.acceptance_rate,
            "verify_steps": s.verify_steps,
            "decode_steps": s.decode_steps,
            "gate_engaged": s.gate_engaged,
            "would_hits": s.would_hits,
        }
    for label, c in out["configs"].items():
        base = out["configs"].get("greedy/" + label.split("/")[1])
        if base and not label.startswith("greedy") and c["decode_tok_s"] and base["decode_tok_s"]:
            c["speedup_vs_greedy"] = c["decode_tok_s"] / base["decode_tok_s"]
    summary = " ".join(_run_summary(label, c) for label, c in out["configs"].items())
    print(f"  e2e {vname}: decode tok/s {summary}", flush=True)
    return out


def _run_summary(label: str, c: dict) -> str:
    if "speedup_vs_greedy" not in c:
        return f"{label} {_num(c['decode_tok_s'], '.0f')}"
    return f"{label} {c['decode_tok_s']:.0f} (x{c['speedup_vs_greedy']:.2f} m={c['mean_accepted']:.2f})"


def _num(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


# ---------------------------------------------------------------------------------------------------- peer
def section_peer(ctx: Context, sec: dict) -> None:
    """HF transformers at the peer shape: bf16 eager; greedy (static cache) vs prompt_lookup_num_tokens.

    First with the random weights as initialized (the echo prompt makes its prompt lookup verify, with attention
    fully in play: does its speculative output equal its greedy output?), then with the attention output
    projection scaled by --o-factor like jspec's end-to-end model (acceptance set by the echo prompts)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    opts = ctx.opts
    name = opts.peer_model
    why = ctx.budget.why_not(5.0 if opts.quick else 60.0, "peer")
    if why:
        sec.update(status="skipped", reason=why)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sec.update(model=name, device=device, transformers=transformers.__version__, torch=torch.__version__)
    sec["setup"] = (
        "bf16, attn_implementation=eager, greedy (do_sample=False), random weights; greedy timed with a StaticCache; "
        "prompt lookup with the default dynamic cache (transformers refuses assisted generation with static caches), "
        "its output compared with greedy on the same dynamic cache"
    )
    hf = hf_config_dict(name, opts.quick)
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    t0 = time.perf_counter()
    torch.manual_seed(opts.seed)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with torch.device(device):  # weights are created (and randomly initialized) on the device
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **{dtype_kw: torch.bfloat16})
    model.eval()
    _sync(device)
    sec["init_s"] = time.perf_counter() - t0
    n, k = opts.peer_new_tokens, opts.k
    rng = np.random.default_rng(opts.seed + 4)
    length = 2 * opts.prompt_len + 2 * n  # every prompt, as in the e2e section
    p, filler = random_filler(rng, config.vocab_size, opts.prompt_len, n, length)

    def generate(ids: np.ndarray, new: int, lookup: bool, static: bool = True):
        return _hf_generate(model, config, ids, new, k if lookup else None, device, static)

    def echo_variants(prefix: str, periods: tuple) -> None:
        first = (p, filler, generate(filler, n, False)[0])
        q, _, g, sec[prefix + "continuation_attempts"] = acyclic_continuation(
            lambda prompt: generate(prompt, n, False)[0],
            first,
            lambda: random_filler(rng, config.vocab_size, opts.prompt_len, n, length),
        )
        for period in periods:
            vname = prefix + ("full" if period is None else f"insert{period}")
            prompt = echo_prompt(q, g, period, rng, config.vocab_size, length)
            greedy, greedy_s = generate(prompt, n, False)
            greedy_dynamic, _ = generate(prompt, n, False, static=False)
            lookup, lookup_s = generate(prompt, n, True)
            sec["variants"][vname] = {
                "prompt_len": len(prompt),
                "greedy_tok_s": len(greedy) / greedy_s,
                "lookup_tok_s": len(lookup) / lookup_s,
                "speedup": greedy_s / lookup_s * len(lookup) / max(len(greedy), 1),
                "lookup_equals_greedy": lookup == greedy_dynamic,  # same (dynamic) cache on both sides
                "first_difference": common_prefix(lookup, greedy_dynamic) if lookup != greedy_dynamic else None,
                "greedy_static_equals_dynamic": greedy == greedy_dynamic,
                "greedy_repeats_echo": common_prefix(greedy, g) / n,
            }
            print(f"  peer {vname}: {sec['variants'][vname]}", flush=True)
            ctx.report.save()

    threads = torch.get_num_threads()
    if device == "cpu":  # quick mode's tiny model: torch's thread pool only adds overhead (20x here)
        torch.set_num_threads(1)
    try:
        generate(filler[:32], 4, False)  # warm-up
        generate(filler[:32], 4, True)
        sec.update(k=k, new_tokens=n, o_factor=opts.o_factor, variants={})
        echo_variants("as-initialized/", (None,))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(opts.o_factor)
        echo_variants("", (None, 1))
    finally:
        torch.set_num_threads(threads)


def _hf_generate(model, config, ids: np.ndarray, new: int, lookup: int | None, device: str, static: bool = True):
    """(new tokens list, seconds) of model.generate; greedy with a StaticCache when `static`, else (and always for
    prompt lookup) the default dynamic cache."""
    import warnings

    import torch
    from transformers import StaticCache

    x = torch.as_tensor(ids[None].astype(np.int64), device=device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if lookup:  # assisted generation refuses static caches (transformers 5.17): the default dynamic cache
        kwargs["prompt_lookup_num_tokens"] = lookup
    elif static:  # `past_key_values`: the name every release takes (5.24 deprecates it for `cache`; 5.17 rejects that)
        kwargs["past_key_values"] = StaticCache(config=config, max_cache_len=len(ids) + new + 1)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        out = model.generate(x, **kwargs)
    _sync(device)
    return out[0, len(ids) :].tolist(), time.perf_counter() - t0


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------- targets
def evaluate_targets(data: dict) -> list[dict]:
    """DESIGN 5 targets from the measured figures: met True/False, or None when not measured in this run."""
    secs = data.get("sections", {})
    steps = secs.get("steps", {}).get("models", {})
    out = []

    def add(name, target, value, met, detail):
        unit = (
            "fraction"
            if "roofline" in name
            else "tok/s"
            if "tok/s" in name
            else "count"
            if "recompiles" in name
            else "x"
        )
        out.append({"name": name, "target": target, "value": value, "unit": unit, "met": met, "detail": detail})

    d14 = steps.get("qwen2.5-14b", {}).get("decode")
    frac = d14.get("roofline_fraction") if d14 else None
    add(
        "decode step >= 55% of roofline (Qwen2.5-14B shape)",
        TARGETS["decode_roofline_14b"],
        frac,
        None if frac is None else frac >= TARGETS["decode_roofline_14b"],
        f"{d14['time_s'] * 1e3:.3f} ms" if d14 else "not measured",
    )
    for model in STEP_MODELS:
        v7 = steps.get(model, {}).get("verify", {}).get("7")
        ratio = v7.get("ratio_vs_decode") if v7 else None
        add(
            f"verify(k=7) <= 1.25x decode, bit-exact ({model})",
            TARGETS["verify7_over_decode"],
            ratio,
            None if ratio is None else bool(ratio <= TARGETS["verify7_over_decode"] and v7["bitwise_equal_decode"]),
            "not measured" if v7 is None else f"bitwise equal: {v7['bitwise_equal_decode']}",
        )
    e2e = secs.get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    for loop in ("host", "device"):
        best = _at_mean_accepted(variants, f"lookup/{loop}", 3.0)
        add(
            f"speculative >= 2x greedy at mean_accepted 3 ({loop} loop, gate off)",
            TARGETS["speedup_at_mean_accepted_3"],
            best[1] if best else None,
            None if best is None else best[1] >= TARGETS["speedup_at_mean_accepted_3"],
            "no run with mean_accepted in [2.5, 3.5]" if best is None else f"{best[0]}, mean_accepted {best[2]:.2f}",
        )
    miss = variants.get("insert1", {}).get("configs", {})
    for loop in ("host", "device"):
        c = miss.get(f"lookup+gate/{loop}")
        value = c.get("speedup_vs_greedy") if c else None
        add(
            f"gate on, nothing hits: >= 0.97x greedy ({loop} loop)",
            TARGETS["gate_no_hit_vs_greedy"],
            value,
            None if value is None else value >= TARGETS["gate_no_hit_vs_greedy"],
            "not measured" if c is None else f"insert1 prompt (every draft misses): verify steps {c['verify_steps']}",
        )
    greedy = {}  # loop -> median over the prompts of greedy decode tok/s
    if e2e.get("model") == "llama-3-8b":
        for loop in ("host", "device"):
            rates = [
                v["configs"][f"greedy/{loop}"]["decode_tok_s"]
                for v in variants.values()
                if v["configs"].get(f"greedy/{loop}", {}).get("decode_tok_s")
            ]
            if rates:
                greedy[loop] = statistics.median(rates)
    best_loop = max(greedy, key=greedy.get) if greedy else None
    gpt_fast = REFERENCES["gpt_fast_int4_g32_llama3_8b_tok_s"]
    add(
        "greedy int4 >= 460 tok/s (Llama-3-8B shape; 2x gpt-fast's 228.8)",
        TARGETS["greedy_tok_s_llama3_8b"],
        greedy.get(best_loop),
        None if best_loop is None else greedy[best_loop] >= TARGETS["greedy_tok_s_llama3_8b"],
        "not measured"
        if best_loop is None
        else f"{best_loop} loop (median over prompts), {greedy[best_loop] / gpt_fast:.2f}x gpt-fast int4 "
        "(external reference, DESIGN 5)",
    )
    recompiles = e2e.get("compiles_after_warmup")
    add(
        "zero recompiles after warm-up (e2e engines)",
        0,
        recompiles,
        None if recompiles is None else recompiles == 0,
        f"executables per engine: {e2e.get('num_compiles')}" if recompiles is not None else "not measured",
    )
    return out


def _at_mean_accepted(variants: dict, label: str, target: float):
    """(prompt, speedup, mean_accepted) of configuration `label`'s run closest to `target` mean_accepted (+-0.5)."""
    best = None
    for vname, v in variants.items():
        c = v["configs"].get(label)
        if not c or not c["verify_steps"] or "speedup_vs_greedy" not in c:
            continue
        gap = abs(c["mean_accepted"] - target)
        if gap <= 0.5 and (best is None or gap < best[3]):
            best = (f"{vname} prompt", c["speedup_vs_greedy"], c["mean_accepted"], gap)
    return best


# -------------------------------------------------------------------------------------------------- output
def readme_table(data: dict) -> str:
    """Markdown for the README, generated from a results JSON."""
    meta = data["meta"]
    lines = []
    if meta.get("mode") == "quick":
        lines.append("> **QUICK MODE** (CPU, tiny shrunk shapes): a harness check, not performance figures.\n")
    roof = data["sections"].get("roofline", {})
    roof_text = f"{roof['roofline_Bps'] / 1e12:.2f} TB/s ({roof['best']})" if "roofline_Bps" in roof else "n/a"
    lines.append(
        f"Measured on {meta.get('device')} — jax {meta.get('jax')}, kernels `{meta.get('kernel_backend')}`, "
        f"commit `{str(meta.get('commit'))[:12]}`, {meta.get('date')}. HBM read roofline: {roof_text}. "
        f"Random int4 weights (lm_head {meta.get('lm_head')}), batch 1."
    )
    lines += ["", "**Step cost** (context " + str(_first(data, "context")) + " tokens)", ""]
    ks = sorted({int(k) for m in _step_models(data).values() for k in m.get("verify", {})})
    head = "| model | decode ms | % roofline | " + " | ".join(f"verify k={k} ms (x decode)" for k in ks)
    lines += [head + " | bit-exact |", "|" + "---|" * (4 + len(ks))]
    for name, m in _step_models(data).items():
        if "decode" not in m:
            lines.append(f"| {name} | {m.get('status')}: {str(m.get('reason') or m.get('error', ''))[:60]} |")
            continue
        cells = [f"{m['decode']['time_s'] * 1e3:.2f}", _pct_cell(m["decode"])]
        for k in ks:
            v = m["verify"].get(str(k))
            cells.append(f"{v['time_s'] * 1e3:.2f} ({v['ratio_vs_decode']:.2f}x)" if v else "")
        exact = all(v["bitwise_equal_decode"] for v in m["verify"].values())
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
    e2e = data["sections"].get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    if variants:
        labels = [c[0] for c in E2E_CONFIGS if any(c[0] in v["configs"] for v in variants.values())]
        spec = [lb for lb in labels if not lb.startswith("greedy")]
        lines += [
            "",
            f"**End to end** ({e2e['model']} shape, attention output zeroed so the random model is Markov and the "
            f"echo prompts set the acceptance; k={e2e['k']}, {e2e['new_tokens']} new tokens; greedy: decode tok/s, "
            "prefill excluded; speculative: speedup vs greedy on the same loop, mean_accepted in brackets)",
            "",
            "| prompt | echo fraction | "
            + " | ".join(f"{lb} tok/s" for lb in labels if lb.startswith("greedy"))
            + " | "
            + " | ".join(spec)
            + " | identical |",
            "|" + "---|" * (3 + len(labels)),
        ]
        for vname, v in variants.items():
            c = v["configs"]
            greedy_cells = [_num(c.get(lb, {}).get("decode_tok_s"), ".0f") for lb in labels if lb.startswith("greedy")]
            spec_cells = [_spec_cell(c.get(lb, {})) for lb in spec]
            same = all(x["identical_to_greedy"] for x in c.values())
            lines.append(
                f"| {vname} | {v['echo_fraction']:.2f} | "
                + " | ".join(greedy_cells + spec_cells)
                + f" | {'yes' if same else 'NO'} |"
            )
    peer = data["sections"].get("peer", {})
    if peer.get("variants"):
        lines += [
            "",
            f"**Peer**: HuggingFace transformers {peer.get('transformers')} ({peer['setup']}), "
            f"{peer['model']}, {peer['new_tokens']} new tokens",
            "",
        ]
        lines += ["| prompt | greedy tok/s | prompt lookup tok/s | lookup output == its greedy |", "|---|---|---|---|"]
        for vname, v in peer["variants"].items():
            lines.append(
                f"| {vname} | {v['greedy_tok_s']:.1f} | {v['lookup_tok_s']:.1f} | "
                f"{'yes' if v['lookup_equals_greedy'] else 'no'} |"
            )
        ours = _step_models(data).get(peer["model"], {}).get("decode")
        if ours:
            lines.append(
                f"\njspec at the same shape (int4): decode step {ours['time_s'] * 1e3:.2f} ms, i.e. at most "
                f"{1 / ours['time_s']:.0f} tok/s greedy (step cost only; see the steps table)."
            )
    ref = REFERENCES
    lines += [
        "",
        f"External references on this H200 (DESIGN 5, not measured here): gpt-fast Llama-3-8B shape int4 g32 "
        f"{ref['gpt_fast_int4_g32_llama3_8b_tok_s']} tok/s, bf16 {ref['gpt_fast_bf16_llama3_8b_tok_s']} tok/s.",
        "",
        "**Targets**",
        "",
        "| target | value | met | detail |",
        "|---|---|---|---|",
    ]
    for t in data.get("targets", []):
        value = _target_value(t["value"], t["unit"])
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['name']} | {value} | {met} | {t['detail']} |")
    ident = data.get("identity", {})
    lines.append("")
    lines.append(
        f"Identity: {'all' if ident.get('ok') else 'NOT all'} {ident.get('checks', 0)} checks passed "
        "(speculative tokens == greedy tokens; verify rows == decode rows, bitwise)."
    )
    return "\n".join(lines)


def _spec_cell(c: dict) -> str:
    if "speedup_vs_greedy" not in c:
        return ""
    accepted = f"{c['mean_accepted']:.2f}" if c["verify_steps"] else "no verify"
    return f"{c['speedup_vs_greedy']:.2f}x ({accepted})"


def _target_value(value, unit: str) -> str:
    if value is None:
        return "n/a"
    return {"fraction": f"{100 * value:.1f}%", "tok/s": f"{value:.0f} tok/s", "count": str(value)}.get(
        unit, f"{value:.2f}x"
    )


def _step_models(data: dict) -> dict:
    out = {}
    for sec in ("steps", "other_steps"):
        out.update(data["sections"].get(sec, {}).get("models", {}))
    return out


def _first(data: dict, key: str):
    for m in _step_models(data).values():
        if key in m:
            return m[key]
    return "n/a"


def _pct_cell(r: dict) -> str:
    return f"{100 * r['roofline_fraction']:.1f}%" if "roofline_fraction" in r else "n/a"


def _plot_step_time(plt, models: dict, path: Path) -> bool:
    """Per model, the decode step's wall time split into its GPU kernel groups and the time between kernels, against
    the roofline time of the bytes it reads and the decode target's time (the roofline time / the target fraction).
    False when no model has GPU kernel times (CPU runs)."""
    steps = {n: m["decode"] for n, m in models.items() if m["decode"].get("gpu_kernels")}
    if not steps:
        return False
    parts = [g for g, _ in KERNEL_GROUPS] + ["XLA ops", "between kernels"]
    fig, ax = plt.subplots(figsize=(9, 2.2 + 0.7 * len(steps)))
    target = TARGETS["decode_roofline_14b"]
    legend = {}  # label -> the first artist drawn with it
    for y, step in enumerate(steps.values()):
        kernels = step["gpu_kernels"]
        us = dict(kernels["groups_us"], **{"between kernels": max(0.0, step["time_s"] * 1e6 - kernels["kernel_us"])})
        left = 0.0
        for i, part in enumerate(parts):
            width = us.get(part, 0.0) / 1e3
            if width:
                legend.setdefault(part, ax.barh(y, width, left=left, color=f"C{i}"))
                left += width
        ax.text(left, y, f" {left:.2f} ms, {kernels['launches']} launches", va="center", fontsize=8)
        roof = step["roofline_time_s"] * 1e3
        legend.setdefault("roofline time of the bytes read", ax.vlines(roof, y - 0.4, y + 0.4, color="black", lw=2))
        legend.setdefault(
            f"decode target ({target:.0%} of roofline)",
            ax.vlines(roof / target, y - 0.4, y + 0.4, color="red", ls="--", lw=1.5),
        )
    ax.set_xlim(0, 1.25 * max(s["time_s"] for s in steps.values()) * 1e3)
    ax.set_yticks(range(len(steps)), list(steps))
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step")
    ax.set_title("Where a decode step's time goes (GPU kernel time by group, XLA profiler)")
    markers = [label for label in legend if label not in parts]
    labels = markers + [part for part in parts if part in legend]
    ax.legend(
        [legend[label] for label in labels],
        labels,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=4,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_plots(data: dict, out_dir: str) -> list[str]:
    """roofline.png: each step kind's achieved read bandwidth as % of the roofline, per model (step time on the bar);
    step_time.png (GPU runs): where each model's decode step time goes (`_plot_step_time`);
    speedup.png: speculative speedup against mean_accepted, with verify(k)'s break-even mean_accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    models = {n: m for n, m in _step_models(data).items() if "decode" in m and "roofline_fraction" in m["decode"]}
    if models:
        ks = sorted({int(k) for m in models.values() for k in m["verify"]})
        kinds = [("decode", lambda m: m["decode"])] + [
            (f"verify k={k}", functools.partial(lambda m, k: m["verify"].get(str(k)), k=k)) for k in ks
        ]
        fig, ax = plt.subplots(figsize=(max(7, 2 * len(kinds)), 4.5))
        width = 0.8 / len(models)
        for i, (name, m) in enumerate(models.items()):
            for j, (_, get) in enumerate(kinds):
                step = get(m)
                if not step:
                    continue
                x = j + i * width
                ax.bar(x, 100 * step["roofline_fraction"], width, color=f"C{i}", label=name if j == 0 else None)
                ax.text(
                    x,
                    100 * step["roofline_fraction"],
                    f"{step['time_s'] * 1e3:.2f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.axhline(100 * TARGETS["decode_roofline_14b"], color="red", ls="--", lw=1, label="decode target (55%)")
        ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(kinds))], [k for k, _ in kinds])
        ax.set_ylabel("% of HBM read roofline")
        roof = data["sections"].get("roofline", {}).get("roofline_Bps")
        ax.set_title(f"Step read bandwidth (roofline {roof / 1e12:.2f} TB/s; labels: ms per step)" if roof else "")
        ax.legend(fontsize=8)
        files.append(str(out / "roofline.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
        if _plot_step_time(plt, models, out / "step_time.png"):
            files.append(str(out / "step_time.png"))
    e2e = data["sections"].get("e2e", {})
    variants = {k: v for k, v in e2e.get("variants", {}).items() if "configs" in v}
    if variants:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label in [c[0] for c in E2E_CONFIGS if not c[0].startswith("greedy")]:
            pts = [
                (v["configs"][label]["mean_accepted"], v["configs"][label]["speedup_vs_greedy"])
                for v in variants.values()
                if label in v["configs"]
                and v["configs"][label]["verify_steps"]
                and "speedup_vs_greedy" in v["configs"][label]
            ]
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, "o-", label=label)
        ax.axhline(1.0, color="gray", lw=1)
        v7 = models.get(e2e.get("model"), {}).get("verify", {}).get(str(e2e.get("k")))
        if v7:
            be = v7["break_even_mean_accepted"]
            ax.axvline(be, color="red", ls="--", lw=1, label=f"break-even mean_accepted {be:.2f} (verify k={e2e['k']})")
            xs = np.linspace(1, e2e["k"] + 1, 50)
            ax.plot(xs, xs / be, color="red", lw=0.8, alpha=0.6, label="model: mean_accepted x decode/verify")
        ax.set_xlabel("mean_accepted (tokens committed per verify step)")
        ax.set_ylabel("speedup vs greedy (decode tok/s)")
        ax.set_title(f"{e2e.get('model')}: speculative speedup against acceptance")
        ax.legend(fontsize=8)
        files.append(str(out / "speedup.png"))
        fig.tight_layout()
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files


# ---------------------------------------------------------------------------------------------------- main
def _meta(opts: Options, argv) -> dict:
    dev = jax.devices()[0]
    meta = {
        "mode": "quick" if opts.quick else "full",
        "device": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "kernel_backend": get_backend(),
        "commit": opts.commit or _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": list(argv or []),
        "python": platform.python_version(),
        "budget_s": opts.budget_s,
        "lm_head": opts.lm_head,
        "options": dataclasses.asdict(opts),
        "references": REFERENCES,
    }
    try:
        import jaxlib

        meta["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    return meta


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


SECTION_FUNCS = {
    "roofline": section_roofline,
    "steps": section_steps,
    "e2e": section_e2e,
    "other_steps": section_other_steps,
    "peer": section_peer,
}
SECTION_MIN_S = {"roofline": 5.0, "steps": 30.0, "e2e": 60.0, "other_steps": 30.0, "peer": 60.0}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    opts, args = parse_args(argv)
    if args.readme_table:
        print(readme_table(json.loads(Path(args.readme_table).read_text())))
        return 0
    if args.replot:
        if not opts.plots:
            raise SystemExit("jspec bench --replot needs --plots DIR")
        for f in make_plots(json.loads(Path(args.replot).read_text()), opts.plots):
            print(f)
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # leave room for torch (roofline, peer)

    budget = Budget(opts.budget_s)
    report = Report(opts.out, _meta(opts, argv))
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    ctx = Context(opts, budget, report, counter, CompileEstimator(0.05 if opts.quick else 0.5))
    sections = [s for s in opts.sections if s != "peer" or opts.peer_hf]
    if "peer" in opts.sections and not opts.peer_hf:
        report.section("peer").update(status="skipped", reason="--peer-hf not given")
    try:
        for name in sections:
            sec = report.section(name)
            why = budget.why_not(SECTION_MIN_S[name] * (0.1 if opts.quick else 1.0), name)
            if why:
                sec.update(status="skipped", reason=why)
                report.save()
                continue
            print(f"[{budget.elapsed():.0f}s] {name}", flush=True)
            t0 = time.perf_counter()
            try:
                SECTION_FUNCS[name](ctx, sec)
                if sec["status"] == "running":
                    sec["status"] = "done"
            except Exception as e:
                sec.update(status="error", error=_error_text(e))
                report.errors += 1
                print(f"[{name}] ERROR {e!r}", flush=True)
            sec["elapsed_s"] = time.perf_counter() - t0
            gc.collect()
            report.save()
        report.data["targets"] = evaluate_targets(report.data)
        if opts.plots:
            try:
                report.data["plots"] = make_plots(report.data, opts.plots)
            except Exception as e:  # e.g. no matplotlib on the GPU machine: the JSON has every number
                report.data["plots"] = (
                    f"not drawn: {e!r}; run `python -m jspec.bench --replot RESULTS.json --plots DIR`"
                )
    finally:
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(counter)
        report.data["meta"]["elapsed_s"] = budget.elapsed()
        report.data["meta"]["backend_compiles"] = counter.count
        report.data["meta"]["backend_compile_s"] = counter.seconds
        report.data["ok"] = report.data["identity"]["ok"] and report.errors == 0
        report.save()
    print(readme_table(report.data))
    print(f"results: {opts.out}  ({budget.elapsed():.0f} s)", flush=True)
    if not report.data["identity"]["ok"]:
        return 1
    return 2 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
