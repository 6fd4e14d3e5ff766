"""The `tp` section (issue 38): tensor parallelism over the devices of one host (`jspec.tensor_parallel`), measured.

For each model of TP_PLAN and each of its TP sizes n this process has the devices for (TP = 1 too: the same code on
a one-device mesh), random int4 weights are built shard by shard, each on its own device (`stacked_random_params`:
the whole model never exists anywhere), and an Engine runs on the n-device mesh (its weights prepared on each
device). Then:
- steps: decode_step and verify_step(k = TP_K) on the mesh (every device its shard, `tensor_parallel.on_mesh`) at
  position --context, timed as chains (`timing._time_chains`): the time a step; the HBM bytes it moves on all
  devices together (`shapes.step_bytes` of the stacked weights and state); the aggregate roofline, every device's read
  bandwidth measured in this run (`roofline._xla_sum_Bps` on each) and summed; verify / decode. On a GPU the profile
  of a few calls gives the kernels of all devices together; `per_device_us` divides them by n, and its "collectives"
  group (NCCL's kernels) is the all-reduce and all-gather time a step, waits for the slowest device included.
- collectives alone: a chain of all-reduces of the row tile's [ROW_TILE, H] float32 partial products and of
  all-gathers of its [ROW_TILE, V / n] logits (`collective_s`), so a step's 2 L + 1 all-reduces and one all-gather
  are priced apart from the kernels around them.
- bitwise: verify rows == decode rows on the mesh (`jspec.exactness.verify_rows_match_decode(mesh=)`).
- end to end: the same model with its attention output scaled by --o-factor (a Markov model, as in the e2e section)
  on the on-device loop: greedy on a random prompt, then greedy and prompt lookup (k = TP_K) on the echo prompt its
  greedy continuation makes (`e2e.echo_prompt`): tok/s (`timing.device_decode_rate`) and tokens identical.
- scaling: a model's decode step at each n against its smallest n (issue 38's target: TP = 2 <= 0.6x TP = 1 at the
  Qwen2.5-14B shape, `report.TARGETS["tp2_over_tp1_14b"]`).
In a process with one device the section records why it did not run. On the CPU, `--quick` in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=4 runs it on tiny shapes (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.drafters import PromptLookup
from jspec.engine import Engine, compiler_options
from jspec.exactness import verify_rows_match_decode
from jspec.state import init_state
from jspec.steps import decode_step, verify_step
from jspec.tensor_parallel import (
    AXIS,
    REPLICATED,
    SHARDED,
    STATE_SPECS,
    on_mesh,
    shard_config,
    stack,
)
from jspec_bench.e2e import echo_prompt, random_filler
from jspec_bench.hybrid import E2E_PREFILL_CHUNK
from jspec_bench.report import Context
from jspec_bench.roofline import _xla_sum_Bps
from jspec_bench.shapes import copy_tree, hf_config_dict, random_int4_params, scale_attention_output, step_bytes
from jspec_bench.timing import _median_wall, _time_chains, device_decode_rate
from jspec_bench.tp_shard import local_config
from pallas_kernels import ROW_TILE

TP_PLAN = (("qwen2.5-14b", (1, 2)), ("llama-3-70b", (2, 4)))  # issue 38: (model, its TP sizes)
TP_K = 7
# --quick: the tiny shapes with heads that split 4 ways and int4 K blocks that do not straddle a shard
QUICK_HEADS = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32)


def tp_config(name: str, quick: bool) -> ModelConfig:
    """The model config of a TP_PLAN shape (quick: shrunk, with QUICK_HEADS)."""
    return ModelConfig.from_hf(hf_config_dict(name, quick) | (QUICK_HEADS if quick else {}))


def tp_mesh(n: int):
    """The tensor-parallel mesh of this process's first n devices."""
    return jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])


