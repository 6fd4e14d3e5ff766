"""Engine: owns the compiled executables of a model and drives generation.

Host loop (default): per (drafter, gate, tie_guard, sampler mode) setting one executable per loop stage, each
compiled ahead of time once, whatever the prompt: start (a fresh state holding the prompt, padded to max_len),
prefill chunks (up to N chunks of one shape per call; one executable per chunk shape), the first round, decode
rounds (decode_step, M=1) and verify rounds (verify_step, M=k+1). The loop state is donated, so the KV cache is
updated in place.
On-device loop (`on_device=True`): prefill and the whole loop in one executable
(`jspec.loop.generate_on_device`), with the same rounds and therefore the same tokens.
Batches (`generate_batch`): `batch_size` slots share every step (`jspec.batch`); three executables per setting
(empty slots, a prompt into one slot, up to N rounds of every slot), a slot that stops taking the next prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import checks, tensor_parallel
from jspec.accept import TieGuard
from jspec.batch import empty_batch, fill_slot, run_batch_rounds
from jspec.config import ModelConfig
from jspec.gate import HitDensityGate
from jspec.loop import (
    MAX_EOS_IDS,
    LoopSettings,
    eos_array,
    first_round,
    generate_on_device,
    prefill_rounds,
    run_rounds,
    start_loop,
)
from jspec.memory import check_fits, tree_bytes
from jspec.models import with_activation_dtype
from jspec.sampling import Sampler
from jspec.stats import STOP_REASONS, BatchStats, SpecStats
from jspec.steps import PREFILL_CHUNK, chunk_sizes, tail_size
from pallas_kernels import ROW_TILE, get_backend
from pallas_kernels.prepare import prepare_params, prepared_nbytes, resolve_prepare, ws_prep_nbytes

ROUNDS_PER_CALL = 16  # the host loop's rounds per device call (Engine.generate's rounds_per_call)
# XLA options for the executables on a GPU. CUDA graphs (command buffers) for every run of ops, however short, and
# for the on-device loop's while / conditional: they change how kernels are launched, never what they compute, and a
# step is ~550 small kernels, so launches matter: on the H200 (Llama-3-8B shape) greedy ran 350 vs 322 tok/s on
# device and 326 vs 304 in the host loop (docs/performance.md, history). And XLA's own products (prefill's) on
# cuBLAS with its heuristic algorithm, never autotuned: XLA would pick each one's Triton tiling or cuBLAS algorithm by
# timing it while compiling, and one prompt's prefill bits, so its tokens, changed from process to process
# (docs/design.md, rule 10; docs/exactness.md). Autotuning off alone leaves XLA's default Triton tiling, 7.6-10.7x
# slower prefill on the H100; with cuBLAS, prefill took 0.95x the autotuned time (Qwen3.5, 4096 tokens). And the
# prefill's dynamic-slice copies on the main stream (XLA's pass that makes them async, 24 a chunk on 4 more streams,
# disabled): once a process has run an executable with them, every later decode step runs slower, ~7% at the Qwen3.5
# shape (H100, a fresh process each: the generation 2.95 -> 2.75 ms a token; docs/performance.md, "process state").
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
    "xla_gpu_autotune_level": 0,
    "xla_gpu_enable_triton_gemm": False,
    "xla_disable_hlo_passes": "dynamic-slice-copy-fusion-async-wrapper",
}


def compiler_options(platform: str | None = None) -> dict | None:
    """The XLA options jspec compiles with on `platform` (default: the default backend's): GPU_COMPILER_OPTIONS on
    a GPU, none elsewhere. For a caller's own jit of `generate_on_device`: jax.jit(f, compiler_options=...)."""
    return dict(GPU_COMPILER_OPTIONS) if (platform or jax.default_backend()) == "gpu" else None


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    stats: SpecStats


@dataclasses.dataclass
class BatchResult:
    """What `Engine.generate_batch` returns: one GenerationResult per prompt, in input order, and the batch's stats."""

    results: list[GenerationResult]
    stats: BatchStats


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: prompt int32 [P], max_new_tokens, EOS ids int32 [MAX_EOS_IDS] (-1 padded)."""

    prompt: np.ndarray
    max_new: int
    eos: np.ndarray

    def loop_args(self, max_len: int) -> tuple:
        """(prompt padded to max_len, its length, max_new_tokens, EOS ids): a request's arguments of the loop's
        executables."""
        padded = np.zeros((max_len,), np.int32)
        padded[: self.prompt.size] = self.prompt
        return padded, np.int32(self.prompt.size), np.int32(self.max_new), self.eos


def _cast_bytes(before, after) -> int:
    """Bytes of the arrays of `after` whose dtype differs from `before`'s (the same tree, as shapes): a cast's copy."""
    pairs = zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    return sum(tree_bytes(new) for old, new in pairs if old.dtype != new.dtype)


class Engine:
    """Compiles and runs generation for one model (params, cfg) with caches of max_len positions.

    k: the draft length verified per verify step (1 <= k <= ROW_TILE - 1).
    dtype: activations and cache, "float32" or "bfloat16" (None: the embedding's dtype).
    prepare: prepare the int4 weights once for the kernel backend. "reference" (CPU): dequantize them
      (`pallas_kernels.prepare_reference`: same bits, more memory) instead of in every step; "pallas" (GPU) with
      bfloat16 activations: hand every symmetric one whose N fits to the warp-specialized Mosaic GPU kernel
      (`pallas_kernels.prepare_ws`: a re-ordered copy, K padded to 256, faster than the Triton kernel). None:
      both of those unless the copy would not fit (`pallas_kernels.prepare.resolve_prepare`: over a quarter of
      physical memory for the reference halves, more than the device's free memory for the codes): then a warning
      says so and the weights stay as they are. `self.prepared` records the choice. The Mosaic GPU kernel's
      weights are the format's bits for scales in `pallas_kernels.int4_ws.SCALE_RANGE` ([2^-110, 2^11)); a weight
      with others raises ValueError naming it (prepare=False keeps every weight on the Triton kernel).
    prefill_chunk: the largest prefill chunk (positions; None: `default_prefill_chunk(max_len)`). A prompt of T
      tokens runs T // prefill_chunk chunks of it, then its rest in the smallest of `jspec.steps.chunk_sizes` that
      holds it (prefill_chunk and its halves, 5 shapes at most): one executable per shape, the tail the only padding.
      Prefill memory is the chunk's activations plus the cache, whatever T. Another prefill_chunk runs other
      shapes, so its prefill bits and the tokens after them may differ (docs/design.md rule 10).
    batch_size: the sequence slots of `generate_batch` (each its own cache of max_len positions, allocated once
      per batch); `generate` runs one sequence whatever it is.
    mesh: None, or a one-axis device mesh (`jax.make_mesh((n,), ("tp",))`): tensor parallelism over its n devices
      (`jspec.tensor_parallel`; params unsharded, or stacked on that mesh by `checkpoints.load_hf(..., mesh=)`).
      Every executable runs each device on its shard; memory is planned per device.

    Construction checks every argument and what a generation will allocate (`jspec.memory`: the loop state and a
    prefill chunk's activations against the free memory), before allocating or compiling anything.
    """

    def __init__(
        self,
        params: dict,
        cfg: ModelConfig,
        max_len: int,
        k: int = 4,
        dtype=None,
        prepare: bool | None = None,
        prefill_chunk: int | None = None,
        batch_size: int = 1,
        mesh=None,
    ):
        checks.instance(cfg, ModelConfig, "cfg", "a jspec.ModelConfig", optional=False)
        if not isinstance(params, dict) or "embed" not in params:
            raise TypeError(f"params must be the dict of a model's weights (with 'embed'), got {type(params).__name__}")
        self.cfg = cfg
        self.max_len = checks.integer(max_len, "max_len", lo=2)
        self.k = checks.integer(k, "k", lo=1, hi=ROW_TILE - 1)
        self.batch_size = checks.integer(batch_size, "batch_size", lo=1)
        chunk = default_prefill_chunk(self.max_len) if prefill_chunk is None else prefill_chunk
        self.prefill_chunk = checks.integer(chunk, "prefill_chunk", lo=1)
        checks.instance(prepare, bool, "prepare", "True, False or None")
        self.dtype = jnp.dtype(dtype or params["embed"].dtype).name
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        if self.max_len > cfg.max_position_embeddings:
            warnings.warn(
                f"max_len {self.max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}: "
                "it was never trained on positions past that, so text there may degrade (the cache and rotary "
                "embedding run at any position)",
                stacklevel=2,
            )
        self.mesh = mesh
        self.shard_cfg = cfg  # the config each device runs: cfg, or on a mesh one shard's
        if mesh is not None:
            self.shard_cfg = tensor_parallel.shard_config(cfg, tensor_parallel.mesh_size(mesh))
        stacked = tensor_parallel.is_stacked(params, mesh)
        shapes = jax.eval_shape(lambda p: with_activation_dtype(p, self.dtype), params)  # computes in self.dtype
        local = self._shard_shapes(shapes)
        cast = _cast_bytes(self._shard_shapes(params), local)
        backend = get_backend()
        self.prepared = resolve_prepare(prepare, local, self.dtype, backend)
        prep = ws_prep_nbytes(local) if backend == "pallas" else prepared_nbytes(local, self.dtype)
        self._check_memory(shapes, self.settings(), prepared_weights=prep if self.prepared else 0, cast_weights=cast)
        params = with_activation_dtype(params, self.dtype)
        if mesh is not None and not stacked:
            params = tensor_parallel.shard_params(params, cfg, mesh)
        if self.prepared:
            prepare_one = lambda p: prepare_params(p, self.dtype, backend)  # noqa: E731
            params = prepare_one(params) if mesh is None else tensor_parallel.map_shards(prepare_one, params, mesh)
        self.params = params
        self._drafter_weights: tuple = (None, None)  # (a drafter's weights, as prepared): the last one used
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._memory_checked: set[LoopSettings] = set()
        self.num_compiles = 0

    # ----------------------------------------------------------------------------------------------- compile
    def settings(
        self,
        drafter=None,
        gate: HitDensityGate | None = None,
        tie_guard: TieGuard | None = None,
        sampler: Sampler | None = None,
    ) -> LoopSettings:
        """The LoopSettings of a request (drafter, gate, tie_guard and sampler checked; a sampler contributes only
        its static part, `Sampler.mode`)."""
        methods = ("init", "prefill", "propose")
        if drafter is not None and (
            isinstance(drafter, type) or not all(callable(getattr(drafter, m, None)) for m in methods)
        ):
            raise TypeError(
                "drafter must be a Drafter (jspec.PromptLookup(), jspec.MTPDrafter() or an object with init, prefill "
                f"and propose), got {type(drafter).__name__} {drafter!r}"
            )
        try:
            hash(drafter)
        except TypeError:
            raise TypeError(
                f"drafter {drafter!r} must be hashable (a frozen dataclass): it keys the executables"
            ) from None
        if callable(getattr(drafter, "check_target", None)):  # a drafter model: its vocabulary and positions
            drafter.check_target(self.cfg, self.max_len)
        checks.instance(gate, HitDensityGate, "gate", "a jspec.HitDensityGate or None")
        checks.instance(tie_guard, TieGuard, "tie_guard", "a jspec.TieGuard or None")
        checks.instance(sampler, Sampler, "sampler", "a jspec.Sampler or None")
        return LoopSettings(
            max_len=self.max_len,
            k=self.k,
            dtype=self.dtype,
            drafter=drafter,
            gate=gate,
            tie_guard=tie_guard or TieGuard(),
            prefill_chunk=self.prefill_chunk,
            sampling=None if sampler is None else sampler.mode,
        )

    def _check_memory(
        self, params, settings: LoopSettings, prepared_weights: int = 0, own=None, cast_weights: int = 0
    ) -> None:
        """Raise MemoryBudgetError if a generation with these settings, in every one of the batch_size slots,
        would not fit (`jspec.memory`; on a mesh, one device's shard). cast_weights: the bytes of the params' copy
        in the Engine's dtype, where theirs differs."""
        shapes = jax.eval_shape(
            lambda p, o, *request: start_loop(p, self.shard_cfg, settings, *request, own=o),
            self._shard_shapes(params),
            own,
            *self._request_args(settings),
        )
        slots = self.batch_size
        per_position = slots * tree_bytes(shapes) / self.max_len
        parts = {
            f"loop state (KV cache, token history, drafter) x {slots} slot(s)": slots * tree_bytes(shapes),
            f"a {self.prefill_chunk}-position prefill chunk": prefill_chunk_bytes(
                self.shard_cfg, self.prefill_chunk, self.dtype
            ),
            "prepared int4 weights": prepared_weights,
            f"the weights cast to {self.dtype}": cast_weights,
        }
        check_fits(
            parts,
            f"Engine(max_len={self.max_len}, {self.dtype}, batch_size={slots})",
            f"lower max_len (about {per_position / 1024:.1f} KiB a position), batch_size or the prefill chunk",
        )

    def _shard_shapes(self, params):
        """params as each device holds them: themselves, or on a mesh one shard's shapes (computing nothing)."""
        if self.mesh is None:
            return params
        return tensor_parallel.local_shapes(params, self.cfg, self.shard_cfg.tensor_parallel)

    def _compile(self, key: tuple, fn, *args, donate: tuple[int, ...] = (), out=tensor_parallel.LOOP_SPECS):
        """Compile fn(weights, *rest) once per key. On a mesh every device runs it on its shard: the weights'
        params stacked, Loops and DecodeStates by `tensor_parallel.specs_of`; out: the result's specs."""
        if key not in self._executables:
            if self.mesh is not None:
                weights = (tensor_parallel.SHARDED, tensor_parallel.REPLICATED)
                specs = (weights, *map(tensor_parallel.specs_of, args[1:]))
                fn = tensor_parallel.on_mesh(fn, self.mesh, specs, out)
            # keep_unused: every argument stays a parameter, so a donated Loop leaf aliases its own output. With
            # unused leaves pruned JAX pairs donated buffers with other outputs of the same shape (the first round's
            # executable crossed its int32 scalars), and on the H200 that executable, donated, returned a wrong n_out
            # (docs/exactness.md, the host-loop MTP fault).
            lowered = jax.jit(fn, donate_argnums=donate, keep_unused=True).lower(*args)
            self._executables[key] = lowered.compile(compiler_options=compiler_options())
            self.num_compiles += 1
        return self._executables[key]

    def _request_args(self, settings: LoopSettings):
        """Shapes of a request: the prompt padded to max_len, its length, max_new_tokens, the EOS ids (and, when
        sampling, the sampler's values)."""
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        prompt = jax.ShapeDtypeStruct((self.max_len,), jnp.int32)
        args = (prompt, scalar, scalar, jax.ShapeDtypeStruct((MAX_EOS_IDS,), jnp.int32))
        if settings.sampling is None:
            return args
        return (*args, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), Sampler().values()))

    def _weights(self, drafter) -> tuple:
        """The executables' runtime weights: (params, the drafter's own weights or None). The drafter's are prepared
        as the Engine's `prepare` decides for its own dtype (`resolve_prepare`); the last drafter's prepared copy is
        kept, so a drafter reused across requests is prepared once."""
        own = getattr(drafter, "weights", None)
        if own is None:
            return self.params, None
        if self._drafter_weights[0] is not own:
            # a model's weights run in its embedding's dtype; a head's (MTPDrafter.over) in the engine's
            dtype = jnp.dtype(own["embed"].dtype).name if "embed" in own else self.dtype
            backend = get_backend()
            mine = with_activation_dtype(own, dtype)
            prepare = resolve_prepare(None if self.prepared else False, mine, dtype, backend)
            mine = prepare_params(mine, dtype, backend) if prepare else mine
            self._drafter_weights = (own, mine if self.mesh is None else tensor_parallel.replicate(mine, self.mesh))
        return self.params, self._drafter_weights[1]

    def _checked_weights(self, settings: LoopSettings) -> tuple:
        """`_weights` for the settings' drafter, after checking (once per setting) that a generation fits."""
        weights = self._weights(settings.drafter)
        if settings not in self._memory_checked:
            self._check_memory(self.params, settings, own=weights[1])
            self._memory_checked.add(settings)
        return weights

    def _start_exec(self, settings: LoopSettings, weights: tuple):
        def run(weights, prompt, length, max_new, eos_ids, sampler=None):
            params, own = weights
            return start_loop(params, self.shard_cfg, settings, prompt, length, max_new, eos_ids, sampler, own)

        return self._compile(("start", settings), run, weights, *self._request_args(settings))

    def _loop_exec(self, kind: str, settings: LoopSettings, weights: tuple, loop_shape):
        """The executable of one loop stage: up to N prefill chunks, the first round, or up to N rounds of one kind
        (decode or verify). Each kind has its own executable; the loop state is donated."""
        counted = jax.ShapeDtypeStruct((), jnp.int32)
        if kind == "first":
            return self._compile(
                (kind, settings),
                lambda weights, loop: first_round(weights[0], self.shard_cfg, settings, loop, weights[1]),
                weights,
                loop_shape,
                donate=(1,),
            )

        def run(weights, loop, n):
            params, own = weights
            if kind.startswith("prefill"):  # "prefill<size>": chunks of one shape
                size = int(kind.removeprefix("prefill"))
                return prefill_rounds(params, self.shard_cfg, settings, loop, n, size, own)
            return run_rounds(params, self.shard_cfg, settings, loop, n, verify=kind == "verify", own=own)

        return self._compile((kind, settings), run, weights, loop_shape, counted, donate=(1,))

    def _device_exec(self, settings: LoopSettings, weights: tuple):
        def run(weights, prompt, length, max_new, eos_ids, sampler=None):
            params, own = weights
            return generate_on_device(params, self.shard_cfg, prompt, length, max_new, settings, eos_ids, sampler, own)

        args = (weights, *self._request_args(settings))
        return self._compile(("device", settings), run, *args, out=tensor_parallel.REPLICATED)

    def _batch_execs(self, settings: LoopSettings, weights: tuple):
        """(empty slots, a request into one slot, up to N rounds of every slot) for batch_size slots."""
        b = self.batch_size
        empty = self._compile(
            ("batch-empty", settings, b),
            lambda weights: empty_batch(weights[0], self.shard_cfg, settings, b, weights[1]),
            weights,
        )
        shape = empty.out_info
        scalar = jax.ShapeDtypeStruct((), jnp.int32)

        def fill(weights, batch, slot, prompt, length, max_new, eos_ids, sampler=None):
            params, own = weights
            return fill_slot(
                params, self.shard_cfg, settings, batch, slot, prompt, length, max_new, eos_ids, sampler, own
            )

        fill_exec = self._compile(
            ("batch-fill", settings, b), fill, weights, shape, scalar, *self._request_args(settings), donate=(1,)
        )

        def rounds(weights, batch, n, until_a_stop):
            return run_batch_rounds(weights[0], self.shard_cfg, settings, batch, n, until_a_stop, weights[1])

        flag = jax.ShapeDtypeStruct((), jnp.bool_)
        out = (tensor_parallel.LOOP_SPECS, tensor_parallel.REPLICATED)  # (the batch, its occupancy)
        rounds_exec = self._compile(
            ("batch-rounds", settings, b), rounds, weights, shape, scalar, flag, donate=(1,), out=out
        )
        return empty, fill_exec, rounds_exec

    # ------------------------------------------------------------------------------------------------ generate
    def request(self, prompt_ids, max_new_tokens: int | None = None, eos_id=None) -> Request:
        """Check a request before any compute (see `generate` for the arguments) -> Request."""
        prompt = checks.token_ids(prompt_ids, "prompt_ids", self.cfg.vocab_size)
        room = self.max_len - prompt.size
        if room < 1:
            raise ValueError(f"prompt of {prompt.size} tokens leaves no room in the cache: max_len is {self.max_len}")
        if max_new_tokens is None:  # until the cache is full: the last token is produced but never fed back
            max_new = room + 1
        else:
            max_new = checks.integer(max_new_tokens, "max_new_tokens", lo=1)
            if max_new > room:
                raise ValueError(
                    f"prompt of {prompt.size} tokens + max_new_tokens {max_new} = {prompt.size + max_new} exceeds "
                    f"the cache: max_len is {self.max_len}"
                )
        return Request(prompt, max_new, eos_array(eos_id, self.cfg))

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int | None = None,
        *,
        drafter=None,
        gate: HitDensityGate | None = None,
        sampler: Sampler | None = None,
        eos_id: int | Sequence[int] | None = None,
        tie_guard: TieGuard | None = None,
        on_device: bool = False,
        progress: bool = False,
        rounds_per_call: int = ROUNDS_PER_CALL,
    ) -> GenerationResult:
        """Generate greedily (drafter=None) or speculatively; the tokens are the same either way.

        prompt_ids: one 1-D sequence of token ids. max_new_tokens None: until the cache is full
        (max_len - len(prompt) + 1 tokens).
        sampler: None (greedy) or a `jspec.Sampler`: sampled tokens, the same for a seed with any drafter.
        eos_id: stop after this token or any of these tokens; None: the model's own (`cfg.eos_token_ids`); ():
          never stop at a token.
        on_device: run prefill and the whole loop as one executable instead of the host loop.
        progress: show progress bars (prefill chunks, new tokens; host loop).
        rounds_per_call: the most rounds the host loop runs in one device call. A call runs rounds of one kind
          (decode or verify) and returns early when the loop asks for the other kind or stops; every call costs
          a launch and a sync (progress, stop check), so longer calls are faster. 1: one round per call.
        """
        run = self._run(
            prompt_ids, max_new_tokens, dict(drafter=drafter, gate=gate, sampler=sampler, tie_guard=tie_guard),
            eos_id, on_device, progress, rounds_per_call, emit=False,
        )  # fmt: skip
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None, **options):
        """`generate` (same options) as a generator: yields each device call's newly committed tokens (list[int])
        as they come (the on-device loop: all of them at the end) and returns the GenerationResult
        (StopIteration.value)."""
        known = ("drafter", "gate", "sampler", "tie_guard", "eos_id", "on_device", "progress", "rounds_per_call")
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"stream() got unknown options {unknown}; it takes {', '.join(known)}")
        setting = {key: options.get(key) for key in ("drafter", "gate", "sampler", "tie_guard")}
        return (
            yield from self._run(
                prompt_ids,
                max_new_tokens,
                setting,
                options.get("eos_id"),
                options.get("on_device", False),
                options.get("progress", False),
                options.get("rounds_per_call", ROUNDS_PER_CALL),
                emit=True,
            )
        )

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int] | None = None,
        *,
        drafter=None,
        gate: HitDensityGate | None = None,
        sampler: Sampler | Sequence[Sampler] | None = None,
        eos_id: int | Sequence[int] | None = None,
        progress: bool = False,
        rounds_per_call: int = ROUNDS_PER_CALL,
    ) -> BatchResult:
        """Generate for every prompt, batch_size at a time: each step runs every occupied slot; a slot whose
        sequence stops takes the next prompt (prefilled into it) while the others go on. Each sequence's tokens
        are those `generate` gives it alone (docs/design.md, rule 9): whatever the other slots hold, with or
        without a drafter.

        prompts: a non-empty list of token-id sequences (more than batch_size is fine). max_new_tokens: one for
        all, or one per prompt (None: until the cache is full). sampler: None (greedy), one Sampler for all, or one
        per prompt (their seeds and values may differ, not their processors: `Sampler.mode`). drafter, gate,
        eos_id: as `generate` (one for the batch; the drafter and gate run per slot). progress: a bar over new
        tokens. rounds_per_call: the most rounds per device call (a call also ends when a slot stops while
        prompts wait). A bad prompt raises naming its index, before anything runs. -> BatchResult, in input order.
        """
        if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of token-id sequences, got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("generate_batch: the prompt list is empty")
        n = len(prompts)
        budgets = _per_prompt(max_new_tokens, n, "max_new_tokens", (int, np.integer, type(None)))
        samplers = _per_prompt(sampler, n, "sampler", (Sampler, type(None)))
        rounds_per_call = checks.integer(rounds_per_call, "rounds_per_call", lo=1)
        checks.instance(progress, bool, "progress", "True or False", optional=False)
        requests = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            try:
                requests.append(self.request(prompt, budget, eos_id))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        modes = [None if s is None or s.greedy else s.mode for s in samplers]
        if any(m != modes[0] for m in modes):
            i = next(i for i, m in enumerate(modes) if m != modes[0])
            raise ValueError(
                f"sampler {i}'s processors ({modes[i]}) differ from sampler 0's ({modes[0]}): one batch runs one set "
                "of processors (greedy or a Sampler.mode); the values and seeds may differ per prompt"
            )
        settings = self.settings(drafter=drafter, gate=gate, sampler=None if modes[0] is None else samplers[0])
        weights = self._checked_weights(settings)
        empty, fill, rounds = self._batch_execs(settings, weights)
        b = self.batch_size
        stats = BatchStats(sequences=n, batch_size=b)
        results: list[GenerationResult | None] = [None] * n
        queue, holder, began = collections.deque(range(n)), [None] * b, {}
        bar = _progress_bar(sum(r.max_new for r in requests), "generating", "tok") if progress else None
        start = time.perf_counter()
        batch = empty(weights)
        while True:
            for slot in range(b):
                if holder[slot] is None and queue:
                    i = queue.popleft()
                    values = () if settings.sampling is None else (samplers[i].values(),)
                    began[i] = time.perf_counter()
                    batch = fill(weights, batch, np.int32(slot), *requests[i].loop_args(self.max_len), *values)
                    jax.block_until_ready(batch.n_out)
                    stats.prefill_time_s += time.perf_counter() - began[i]
                    holder[slot] = i
            if all(i is None for i in holder):
                break
            batch, occupancy = rounds(weights, batch, np.int32(rounds_per_call), np.bool_(bool(queue)))
            stop, n_out, occupancy = jax.device_get((batch.stop, batch.n_out, occupancy))
            stats.rounds += int(occupancy.rounds)
            stats.slot_rounds += int(occupancy.slot_rounds)
            finished = [slot for slot, i in enumerate(holder) if i is not None and stop[slot] != 0]
            if finished:
                history, counters = jax.device_get((batch.state.tokens, batch.counters))
            for slot in finished:
                i, r = holder[slot], requests[holder[slot]]
                tokens = [int(t) for t in history[slot, r.prompt.size : r.prompt.size + int(n_out[slot])]]
                seq = SpecStats(prompt_tokens=int(r.prompt.size), exact=True, loop="batch")
                seq.sampler = None if samplers[i] is None else dataclasses.asdict(samplers[i])
                seq.wall_time_s = time.perf_counter() - began[i]
                self._fill_stats(seq, jax.tree.map(lambda c, s=slot: c[s], counters), int(stop[slot]), len(tokens),
                                 settings)  # fmt: skip
                results[i] = GenerationResult(tokens, seq)
                stats.new_tokens += len(tokens)
                holder[slot] = None
            if bar is not None:
                live = sum(int(n_out[slot]) for slot, i in enumerate(holder) if i is not None)
                bar.update(stats.new_tokens + live - bar.n)
        if bar is not None:
            bar.close()
        stats.wall_time_s = time.perf_counter() - start
        return BatchResult(results, stats)

    def _run(self, prompt_ids, max_new_tokens, setting: dict, eos_id, on_device, progress, rounds_per_call, *, emit):
        rounds_per_call = checks.integer(rounds_per_call, "rounds_per_call", lo=1)
        checks.instance(on_device, bool, "on_device", "True or False", optional=False)
        checks.instance(progress, bool, "progress", "True or False", optional=False)
        request = self.request(prompt_ids, max_new_tokens, eos_id)
        settings = self.settings(**setting)
        weights = self._checked_weights(settings)
        sampler = setting["sampler"]
        values = () if settings.sampling is None else (sampler.values(),)
        args = (weights, *request.loop_args(self.max_len), *values)
        stats = SpecStats(prompt_tokens=int(request.prompt.size), exact=settings.tie_guard.exact)
        stats.sampler = None if sampler is None else dataclasses.asdict(sampler)
        if on_device:
            stats.loop = "device"
            run = self._device_exec(settings, weights)
            start = time.perf_counter()
            out = jax.device_get(run(*args)).raise_if_error()
            stats.wall_time_s = time.perf_counter() - start
            tokens = [int(t) for t in out.tokens[: int(out.num_tokens)]]
            self._fill_stats(stats, out.counters, int(out.stop_reason), len(tokens), settings)
            if emit:
                yield tokens
            return GenerationResult(tokens, stats)
        return (yield from self._host_loop(settings, args, stats, progress, rounds_per_call, emit))

    def _host_loop(self, settings, args, stats: SpecStats, progress: bool, rounds_per_call: int, emit: bool):
        weights = args[0]
        start_exec = self._start_exec(settings, weights)
        loop_shape = start_exec.out_info
        prompt_len = int(args[2])
        plan = prefill_plan(prompt_len, settings.prefill_chunk)
        prefill_execs = {size: self._loop_exec(f"prefill{size}", settings, weights, loop_shape) for size, _ in plan}
        first_exec = self._loop_exec("first", settings, weights, loop_shape)
        decode_exec = self._loop_exec("decode", settings, weights, loop_shape)
        verify_exec = None
        if settings.drafter is not None:
            verify_exec = self._loop_exec("verify", settings, weights, loop_shape)
        start = time.perf_counter()
        loop = start_exec(*args)
        bar = _progress_bar(prompt_len, "prefill", "tok") if progress and sum(n for _, n in plan) > 1 else None
        for size, count in plan:
            for n in [1] * count if bar else [count]:  # with a bar: one chunk per call, so the bar moves
                loop = prefill_execs[size](weights, loop, np.int32(n))
                if bar is not None:
                    bar.update(int(jax.device_get(loop.prefilled)) - bar.n)
        if bar is not None:
            bar.close()
        loop = first_exec(weights, loop)
        bar = _progress_bar(int(args[3]), "generating", "tok") if progress else None
        use_verify, stop, n_out = jax.device_get((loop.use_verify, loop.stop, loop.n_out))
        stats.prefill_time_s = time.perf_counter() - start
        emitted = 0
        rounds = np.int32(rounds_per_call)
        while True:
            if emit and n_out > emitted:  # the calls' new tokens, in order (the last call's after the loop stopped)
                history = np.asarray(jax.device_get(loop.state.tokens))  # whole: a slice would compile per length
                yield [int(t) for t in history[prompt_len + emitted : prompt_len + n_out]]
                emitted = int(n_out)
            if stop != 0:
                break
            t0 = time.perf_counter()
            kind_verify = bool(use_verify)
            loop = (verify_exec if kind_verify else decode_exec)(weights, loop, rounds)
            use_verify, stop, n_out = jax.device_get((loop.use_verify, loop.stop, loop.n_out))
            elapsed = time.perf_counter() - t0
            if kind_verify:
                stats.verify_time_s += elapsed
            else:
                stats.decode_time_s += elapsed
            if bar is not None:
                bar.update(int(n_out) - bar.n)
        if bar is not None:
            bar.close()
        stats.wall_time_s = time.perf_counter() - start
        tokens_all, counters = jax.device_get((loop.state.tokens, loop.counters))
        tokens = [int(t) for t in tokens_all[prompt_len : prompt_len + int(n_out)]]
        self._fill_stats(stats, counters, int(stop), len(tokens), settings)
        return GenerationResult(tokens, stats)

    @staticmethod
    def _fill_stats(stats: SpecStats, counters, stop: int, n_tokens: int, settings: LoopSettings) -> None:
        c = jax.device_get(counters)
        stats.steps = int(c.steps)
        stats.decode_steps = int(c.decode_steps)
        stats.verify_steps = int(c.verify_steps)
        stats.drafted = int(c.drafted)
        stats.accepted = int(c.accepted)
        reached = np.asarray(c.position_reached)
        stats.per_position_acceptance = [
            float(a) / float(r) if r else None for a, r in zip(np.asarray(c.position_accepted), reached, strict=True)
        ]
        stats.per_position_reached = [int(r) for r in reached]
        stats.near_tie_rejections = int(c.near_ties)
        stats.tolerated_near_ties = int(c.tolerated)
        stats.exact = settings.tie_guard.exact or stats.tolerated_near_ties == 0
        stats.gate_engaged = int(c.gate_engaged) if settings.gate is not None else None
        stats.would_hits = int(c.would_hits)
        stats.new_tokens = n_tokens
        stats.stop_reason = STOP_REASONS[stop]


