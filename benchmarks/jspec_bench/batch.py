"""The `batch` section: `Engine.generate_batch` at the e2e model's shape (Llama-3-8B, int4, random weights).

1. Greedy at batch_size B = 1, 4, 16, 64 (--batch-sizes): B prompts of --prompt-len tokens, --new-tokens each,
   one batch (no refill): decode tokens/s of the batch (its prefills excluded: each fill is timed to completion)
   and the ratio to B = 1. The contract (an identity check): `CHECKED` of the sequences, each run again alone in
   the same engine (the other slots empty), give the same tokens. A fact, not a requirement (docs/design.md rule
   9): whether every sequence's tokens equal those of the B = 1 engine (`same_as_b1_engine`; a B-slot engine runs
   other shapes and, where its slots fill the GPU, another attention partition: `attention_one_split`,
   `jspec.batch.one_split`). One round as an executable of its own (`round_alone`): its time against the loop's
   round and, on the GPU, its kernels by group (int4 kernels, attention, XLA ops) and the top kernels' HLO
   sources; and the int4 products of one layer and the lm_head at 16 .. 128 rows: several row tiles per launch
   against one.
   Each B's tokens/s also against `Engine.generate` of the first prompt alone (`vs_engine_generate`, host loop,
   prefill excluded alike): the B = 1 engine of generate_batch runs a slot's bookkeeping a plain step does not.
2. Prompt lookup at B = 4 and 8 with k = 3 and 7 on the e2e section's echo prompts (each slot its own prompt):
   tokens/s against greedy at the same B, mean_accepted; every sequence's tokens against the engine's greedy
   batch (speculative == greedy, an identity check).
3. With --peer-hf: HuggingFace transformers' batched greedy generate at the same shape, each batch size right after
   jspec's (bf16, sdpa, a StaticCache; the prompts share one length, so no padding), decode tokens/s as (N + n)
   minus (N + 1) tokens; `greedy.<B>.transformers` and `vs_transformers`.
The attention output is scaled as in e2e (--o-factor) so the random model's continuation follows the echo.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from jspec.batch import batch_round, one_split
from jspec.drafters import PromptLookup
from jspec.engine import Engine
from jspec_bench.e2e import echo_prompt, random_filler
from jspec_bench.peer import _hf_generate
from jspec_bench.report import Context, _error_text
from jspec_bench.shapes import hf_config_dict, scale_attention_output
from jspec_bench.steps import _load_model
from jspec_bench.timing import _time_chain, describe_kernels, kernel_times, profile
from pallas_kernels import ROW_TILE

CHECKED = 3  # sequences per batch size run again alone in the same engine
LOOKUP = ((4, 3), (4, 7), (8, 3), (8, 7))  # (batch size, k)


def _decode_rate(result) -> dict:
    s = result.stats
    decode_s = s.wall_time_s - s.prefill_time_s
    return {
        "new_tokens": s.new_tokens,
        "wall_s": s.wall_time_s,
        "prefill_s": s.prefill_time_s,
        "decode_tok_s": s.new_tokens / decode_s,
        "ms_per_round": 1e3 * decode_s / s.rounds if s.rounds else None,  # a batch step, host loop included
        "rounds": s.rounds,
        "slot_occupancy": s.slot_occupancy,
        "mean_accepted": _mean_accepted(result),
    }


def _mean_accepted(result) -> float:
    verify = sum(r.stats.verify_steps for r in result.results)
    accepted = sum(r.stats.accepted for r in result.results)
    return (accepted + verify) / verify if verify else 0.0


def section_batch(ctx: Context, sec: dict) -> None:
    opts = ctx.opts
    name = opts.e2e_model
    if name not in opts.models:
        sec.update(status="partial", reason=f"--models does not include {name}")
        return
    params, cfg, info = _load_model(ctx, name)
    params = scale_attention_output(params, opts.o_factor)
    sec.update(model=name, source=info["source"], o_factor=opts.o_factor)
    n, plen = (8, 16) if opts.quick else (opts.new_tokens, opts.prompt_len)
    sizes = opts.batch_sizes
    lookups = ((2, 3),) if opts.quick else LOOKUP
    length = 2 * plen + n
    max_len = length + n + 16
    rng = np.random.default_rng(opts.seed + 23)
    prompts = [
        random_filler(rng, cfg.vocab_size, plen, n, length) for _ in range(max(sizes + tuple(b for b, _ in lookups)))
    ]
    single = Engine(params, cfg, max_len=max_len, k=7, prepare=opts.prepare_arg)
    alone = {}

    def greedy_alone(i: int, prompt) -> list[int]:
        if i not in alone:
            alone[i] = single.generate(prompt, n, eos_id=()).tokens
        return alone[i]

    try:
        sec["int4_rows"] = _int4_rows(single.params)
    except Exception as e:  # the profiler is an add-on: record why, go on
        sec["int4_rows"] = {"error": _error_text(e)}
    ctx.report.save()
    peer = _HFBatches(ctx, name) if opts.peer_hf else None
    greedy_alone(0, prompts[0][1])  # warm
    one = single.generate(prompts[0][1], n, eos_id=()).stats
    decode_s = one.wall_time_s - one.prefill_time_s
    sec["engine_generate"] = {  # one sequence without a batch: the B = 1 a user has without generate_batch
        "new_tokens": one.new_tokens,
        "decode_tok_s": one.new_tokens / decode_s,
        "ms_per_step": 1e3 * decode_s / (one.decode_steps + one.verify_steps),
    }
    sec["greedy"] = {}
    base = None
    for b in sizes:
        why = ctx.budget.why_not(10.0 if opts.quick else 40.0, f"batch greedy B={b}")
        if why:
            sec["greedy"][str(b)] = {"status": "skipped", "reason": why}
            continue
        engine = Engine(params, cfg, max_len=max_len, k=7, prepare=opts.prepare_arg, batch_size=b)
        batch = [prompts[i][1] for i in range(b)]
        engine.generate_batch(batch, n, eos_id=())  # warm: compile
        t0 = time.perf_counter()
        out = engine.generate_batch(batch, n, eos_id=())
        r = sec["greedy"][str(b)] = _decode_rate(out) | {"elapsed_s": time.perf_counter() - t0}
        picks = sorted({0, b // 2, b - 1})[:CHECKED]  # first, middle and last slot
        own = [
            engine.generate_batch([batch[i]], n, eos_id=()).results[0].tokens == out.results[i].tokens for i in picks
        ]
        r["checked_alone_in_engine"] = picks
        r["attention_one_split"] = one_split(cfg, b)
        r["identical"] = ctx.report.check_identity(all(own), f"batch/greedy B={b}: a sequence differs run alone")
        r["same_as_b1_engine"] = sum(out.results[i].tokens == greedy_alone(i, batch[i]) for i in range(b))
        base = r["decode_tok_s"] if b == 1 else base
        r["vs_b1"] = r["decode_tok_s"] / base if base else None
        r["vs_engine_generate"] = r["decode_tok_s"] / sec["engine_generate"]["decode_tok_s"]
        try:
            r["round_alone"] = _round_alone(ctx, engine, batch, n)
            r["round_alone"]["loop_vs_alone"] = r["ms_per_round"] / r["round_alone"]["ms"]
        except Exception as e:  # an add-on measurement: record why, keep the batch's own figures
            r["round_alone"] = {"error": _error_text(e)}
        print(
            f"  batch greedy B={b}: {r['decode_tok_s']:.0f} tok/s decode"
            + (f" ({r['vs_b1']:.2f}x B=1)" if r["vs_b1"] else "")
            + f", alone in the engine identical: {r['identical']}; tokens of the B=1 engine: "
            f"{r['same_as_b1_engine']}/{b}",
            flush=True,
        )
        ctx.report.save()
        engine = None  # noqa: F841
        gc.collect()
        if peer is not None:
            r["transformers"] = peer.run(b, batch, n)
            if "decode_tok_s" in r["transformers"]:
                r["vs_transformers"] = r["decode_tok_s"] / r["transformers"]["decode_tok_s"]
            ctx.report.save()
    if peer is not None:
        sec["peer_hf"] = peer.info
    sec["lookup"] = {}
    for b, k in lookups:
        why = ctx.budget.why_not(10.0 if opts.quick else 40.0, f"batch lookup B={b} k={k}")
        if why:
            sec["lookup"][f"B={b} k={k}"] = {"status": "skipped", "reason": why}
            continue
        echoes = [
            echo_prompt(p, greedy_alone(i, filler), None, rng, cfg.vocab_size, length)
            for i, (p, filler) in enumerate(prompts[:b])
        ]
        engine = Engine(params, cfg, max_len=max_len, k=k, prepare=opts.prepare_arg, batch_size=b)
        runs = {}
        for label, drafter in (("greedy", None), ("lookup", PromptLookup())):
            engine.generate_batch(echoes, n, drafter=drafter, eos_id=())  # warm
            runs[label] = engine.generate_batch(echoes, n, drafter=drafter, eos_id=())
        want = [r.tokens for r in runs["greedy"].results]
        same = all(r.tokens == w for r, w in zip(runs["lookup"].results, want, strict=True))
        g, s = _decode_rate(runs["greedy"]), _decode_rate(runs["lookup"])
        sec["lookup"][f"B={b} k={k}"] = {
            "greedy": g,
            "lookup": s,
            "speedup": s["decode_tok_s"] / g["decode_tok_s"],
            "identical": ctx.report.check_identity(same, f"batch/lookup B={b} k={k}: tokens differ from greedy"),
        }
        print(
            f"  batch lookup B={b} k={k}: {s['decode_tok_s']:.0f} tok/s, {s['decode_tok_s'] / g['decode_tok_s']:.2f}x "
            f"batch greedy (mean_accepted {s['mean_accepted']:.2f}), identical {same}",
            flush=True,
        )
        ctx.report.save()
        engine = None  # noqa: F841
        gc.collect()


def _round_alone(ctx: Context, engine: Engine, batch: list, n: int) -> dict:
    """One greedy round of the B-slot batch as an executable of its own (`jspec.batch.batch_round` jitted alone,
    the batch donated), its slots filled with `batch`'s prompts by the engine's own fill executable, timed chained
    like the steps (`_time_chain`): `ms` per round and, on the GPU, its kernels by group and the top kernels with
    the HLO source of each fusion. The rounds' while loop is not profiled: inside it the XLA profiler kept 11-14%
    of a round's kernels on the H200 at every B (7 rounds as 63), where a step's own executable keeps them all. A
    slot that reaches its n new tokens stops and its rows still run (their results dropped), so every round costs
    the same."""
    import jax

    settings = engine.settings()
    weights = engine._checked_weights(settings)  # Engine internals, read-only: the executables generate_batch runs
    empty, fill, _ = engine._batch_execs(settings, weights)
    state = empty(weights)
    for slot, prompt in enumerate(batch):
        state = fill(weights, state, np.int32(slot), *engine.request(prompt, n, eos_id=()).loop_args(engine.max_len))

    def one_round(weights, state):
        new = batch_round(weights[0], engine.shard_cfg, settings, state, weights[1])
        return new, new.n_out

    fn = jax.jit(one_round, donate_argnums=1)
    compiled = fn.lower(weights, state).compile()
    opts = ctx.opts
    timed = _time_chain(compiled, weights, state, (), opts.reps, opts.trials, opts.warmup_s)
    kernels = timed.kernels
    out = {"ms": 1e3 * timed.seconds, "gpu_kernels": kernels}
    if kernels and "top_kernels_us" in kernels:  # where the round's XLA fusions come from
        out["top_kernels_source"] = describe_kernels(compiled.as_text(), kernels["top_kernels_us"])
    return out


def _int4_rows(params: dict) -> dict | None:
    """GPU time of the int4 products of one layer (and the lm_head) against the rows they take: R = 16 .. 128 rows
    through `matmul.tiles_matmul` (several row tiles per launch where the kernel allows), against R / 16 launches
    of one tile. None off the GPU or without Int4Codes weights."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import matmul
    from pallas_kernels.int4_ws import Int4Codes

    layer = params["layers"][0]
    weights = {name: w for name, w in layer.items() if isinstance(w, Int4Codes)}
    if isinstance(params.get("lm_head"), Int4Codes):
        weights["lm_head"] = params["lm_head"]
    if jax.default_backend() != "gpu" or not weights:
        return None
    tiled = jax.jit(lambda x, ws: {k: matmul.tiles_matmul(x[k], w) for k, w in ws.items()})

    @jax.jit
    def alone(x, ws):  # one launch per row tile
        return {
            k: [matmul.rows_matmul(x[k][i : i + ROW_TILE], w) for i in range(0, len(x[k]), ROW_TILE)]
            for k, w in ws.items()
        }

    out = {}
    for rows in (ROW_TILE, 4 * ROW_TILE, 8 * ROW_TILE):
        x = {name: jnp.ones((rows, w.shape[0]), jnp.bfloat16) for name, w in weights.items()}
        r = {}
        for label, fn in (("tiles_matmul", tiled), ("one_tile_launches", alone)):
            jax.block_until_ready(fn(x, weights))
            times = kernel_times(profile(lambda f=fn, x=x: jax.block_until_ready(f(x, weights))), 1)
            r[label] = times["groups_us"]
            r[label + "_us"] = times["kernel_us"]
        r["ratio"] = r["tiles_matmul_us"] / r["one_tile_launches_us"]
        out[str(rows)] = r
        print(
            f"  int4 rows={rows}: {r['tiles_matmul_us']:.0f} us tiles_matmul vs {r['one_tile_launches_us']:.0f} us "
            f"one tile per launch ({sorted(weights)})",
            flush=True,
        )
    return out


