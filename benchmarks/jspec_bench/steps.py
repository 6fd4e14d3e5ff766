"""The steps and other_steps sections: decode_step and verify_step(k) of one model at a time (random int4 at a bench
shape, or the bundled demo model) at cache position `--context`: time (median over trials of back-to-back calls of
a jitted step with donated state, the steps' trials interleaved), bytes read, % of the roofline, verify/decode ratio
(= the break-even mean_accepted), compiles, GPU kernel times, and a bitwise check that verify row i equals the decode
step at position + i."""

from __future__ import annotations

import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.engine import compiler_options
from jspec.exactness import forced_decode_logits, mismatched_rows
from jspec.steps import commit, decode_step, verify_step
from jspec_bench.report import Context
from jspec_bench.shapes import (
    OTHER_MODELS,
    STEP_MODELS,
    copy_tree,
    model_config,
    random_int4_params,
    random_state,
    step_bytes,
    tree_nbytes,
)
from jspec_bench.timing import _time_chains, describe_kernels, run_parallel
from pallas_kernels import ROW_TILE, Int4Weight, get_backend
from pallas_kernels.prepare import prepare_params, resolve_prepare


def _decode(params, state, *, cfg):
    return decode_step(params, cfg, state)


def _verify(params, state, draft, *, cfg):
    return verify_step(params, cfg, state, draft)


def lower_steps(params: dict, cfg: ModelConfig, base, drafts: dict[int, np.ndarray]) -> dict:
    """The steps a bitwise check needs, lowered with the state donated: "decode", "verify{k}" for each draft's k,
    and "commit" (`_bitwise_check`'s keys)."""
    lowered = {"decode": jax.jit(functools.partial(_decode, cfg=cfg), donate_argnums=1).lower(params, base)}
    for k, draft in drafts.items():
        fn = jax.jit(functools.partial(_verify, cfg=cfg), donate_argnums=1)
        lowered[f"verify{k}"] = fn.lower(params, base, jnp.asarray(draft))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    lowered["commit"] = jax.jit(commit, donate_argnums=0).lower(base, scalar, scalar)
    return lowered


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
    lowered = lower_steps(params, cfg, base, drafts)
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
    entry.update(context=opts.context, roofline_Bps=roof)

    chains = {"decode": (execs["decode"], params, ())}
    if prepared:
        chains["decode_unprepared"] = (execs["decode_unprepared"], raw, ())
    chains |= {f"verify{k}": (execs[f"verify{k}"], params, (jnp.asarray(drafts[k]),)) for k in ks}
    chains = {key: (fn, weights, copy_tree(base), extra) for key, (fn, weights, extra) in chains.items()}
    count = ctx.compiles.count
    timings = _time_chains(chains, opts.reps, opts.trials, opts.warmup_s)
    entry["compiles_during_timing"] = ctx.compiles.count - count

    def timed(key: str, rows: int = 1) -> dict:
        seconds, times, kernels, after_switch, dispatch = timings[key]
        exec_, weights, _, _ = chains[key]
        read = step_bytes(weights, cfg, base, rows)
        out = {"time_s": seconds, "trial_times_s": times, "bytes": read, "achieved_Bps": read["total"] / seconds}
        out |= {"after_switch_time_s": after_switch, "dispatch_s": dispatch}
        if kernels:
            out["gpu_kernels"] = kernels
        if kernels and "top_kernels_us" in kernels:  # the executable's optimized HLO names its XLA fusions
            out["gpu_kernels"] |= {"top_kernels_source": describe_kernels(exec_.as_text(), kernels["top_kernels_us"])}
        if roof:
            out["roofline_fraction"] = read["total"] / seconds / roof
            out["roofline_time_s"] = read["total"] / roof
        return out

    entry["decode"] = timed("decode")
    decode_s = entry["decode"]["time_s"]
    switch = f"; right after a switch {entry['decode']['after_switch_time_s'] * 1e3:.3f} ms"
    print(
        f"  {name} decode {decode_s * 1e3:.3f} ms {_pct(entry['decode'])}{switch}{_kernels(entry['decode'])}",
        flush=True,
    )
    if prepared:
        raw_entry = entry["decode_unprepared"] = timed("decode_unprepared")
        raw_entry["prepared_speedup"] = raw_entry["time_s"] / decode_s
        print(f"  {name} decode on unprepared weights {raw_entry['time_s'] * 1e3:.3f} ms {_pct(raw_entry)}")
    entry["verify"] = {}
    for k in ks:
        v = timed(f"verify{k}", rows=k + 1)
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
    idle = f", stream idle {k['idle_us'] / 1e3:.2f} ms" if "idle_us" in k else ""
    return f"; GPU kernels {k['kernel_us'] / 1e3:.2f} ms in {k['launches']} launches ({groups}){idle}"


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


def _steps_for_models(ctx: Context, sec: dict, names: list[str], ks: tuple[int, ...], keep: str | None = None) -> None:
    """`measure_steps` of each model in `names` that the budget allows, into sec["models"]; the params of `keep`
    (and of the e2e section's model) stay in ctx.kept for a later sub-step."""
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
            kept = name == keep or ctx.opts.e2e_model == name and "e2e" in ctx.opts.sections
            params, cfg, info = _load_model(ctx, name, keep=kept)
            entry.update(info)
            measure_steps(ctx, name, params, cfg, ks, entry)
            entry["status"] = "done"
        except Exception as e:
            ctx.report.failed(entry, name, e)
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