def _per_prompt(value, n: int, name: str, kinds: tuple) -> list:
    """One value for all n prompts, or a sequence of n values (one per prompt) -> a list of n."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts (give one, or one per prompt)")
        values = list(value)
    else:
        values = [value] * n
    for i, v in enumerate(values):
        if not isinstance(v, kinds) or isinstance(v, bool):
            raise TypeError(f"{name} {i}: {v!r} is not a {' or '.join(k.__name__ for k in kinds)}")
    return values


def prefill_chunk_bytes(cfg: ModelConfig, chunk: int, dtype: str) -> int:
    """A bound on one prefill chunk's live activations: a few [chunk, max(2I, qkv)] rows in the activation dtype,
    float32 partial products, and one [Hq, chunk, 256] float32 block of attention scores (the jnp path)."""
    width = max(2 * cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    rows = chunk * width * (2 * jnp.dtype(dtype).itemsize + 4)
    return int(rows + cfg.num_heads * chunk * 256 * 4 * 2)


def prefill_plan(length: int, chunk: int) -> list[tuple[int, int]]:
    """[(chunk shape, how many)] of a prompt of `length` tokens: full chunks of `chunk`, then the rest in the
    smallest shape of `chunk_sizes(chunk)` that holds it (`jspec.steps.run_chunks`, the same on device)."""
    full, rest = divmod(length, chunk)
    plan = [(chunk, full)] if full else []
    return plan + [(tail_size(chunk_sizes(chunk), rest), 1)] if rest else plan


def default_prefill_chunk(max_len: int) -> int:
    """`jspec.steps.PREFILL_CHUNK` positions, or max_len rounded up to 16 when the cache is shorter (a short engine
    pays no more padding than its cache holds)."""
    return min(PREFILL_CHUNK, -(-max_len // 16) * 16)


def _progress_bar(total: int, desc: str, unit: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc=desc, leave=False)


def generate(
    params: dict,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int = 32,
    drafter=None,
    gate: HitDensityGate | None = None,
    eos_id: int | Sequence[int] | None = None,
    k: int = 4,
    max_len: int | None = None,
    **kwargs,
) -> GenerationResult:
    """Convenience: build an Engine (max_len defaults to prompt + max_new_tokens) and generate once."""
    max_len = max_len or len(prompt_ids) + max_new_tokens
    engine = Engine(params, cfg, max_len=max_len, k=k)
    return engine.generate(prompt_ids, max_new_tokens, drafter=drafter, gate=gate, eos_id=eos_id, **kwargs)