def random_pieces(cfg: ModelConfig, n: int, seed: int, lm_head_int4: bool) -> list:
    """Random int4 params of each of the n shards of cfg (`tp_shard.local_config`), piece s built on device s."""
    local = local_config(cfg, n)
    pieces = []
    for s, device in enumerate(jax.devices()[:n]):
        with jax.default_device(device):
            pieces.append(random_int4_params(local, seed + s, lm_head_int4))
    return pieces


def mesh_state(cfg: ModelConfig, mesh, max_len: int, position: int, dtype):
    """An empty DecodeState on the mesh (each device its shard's caches) at `position`: a step's cost does not
    depend on the cache's values."""
    shard = shard_config(cfg, mesh.devices.size)

    def make():
        state = init_state(shard, max_len, dtype)
        return dataclasses.replace(state, position=jnp.asarray(position, jnp.int32))

    return jax.jit(on_mesh(make, mesh, (), STATE_SPECS))()


def mesh_steps(params, cfg: ModelConfig, mesh, base, draft) -> dict:
    """{"decode", "verify"}: decode_step and verify_step(draft) on the mesh, the state donated, compiled as an Engine
    compiles."""
    shard = shard_config(cfg, mesh.devices.size)
    out = (STATE_SPECS, REPLICATED)
    decode = on_mesh(lambda p, st: decode_step(p, shard, st), mesh, (SHARDED, STATE_SPECS), out)
    verify = on_mesh(lambda p, st, d: verify_step(p, shard, st, d), mesh, (SHARDED, STATE_SPECS, REPLICATED), out)
    return {
        "decode": jax.jit(decode, donate_argnums=1).lower(params, base).compile(compiler_options()),
        "verify": jax.jit(verify, donate_argnums=1).lower(params, base, draft).compile(compiler_options()),
    }


def collective_s(mesh, shape: tuple[int, ...], gather: bool, count: int, repeats: int) -> float:
    """Seconds of one collective over the mesh: a chain of `count` all-reduces (psum) of a float32 `shape` on every
    device, or (gather) all-gathers of it along its last axis, one executable, median of `repeats` calls."""
    n = mesh.devices.size

    def chain(x):  # x: this device's [*shape]
        def one(_, y):
            if gather:  # the gathered [..., n * w], cut back to w so the chain keeps its shape
                return jax.lax.all_gather(y, AXIS, axis=y.ndim - 1, tiled=True)[..., : y.shape[-1]] * 0.5
            return jax.lax.psum(y, AXIS) * (1.0 / n)

        return jax.lax.fori_loop(0, count, one, x)

    x = stack([np.ones(shape, np.float32)] * n, mesh)
    run = jax.jit(on_mesh(chain, mesh, (SHARDED,), SHARDED)).lower(x).compile(compiler_options())
    return _median_wall(lambda: jax.block_until_ready(run(x)), repeats) / count


