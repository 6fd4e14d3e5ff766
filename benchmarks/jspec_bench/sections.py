"""The sections of `jspec bench`, in priority order (`REGISTRY`); each checks the remaining `--budget-s` before it
starts (and before each model or sub-step), and whatever is skipped is recorded in the JSON with the reason:
  roofline     HBM read bandwidth: the best of torch `x.sum()` and XLA `jnp.sum` over a 2 GB bf16 array.
  steps        decode_step and verify_step (k = 1, 3, 7, 15) at the Qwen2.5-14B and Llama-3-8B shapes: time (median
               over trials of back-to-back calls of a jitted step with donated state), bytes read, % of the roofline,
               verify/decode ratio (= the break-even mean_accepted), compiles, and a bitwise check that verify row i
               equals the decode step at position + i.
  e2e          Engine tok/s at the Llama-3-8B shape: greedy vs PromptLookup (gate on and off; host loop and on-device
               loop) on echo prompts (see `e2e.echo_prompt`) whose echo pattern sets the acceptance from ~1 to ~k + 1
               tokens per verify; every run's tokens are compared with plain greedy.
  other_steps  decode_step and verify_step (k = 7) at the other shapes: Qwen2.5-7B, GLM-4-9B, the bundled demo model.
  peer         (--peer-hf) HuggingFace transformers, bf16 eager (greedy timed with a static cache),
               `prompt_lookup_num_tokens`, at the Qwen2.5-7B shape: tok/s, and whether its prompt-lookup output
               equals its own greedy output on the same (dynamic) cache.
  prefill      long prompts (jspec_bench.prefill): time to first token, TFLOP/s against the bf16 peak measured in
               the same run, peak memory, a chunk-size sweep, transformers' prefill (--peer-hf), and speculation on
               a long echo prompt.
  sampling     jspec.Sampler (jspec_bench.sampling): the sampler's cost alone and in the decode step, and prompt
               lookup under sampling against plain sampling with the same seed (tokens compared).
  draft_model  jspec.DraftModel (jspec_bench.draft_model): a draft-model round's cost at the e2e shape with a
               Llama-3.2-1B-shaped drafter against a decode step (the break-even mean_accepted), tokens compared.
  batch        Engine.generate_batch (jspec_bench.batch): greedy decode tok/s at batch sizes 1, 4, 16, 64 and
               prompt lookup at 4 and 8 (k = 3, 7) on echo prompts, every sequence compared with its own run.
  hybrid       Qwen3.5-style hybrids at full depth (jspec_bench.hybrid): decode and verify (k = 1, 2, 3), the
               recurrent kernel's fixed cost, and on the on-device loop greedy, prompt lookup and MTP, tokens compared.
  tp_shard     one shard of a TP = 2 layout of each step model (jspec_bench.tp_shard) timed alone on one GPU, its
               collectives counted and sized, the TP step predicted at assumed collective latencies.
  tp           tensor parallelism on the devices of the host (jspec_bench.tp; 2 or more): Qwen2.5-14B at TP = 1, 2
               and Llama-3-70B at TP = 2, 4: decode and verify(k = 7) on the mesh against the aggregate roofline,
               the collectives alone and in the profile, verify rows == decode rows, greedy and prompt lookup
               end to end (tokens compared), the scaling of the decode step with TP.
A section is a function `section(ctx: Context, sec: dict)` that fills `sec`, its dict in the results JSON; adding one
is one line in `REGISTRY`, which `--sections` (its choices and default order) and `main` read."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jspec_bench.batch import section_batch
from jspec_bench.draft_model import section_draft_model
from jspec_bench.e2e import section_e2e
from jspec_bench.hybrid import section_hybrid
from jspec_bench.peer import section_peer
from jspec_bench.prefill import section_prefill
from jspec_bench.report import Context
from jspec_bench.roofline import section_roofline
from jspec_bench.sampling import section_sampling
from jspec_bench.steps import section_other_steps, section_steps
from jspec_bench.tp import section_tp
from jspec_bench.tp_shard import section_tp_shard


class Section(NamedTuple):
    run: Callable[[Context, dict], None]
    min_s: float  # the budget a section needs left to start (a tenth of it in quick mode)


REGISTRY: dict[str, Section] = {  # in priority order
    "roofline": Section(section_roofline, 5.0),
    "steps": Section(section_steps, 30.0),
    "e2e": Section(section_e2e, 60.0),
    "other_steps": Section(section_other_steps, 30.0),
    "peer": Section(section_peer, 60.0),
    "prefill": Section(section_prefill, 60.0),
    "sampling": Section(section_sampling, 30.0),
    "draft_model": Section(section_draft_model, 30.0),
    "batch": Section(section_batch, 60.0),
    "hybrid": Section(section_hybrid, 120.0),
    "tp_shard": Section(section_tp_shard, 60.0),
    "tp": Section(section_tp, 120.0),
}
SECTIONS = tuple(REGISTRY)
SECTION_FUNCS = {name: s.run for name, s in REGISTRY.items()}
SECTION_MIN_S = {name: s.min_s for name, s in REGISTRY.items()}
