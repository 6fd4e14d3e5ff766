"""Host-loop MTP after a prefill of several chunks on the GPU: where do its tokens leave greedy's?

Noticed on the H200 at 65aa4be (2026-12-04), never on the CPU: `Engine.generate(..., drafter=MTPDrafter())` on the
host loop, after a prompt prefilled in several chunks, gave tokens other than plain greedy's.
- tests/test_mtp.py::test_chunked_prefill_fills_the_mtp_caches_as_one_chunk (float32 qwen2, 2 MTP layers, a 30-token
  prompt in chunks of 8): [38, 0, 0, ...] against greedy's [38, 47, 17, ...];
- gpu_exactness's qwen3_next int4 mode mtp_host (a 248-token echo prompt in chunks of 64): not identical, 0 verify
  rounds, where the same model's mtp_device, mtp_host_sampled, lookup_host and draft_model_host runs were identical.
On the CPU both pass (reference kernels and JSPEC_KERNELS=interpret; this script's --small run too). 65aa4be's
layer, MTP-layer and `linear` code (the fused residual norm) was reverted in 3c7bc61, so the first question this run
answers is whether the shipped code leaves greedy at all. At 92eba15 it does, in both cases
(experiments/results/mtp_host_chunked_h200.json, mtp_host_chunked_variants_h200.json; docs/exactness.md). With
keep_unused (bf52466) both are identical (mtp_host_chunked_keep_unused_h200.json); in one process the pruned
variant returns the first case's wrong first round again and the shipped Engine does not
(mtp_host_chunked_pruned_ab_h200.json, where the second case matched greedy in every variant).

For each case and each variant this script runs the host-loop MTP generation against plain greedy, then the host
loop's stages one by one, each against the same stage composed in one jitted program (`jspec.loop`'s functions, no
donation, the shipped XLA options): the Loop after the prefill executables, after the first round, and after each
of the next rounds, leaf by leaf (bits equal, elements differing, largest difference, NaNs). A stage whose integer
leaves (positions, tokens, counters) or float leaves (caches) leave the reference by more than rounding names the
culprit.

Variants (the Engine's executables compiled with):
- shipped: `jspec.compiler_options()`;
- no_while: command buffers without WHILE / CONDITIONAL (the loops driven from the host;
  `device_loop_profile.without_command_buffers`);
- no_graphs: no command buffers at all (`xla_options.NO_GRAPHS`);
- no_donation: the shipped options, the Loop not donated between executables;
- pruned, pruned_no_donation: the Engine before bf52466, its executables compiled with unused arguments pruned
  (jax.jit's keep_unused=False), the Loop donated or not.

    python3 benchmarks/experiments/mtp_host_chunked.py --commit SHA --out $OUT/mtp_host_chunked_h200.json
    python3 benchmarks/experiments/mtp_host_chunked.py --small --out /tmp/mtp_host_chunked_cpu.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/: device_loop_profile, xla_options

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_loop_profile import SHIPPED, without_command_buffers  # noqa: E402
from gpu_exactness import E2E_VOCAB, model  # noqa: E402
from xla_options import NO_GRAPHS  # noqa: E402

import jspec  # noqa: E402
import jspec.engine  # noqa: E402
from jspec.engine import compiler_options, prefill_plan  # noqa: E402
from jspec.loop import prefill_round, prefilled_loop, run_rounds  # noqa: E402
from jspec.models.mtp import init_mtp_params  # noqa: E402
from jspec.stats import common_prefix  # noqa: E402
from jspec_bench.report import experiment_meta, save_experiment  # noqa: E402

VARIANTS = {
    "shipped": SHIPPED,
    "no_while": without_command_buffers("WHILE", "CONDITIONAL"),
    "no_graphs": SHIPPED | NO_GRAPHS,
    "no_donation": SHIPPED,
    "pruned": SHIPPED,
    "pruned_no_donation": SHIPPED,
}


class UndonatedEngine(jspec.Engine):
    """The Engine with every executable compiled without donation (the no_donation variant)."""

    def _compile(self, key, fn, *args, donate=(), **kw):
        return super()._compile(key, fn, *args, **kw)


class PrunedEngine(jspec.Engine):
    """The Engine as it was before bf52466: its executables compiled with jax.jit's default keep_unused=False
    (unused arguments pruned; the pruned variants, donating or not). One device, no mesh."""

    donate = True

    def _compile(self, key, fn, *args, donate=(), out=None):
        if key not in self._executables:
            lowered = jax.jit(fn, donate_argnums=donate if self.donate else ()).lower(*args)
            self._executables[key] = lowered.compile(compiler_options=compiler_options())
            self.num_compiles += 1
        return self._executables[key]


class PrunedUndonatedEngine(PrunedEngine):
    donate = False


ENGINES = {"no_donation": UndonatedEngine, "pruned": PrunedEngine, "pruned_no_donation": PrunedUndonatedEngine}


def dense_mtp_model(small: bool):
    """The test's case: a float32 qwen2 with 2 MTP layers (DeepSeek layout)."""
    cfg, params = model("qwen2", "float32", small)
    cfg = dataclasses.replace(cfg, num_mtp_layers=2, mtp_layout="deepseek")
    params["mtp"] = init_mtp_params(cfg, jax.random.PRNGKey(7), jnp.float32, 2)
    return cfg, params