def aggregate_roofline(n: int, nbytes: int) -> list[float]:
    """Each of the first n devices' HBM read bandwidth (`roofline._xla_sum_Bps` over nbytes on it), B/s."""
    out = []
    for device in jax.devices()[:n]:
        with jax.default_device(device):
            out.append(_xla_sum_Bps(nbytes // 2))
    return out


def measure_tp(ctx: Context, entry: dict, name: str, cfg: ModelConfig, n: int) -> None:
    """One model at TP = n into entry: steps, collectives, bitwise check, end to end (module docstring)."""
    opts = ctx.opts
    mesh = tp_mesh(n)
    t0 = time.perf_counter()
    pieces = random_pieces(cfg, n, opts.seed, opts.lm_head == "int4")
    max_len = opts.context + 2 * ROW_TILE
    engine = Engine(stack(pieces, mesh), cfg, max_len=max_len, k=TP_K, mesh=mesh, prepare=opts.prepare_arg)
    entry.update(tp=n, devices=[d.device_kind for d in mesh.devices.reshape(-1)], build_s=time.perf_counter() - t0)
    params = engine.params  # stacked and prepared: what the Engine runs

    per_device = aggregate_roofline(n, opts.roofline_bytes)
    entry["roofline_Bps_per_device"] = per_device
    roof = entry["roofline_Bps"] = sum(per_device)
    base = mesh_state(cfg, mesh, max_len, opts.context, params["embed"].dtype)
    draft = jnp.asarray(np.random.default_rng(opts.seed + 3).integers(0, cfg.vocab_size, TP_K), jnp.int32)
    t0 = time.perf_counter()
    execs = mesh_steps(params, cfg, mesh, base, draft)
    entry["compile_s"] = time.perf_counter() - t0
    ctx.estimator.observe(entry["compile_s"] / 2, cfg.num_layers)
    chains = {"decode": (execs["decode"], params, copy_tree(base), ())}
    chains["verify"] = (execs["verify"], params, copy_tree(base), (draft,))
    timings = _time_chains(chains, opts.reps, opts.trials, opts.warmup_s)
    for key, rows in (("decode", 1), ("verify", TP_K + 1)):
        seconds, trials, kernels, after_switch, dispatch = timings[key]
        read = step_bytes(params, cfg, base, rows)  # the stacked trees: every device's bytes together
        r = entry[key] = dict(time_s=seconds, trial_times_s=trials, bytes=read, after_switch_time_s=after_switch)
        r.update(dispatch_s=dispatch, achieved_Bps=read["total"] / seconds)
        r["roofline_fraction"] = r["achieved_Bps"] / roof
        if kernels and "groups_us" in kernels:
            r["gpu_kernels_all_devices"] = kernels
            r["per_device_us"] = {g: us / n for g, us in kernels["groups_us"].items()}
            collectives = r["per_device_us"].get("collectives", 0.0)
            r["collectives_share"] = collectives * 1e-6 / seconds
        elif kernels:
            r["gpu_kernels_all_devices"] = kernels  # the profiler's error
    verify = entry["verify"]
    verify["k"] = TP_K
    verify["ratio_vs_decode"] = verify["time_s"] / entry["decode"]["time_s"]
    plain = ctx.report.data["sections"].get("steps", {}).get("models", {}).get(name, {}).get("decode", {})
    if "time_s" in plain:  # the steps section's decode of the whole model on one device, off the mesh
        entry["steps_section_decode_s"] = plain["time_s"]
    del execs, chains, timings

    shapes = dict(all_reduce=(ROW_TILE, cfg.hidden_size), all_gather=(ROW_TILE, cfg.vocab_size // n))
    count = 2 * cfg.num_layers + 1
    each = {kind: collective_s(mesh, shape, kind == "all_gather", count, opts.trials) for kind, shape in shapes.items()}
    entry["collectives"] = dict(
        shapes={kind: list(shape) for kind, shape in shapes.items()},
        seconds_each=each,
        per_step=dict(all_reduce=count, all_gather=1),
        step_s=count * each["all_reduce"] + each["all_gather"],
    )
    entry["collectives"]["share_of_decode"] = entry["collectives"]["step_s"] / entry["decode"]["time_s"]

    prompt = np.random.default_rng(opts.seed + 4).integers(0, cfg.vocab_size, opts.prompt_len).astype(np.int32)
    mismatched = verify_rows_match_decode(params, cfg, prompt, (TP_K,), max_len=max_len, mesh=mesh)
    verify["bitwise_equal_decode"] = ctx.report.check_identity(
        not mismatched[TP_K], f"tp/{name} tp={n}: verify(k={TP_K}) rows != decode rows {mismatched[TP_K]}"
    )
    del engine, params, base
    gc.collect()
    entry["end_to_end"] = end_to_end(ctx, name, n, cfg, mesh, pieces)
    del pieces
    gc.collect()


def end_to_end(ctx: Context, name: str, n: int, cfg: ModelConfig, mesh, pieces: list) -> dict:
    """Greedy and prompt lookup on the on-device loop with the pieces' attention output scaled by --o-factor."""
    opts = ctx.opts
    repeats, new = (1, 8) if opts.quick else (opts.repeats, opts.new_tokens)
    length = 2 * opts.prompt_len + new
    scaled = stack([scale_attention_output(p, opts.o_factor) for p in pieces], mesh)
    max_len = length + new + 16
    engine = Engine(
        scaled, cfg, max_len=max_len, k=TP_K, mesh=mesh, prepare=opts.prepare_arg, prefill_chunk=E2E_PREFILL_CHUNK
    )
    del scaled
    rng = np.random.default_rng(opts.seed + 29)
    p, filler = random_filler(rng, cfg.vocab_size, opts.prompt_len, new, length)
    out = dict(new_tokens=new, prompt_len=length, o_factor=opts.o_factor, loop="on device")
    out["prefill_chunk"] = E2E_PREFILL_CHUNK
    greedy, out["greedy"] = device_decode_rate(engine, filler, new, repeats)
    echo = echo_prompt(p, greedy, None, rng, cfg.vocab_size, length)
    want, out["greedy_echo"] = device_decode_rate(engine, echo, new, repeats)
    tokens, r = device_decode_rate(engine, echo, new, repeats, drafter=PromptLookup())
    r["identical"] = ctx.report.check_identity(tokens == want, f"tp/{name} tp={n}: prompt lookup tokens != greedy")
    r["vacuous"] = r["verify_steps"] == 0  # lookup never drafted: the comparison shows nothing
    r["speedup"] = r["decode_tok_s"] / out["greedy_echo"]["decode_tok_s"]
    out[f"lookup k={TP_K}"] = r
    return out


def section_tp(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    available = jax.device_count()
    # NVLink multicast stays off unless the caller says otherwise: on a shared host it can take the GPUs out of service
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sec["nccl_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    sec.update(plan={name: list(sizes) for name, sizes in TP_PLAN}, device_count=available, models={})
    if available < 2:
        sec.update(status="skipped", reason=f"{available} device: tensor parallelism needs 2 or more (issue 38)")
        return
    for name, sizes in TP_PLAN:
        if name not in opts.models:
            continue
        cfg = tp_config(name, opts.quick)
        for n in sizes:
            label = f"{name} tp={n}"
            if n > available:
                sec["models"][label] = {
                    "status": "skipped",
                    "reason": f"needs {n} devices, this process has {available}",
                }
                continue
            why = ctx.budget.why_not(6 * ctx.estimator.estimate(cfg.num_layers), label)
            if why:
                sec["models"][label] = {"status": "skipped", "reason": why}
                continue
            entry = sec["models"][label] = {"status": "running", "config": cfg.to_dict()}
            try:
                measure_tp(ctx, entry, name, cfg, n)
                d, v, c = entry["decode"], entry["verify"], entry["collectives"]
                print(
                    f"  {label}: decode {d['time_s'] * 1e3:.3f} ms, {100 * d['roofline_fraction']:.1f}% of the "
                    f"{entry['roofline_Bps'] / 1e12:.2f} TB/s of {n} devices; verify(k={TP_K}) "
                    f"{v['ratio_vs_decode']:.3f}x, bitwise {'equal' if v['bitwise_equal_decode'] else 'DIFFERENT'}; "
                    f"collectives alone {c['step_s'] * 1e3:.3f} ms a step ({100 * c['share_of_decode']:.0f}%)",
                    flush=True,
                )
                entry["status"] = "done"
            except Exception as e:
                ctx.report.failed(entry, label, e)
            ctx.report.save()
        decode = {
            n: m["decode"]["time_s"]
            for n in sizes
            if (m := sec["models"].get(f"{name} tp={n}", {})).get("status") == "done"
        }
        if len(decode) > 1:  # each n's decode step against the smallest n's
            first = min(decode)
            sec.setdefault("scaling", {})[name] = {
                f"tp={n} / tp={first}": s / decode[first] for n, s in decode.items() if n != first
            }