class _HFBatches:
    """transformers' batched greedy generate (bf16, sdpa, StaticCache) at the e2e model's shape: the model is built
    at the first run; `run(b, prompts, n)` -> decode tokens/s of the batch from two runs, n and 1 new tokens (the
    prefill cancels), or why it was skipped."""

    def __init__(self, ctx: Context, name: str):
        import torch
        import transformers

        self.ctx, self.name, self.model, self.config = ctx, name, None, None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.info = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "setup": "bf16, sdpa, StaticCache",
        }

    def run(self, b: int, prompts: list, n: int) -> dict:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        why = self.ctx.budget.why_not(5.0 if self.ctx.opts.quick else 30.0, f"transformers batch B={b}")
        if why:
            return {"status": "skipped", "reason": why}
        if self.model is None:
            hf = hf_config_dict(self.name, self.ctx.opts.quick)
            self.config = AutoConfig.for_model(hf.pop("model_type"), **hf)
            torch.manual_seed(self.ctx.opts.seed)
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(
                    self.config, attn_implementation="sdpa", dtype=torch.bfloat16
                ).eval()
        ids = np.stack(prompts) % self.config.vocab_size
        cache = ids.shape[1] + n + 1  # one cache length: one compiled forward for the three runs
        _hf_generate(self.model, self.config, ids, n, None, self.device, cache_len=cache)  # warm: compile
        _, one_s = _hf_generate(self.model, self.config, ids, 1, None, self.device, cache_len=cache)
        _, full_s = _hf_generate(self.model, self.config, ids, n, None, self.device, cache_len=cache)
        out = {"decode_tok_s": b * (n - 1) / (full_s - one_s), "wall_s": full_s, "first_token_s": one_s}
        print(f"  transformers batch B={b}: {out['decode_tok_s']:.0f} tok/s decode", flush=True)
        return out