def cases(small: bool):
    """(name, cfg, params, engine kwargs, prompt, new tokens) of each case."""
    cfg, params = dense_mtp_model(small)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 30).tolist()
    yield "qwen2_float32", cfg, params, dict(max_len=64, k=3, prefill_chunk=8), prompt, 20
    cfg, params = model("qwen3_next", "int4", small, vocab=E2E_VOCAB)
    engine = jspec.Engine(params, cfg, max_len=512, k=3, prefill_chunk=64)
    prompt = np.random.default_rng(0).integers(0, 500, size=100).tolist()
    echo = prompt + engine.generate(prompt, 48, eos_id=()).tokens + prompt  # gpu_exactness's echo prompt
    yield "qwen3_next_int4", cfg, params, dict(max_len=512, k=3, prefill_chunk=64), echo, 96


def compare(host, ref) -> dict:
    """Leaf by leaf (host-loop Loop against the composed reference, both on the host): the leaves that differ."""
    out = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            out[jax.tree_util.keystr(path)] = dict(shapes=[list(a.shape), list(b.shape)])
            continue
        differ = a != b
        if np.issubdtype(a.dtype, np.floating):
            differ &= ~(np.isnan(a) & np.isnan(b))
        if not differ.any():
            continue
        row = dict(dtype=str(a.dtype), shape=list(a.shape), n_differ=int(differ.sum()), first=np.argwhere(differ)[0])
        row["first"] = [int(i) for i in row["first"]]
        if np.issubdtype(a.dtype, np.floating):
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            row.update(max_abs=float(np.nanmax(diff)), nan_host=int(np.isnan(a).sum()), nan_ref=int(np.isnan(b).sum()))
        elif a.size <= 32:
            row.update(host=a.tolist(), ref=b.tolist())
        out[jax.tree_util.keystr(path)] = row
    return out


def prefilled(engine, settings, prompt: list[int], max_new: int):
    """The Engine's own start and prefill executables run as `Engine._host_loop` runs them -> (the Loop, the
    executables' weights, the request's arguments of the start executable)."""
    request = engine.request(prompt, max_new, ())
    weights = engine._checked_weights(settings)
    args = (weights, *request.loop_args(engine.max_len))
    start = engine._start_exec(settings, weights)
    loop = start(*args)
    for size, count in prefill_plan(len(prompt), settings.prefill_chunk):
        loop = engine._loop_exec(f"prefill{size}", settings, weights, start.out_info)(weights, loop, np.int32(count))
    return loop, weights, args


def stages(engine, settings, prompt: list[int], max_new: int, rounds: int) -> list[dict]:
    """The host loop's stages (as `Engine._host_loop` runs them), each against its composed reference."""
    cfg, options = engine.shard_cfg, compiler_options()

    def ref_prefill(weights, *request):
        return prefilled_loop(weights[0], cfg, settings, *request, None, weights[1])

    def ref_first(weights, *request):
        return prefill_round(weights[0], cfg, settings, *request, None, weights[1])

    def ref_rounds(weights, loop, verify):
        return run_rounds(weights[0], cfg, settings, loop, jnp.int32(1), verify=verify, own=weights[1])

    ref_rounds = jax.jit(ref_rounds, static_argnums=2, compiler_options=options)
    loop, weights, args = prefilled(engine, settings, prompt, max_new)
    shape = engine._start_exec(settings, weights).out_info  # compiled by `prefilled`
    out = []
    ref = jax.jit(ref_prefill, compiler_options=options)(*args)
    out.append(dict(stage="prefill", differ=compare(jax.device_get(loop), jax.device_get(ref))))
    loop = engine._loop_exec("first", settings, weights, shape)(weights, loop)
    host, ref = jax.device_get(loop), jax.jit(ref_first, compiler_options=options)(*args)
    out.append(dict(stage="first", differ=compare(host, jax.device_get(ref))))
    for i in range(rounds):
        verify = bool(host.use_verify)
        if host.stop != 0:
            break
        loop = engine._loop_exec("verify" if verify else "decode", settings, weights, shape)(weights, loop, np.int32(1))
        ref = ref_rounds(weights, jax.device_put(host), verify)
        host = jax.device_get(loop)
        out.append(
            dict(stage=f"round {i} ({'verify' if verify else 'decode'})", differ=compare(host, jax.device_get(ref)))
        )
    return out


def run_case(name, cfg, params, kw, prompt, max_new, variants, rounds) -> dict:
    t0 = time.perf_counter()
    greedy = jspec.Engine(params, cfg, **kw).generate(prompt, max_new, eos_id=()).tokens
    result = dict(prompt_tokens=len(prompt), max_new=max_new, engine=kw, greedy_head=greedy[:16], variants={})
    for variant in variants:
        jspec.engine.GPU_COMPILER_OPTIONS = VARIANTS[variant]
        try:
            engine = ENGINES.get(variant, jspec.Engine)(params, cfg, **kw)
            r = engine.generate(prompt, max_new, drafter=jspec.MTPDrafter(), eos_id=())
            identical = r.tokens == greedy
            row = dict(
                identical=identical,
                first_divergence=None if identical else common_prefix(r.tokens, greedy),
                tokens_head=r.tokens[:16],
                n_tokens=len(r.tokens),
                verify_steps=r.stats.verify_steps,
                decode_steps=r.stats.decode_steps,
                stop_reason=r.stats.stop_reason,
            )
            settings = engine.settings(drafter=jspec.MTPDrafter())
            row["stages"] = stages(engine, settings, prompt, max_new, rounds)
        except Exception:  # a variant XLA refuses is reported, the others still run
            row = dict(error=traceback.format_exc(limit=4))
        finally:
            jspec.engine.GPU_COMPILER_OPTIONS = SHIPPED
        result["variants"][variant] = row
        bad = [s["stage"] for s in row.get("stages", []) if s["differ"]]
        print(f"  {name} {variant}: identical {row.get('identical')}, stages differing {bad}", flush=True)
    result["seconds"] = time.perf_counter() - t0
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=4, help="rounds compared stage by stage after the first")
    args = ap.parse_args()
    variants = args.variants.split(",")
    t0 = time.perf_counter()
    out = dict(meta=experiment_meta(args.commit), variants=variants, cases={})
    for name, cfg, params, kw, prompt, max_new in cases(args.small):
        out["cases"][name] = run_case(name, cfg, params, kw, prompt, max_new, variants, args.rounds)
        save_experiment(out, args.out, t0)


if __name__ == "__main__":
    main()
