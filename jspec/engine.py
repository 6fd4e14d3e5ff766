"""Engine: owns the compiled executables of a model and drives generation.

Host loop (default): per (drafter, gate, tie_guard) setting one executable per loop stage, each compiled ahead of
time once, whatever the prompt: start (a fresh state holding the prompt, padded to max_len), prefill chunks (up to
N chunks of `prefill_chunk` positions per call), the first round, decode rounds (decode_step, M=1) and verify
rounds (verify_step, M=k+1). The loop state is donated, so the KV cache is updated in place.
On-device loop (`on_device=True`): prefill and the whole loop in one executable
(`jspec.generate.generate_on_device`), with the same rounds and therefore the same tokens.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.accept import TieGuard
from jspec.config import ModelConfig
from jspec.gate import HitDensityGate
from jspec.generate import (
    MAX_EOS_IDS,
    LoopSettings,
    eos_array,
    first_round,
    generate_on_device,
    prefill_rounds,
    run_rounds,
    start_loop,
)
from jspec.stats import STOP_REASONS, SpecStats
from jspec.steps import PREFILL_CHUNK
from pallas_kernels import get_backend, prepare_reference, prepare_ws
from pallas_kernels.matmul import prepared_nbytes, reference_prep_fits, ws_prep_nbytes

ROUNDS_PER_CALL = 16  # the host loop's rounds per device call (Engine.generate's rounds_per_call)
# XLA options for the executables on a GPU: launch every run of ops, however short, and the on-device loop's
# while / conditional, as CUDA graphs (command buffers). They change how kernels are launched, never what they
# compute. A step is ~550 small kernels, so launches matter: on the H200 (Llama-3-8B shape) greedy ran 350 vs 322
# tok/s on device and 326 vs 304 in the host loop (benchmarks/results/launch_options_h200.json).
GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


def compiler_options(platform: str | None = None) -> dict | None:
    """The XLA options jspec compiles with on `platform` (default: the default backend's): GPU_COMPILER_OPTIONS on
    a GPU, none elsewhere. For a caller's own jit of `generate_on_device`: jax.jit(f, compiler_options=...)."""
    return dict(GPU_COMPILER_OPTIONS) if (platform or jax.default_backend()) == "gpu" else None


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens only
    stats: SpecStats


class Engine:
    """Compiles and runs generation for one model (params, cfg) with caches of max_len positions.

    k: the draft length verified per verify step (1 <= k <= ROW_TILE - 1).
    prepare: prepare the int4 weights once for the kernel backend. "reference" (CPU): dequantize them
      (`pallas_kernels.prepare_reference`: same bits, more memory) instead of in every step; "pallas" (GPU) with
      bfloat16 activations: hand every symmetric one whose N fits to the warp-specialized Mosaic GPU kernel
      (`pallas_kernels.prepare_ws`: a re-ordered copy, K padded to 256, faster than the Triton kernel). None:
      `prepares_by_default` (both of those), unless the copy would not fit (`prep_shortfall`: over a quarter of
      physical memory for the reference halves, more than the device's free memory for the codes): then a warning
      says so and the weights stay as they are. `self.prepared` records the choice.
    prefill_chunk: prompt positions per prefill chunk, one static shape for every prompt (None:
      `default_prefill_chunk(max_len)`). A prompt of T tokens runs ceil(T / prefill_chunk) chunks; only the last
      is padded. Prefill memory is the chunk's activations plus the cache, whatever T.
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
    ):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        self.cfg = cfg
        self.max_len = int(max_len)
        self.k = int(k)
        self.prefill_chunk = default_prefill_chunk(self.max_len) if prefill_chunk is None else int(prefill_chunk)
        LoopSettings(max_len=self.max_len, k=self.k, prefill_chunk=self.prefill_chunk)  # validates k and the chunk
        if self.max_len > cfg.max_position_embeddings:
            warnings.warn(
                f"max_len {self.max_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}: "
                "it was never trained on positions past that, so text there may degrade (the cache and rotary "
                "embedding run at any position)",
                stacklevel=2,
            )
        self.dtype = jnp.dtype(dtype or params["embed"].dtype).name
        backend = get_backend()
        self.prepared = resolve_prepare(prepare, params, self.dtype, backend)
        self.params = prepare_params(params, self.dtype, backend) if self.prepared else params
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self.num_compiles = 0

    # ----------------------------------------------------------------------------------------------- compile
    def settings(self, drafter=None, gate: HitDensityGate | None = None, tie_guard: TieGuard | None = None):
        return LoopSettings(
            max_len=self.max_len,
            k=self.k,
            dtype=self.dtype,
            drafter=drafter,
            gate=gate,
            tie_guard=tie_guard or TieGuard(),
            prefill_chunk=self.prefill_chunk,
        )

    def _compile(self, key: tuple, fn, *args, donate: tuple[int, ...] = ()):
        if key not in self._executables:
            lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
            self._executables[key] = lowered.compile(compiler_options=compiler_options())
            self.num_compiles += 1
        return self._executables[key]

    def _request_args(self):
        """Shapes of a request: the prompt padded to max_len, its length, max_new_tokens, the EOS ids."""
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        prompt = jax.ShapeDtypeStruct((self.max_len,), jnp.int32)
        return prompt, scalar, scalar, jax.ShapeDtypeStruct((MAX_EOS_IDS,), jnp.int32)

    def _start_exec(self, settings: LoopSettings):
        def run(params, prompt, length, max_new, eos_ids):
            return start_loop(params, self.cfg, settings, prompt, length, max_new, eos_ids)

        return self._compile(("start", settings), run, self.params, *self._request_args())

    def _loop_exec(self, kind: str, settings: LoopSettings, loop_shape):
        """The executable of one loop stage: up to N prefill chunks, the first round, or up to N rounds of one kind
        (decode or verify). Each kind has its own executable; the loop state is donated."""
        counted = jax.ShapeDtypeStruct((), jnp.int32)
        if kind == "first":
            return self._compile(
                (kind, settings),
                lambda params, loop: first_round(params, self.cfg, settings, loop),
                self.params,
                loop_shape,
                donate=(1,),
            )

        def run(params, loop, n):
            if kind == "prefill":
                return prefill_rounds(params, self.cfg, settings, loop, n)
            return run_rounds(params, self.cfg, settings, loop, n, verify=kind == "verify")

        return self._compile((kind, settings), run, self.params, loop_shape, counted, donate=(1,))

    def _device_exec(self, settings: LoopSettings):
        def run(params, prompt, length, max_new, eos_ids):
            return generate_on_device(params, self.cfg, prompt, length, max_new, settings, eos_ids)

        return self._compile(("device", settings), run, self.params, *self._request_args())

    # ------------------------------------------------------------------------------------------------ generate
    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int | None) -> tuple[np.ndarray, int]:
        """Validate a request before any compute; returns (prompt int32 array, max_new_tokens)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError("empty prompt: at least one token is needed")
        bad = prompt[(prompt < 0) | (prompt >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} out of range for vocab_size {self.cfg.vocab_size}")
        room = self.max_len - prompt.size
        if room < 1:
            raise ValueError(f"prompt of {prompt.size} tokens leaves no room in the cache: max_len is {self.max_len}")
        if max_new_tokens is None:  # until the cache is full: the last token is produced but never fed back
            return prompt.astype(np.int32), room + 1
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if max_new_tokens > room:
            raise ValueError(
                f"prompt of {prompt.size} tokens + max_new_tokens {max_new_tokens} = "
                f"{prompt.size + max_new_tokens} exceeds the cache: max_len is {self.max_len}"
            )
        return prompt.astype(np.int32), int(max_new_tokens)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int | None = None,
        drafter=None,
        gate: HitDensityGate | None = None,
        eos_id: int | Sequence[int] | None = None,
        tie_guard: TieGuard | None = None,
        on_device: bool = False,
        progress: bool = False,
        rounds_per_call: int = ROUNDS_PER_CALL,
    ) -> GenerationResult:
        """Generate greedily (drafter=None) or speculatively; the tokens are the same either way.

        max_new_tokens None: until the cache is full (max_len - len(prompt) + 1 tokens).
        eos_id: stop after this token (or any of these tokens).
        on_device: run prefill and the whole loop as one executable instead of the host loop.
        progress: show a progress bar (host loop).
        rounds_per_call: the most rounds the host loop runs in one device call. A call runs rounds of one kind
          (decode or verify) and returns early when the loop asks for the other kind or stops; every call costs
          a launch and a sync (progress, stop check), so longer calls are faster. 1: one round per call.
        """
        if rounds_per_call < 1:
            raise ValueError(f"rounds_per_call must be >= 1, got {rounds_per_call}")
        prompt, max_new = self.check_request(prompt_ids, max_new_tokens)
        eos = eos_array(eos_id)
        settings = self.settings(drafter, gate, tie_guard)
        padded = np.zeros((self.max_len,), np.int32)
        padded[: prompt.size] = prompt
        args = (self.params, padded, np.int32(prompt.size), np.int32(max_new), eos)
        stats = SpecStats(prompt_tokens=int(prompt.size), exact=settings.tie_guard.exact)
        if on_device:
            run = self._device_exec(settings)
            start = time.perf_counter()
            out = jax.device_get(run(*args))
            stats.wall_time_s = time.perf_counter() - start
            tokens = out.tokens[: int(out.num_tokens)]
            self._fill_stats(stats, out.counters, int(out.stop_reason), len(tokens), settings)
            return GenerationResult([int(t) for t in tokens], stats)
        return self._host_loop(settings, args, stats, progress, rounds_per_call)

    def _host_loop(self, settings, args, stats: SpecStats, progress: bool, rounds_per_call: int) -> GenerationResult:
        start_exec = self._start_exec(settings)
        loop_shape = start_exec.out_info
        prefill_exec = self._loop_exec("prefill", settings, loop_shape)
        first_exec = self._loop_exec("first", settings, loop_shape)
        decode_exec = self._loop_exec("decode", settings, loop_shape)
        verify_exec = self._loop_exec("verify", settings, loop_shape) if settings.drafter is not None else None
        prompt_len = int(args[2])
        chunks = -(-prompt_len // settings.prefill_chunk)
        start = time.perf_counter()
        loop = start_exec(*args)
        if progress and chunks > 1:  # one chunk per call, so the bar moves
            bar = _progress_bar(prompt_len, "prefill", "tok")
            for _ in range(chunks):
                loop = prefill_exec(self.params, loop, np.int32(1))
                bar.update(int(jax.device_get(loop.prefilled)) - bar.n)
            bar.close()
        else:
            loop = prefill_exec(self.params, loop, np.int32(chunks))
        loop = first_exec(self.params, loop)
        bar = _progress_bar(int(args[3]), "generating", "tok") if progress else None
        use_verify, stop, n_out = jax.device_get((loop.use_verify, loop.stop, loop.n_out))
        stats.prefill_time_s = time.perf_counter() - start
        rounds = np.int32(rounds_per_call)
        while stop == 0:
            t0 = time.perf_counter()
            kind_verify = bool(use_verify)
            loop = (verify_exec if kind_verify else decode_exec)(self.params, loop, rounds)
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
        tokens = tokens_all[prompt_len : prompt_len + int(n_out)]
        self._fill_stats(stats, counters, int(stop), len(tokens), settings)
        return GenerationResult([int(t) for t in tokens], stats)

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


def default_prefill_chunk(max_len: int) -> int:
    """`jspec.steps.PREFILL_CHUNK` positions, or max_len rounded up to 16 when the cache is shorter (a short engine
    pays no more padding than its cache holds)."""
    return min(PREFILL_CHUNK, -(-max_len // 16) * 16)


def prepares_by_default(backend: str, dtype: str) -> bool:
    """Whether Engine(prepare=None) prepares the int4 weights: on the reference backend, and on the GPU ("pallas")
    with bfloat16 activations, where the Mosaic GPU kernel (`prepare_ws`) is the faster one."""
    return backend == "reference" or (backend == "pallas" and dtype == "bfloat16")


def resolve_prepare(prepare: bool | None, params, dtype: str, backend: str) -> bool:
    """Engine's `prepare` argument -> whether to prepare. None: `prepares_by_default`, declined with a warning when
    the prepared copy would not fit (`prep_shortfall`)."""
    if prepare is not None:
        return bool(prepare)
    if not prepares_by_default(backend, dtype):
        return False
    short = prep_shortfall(params, dtype, backend)
    if short:
        warnings.warn(f"{short}; pass prepare=True to use it anyway or prepare=False to silence this", stacklevel=3)
    return not short


def prep_shortfall(params, dtype: str, backend: str) -> str | None:
    """Why the default preparation would not fit in memory (None: it fits or cannot be checked)."""
    if backend == "reference" and not reference_prep_fits(params, dtype):
        need = prepared_nbytes(params, dtype) / 2**30
        return (
            f"int4 weights are dequantized in every step (slower): their prepared copy ({need:.1f} GiB) would take "
            "over a quarter of this machine's memory"
        )
    free = device_free_bytes() if backend == "pallas" else None
    if free is None:
        return None
    need = ws_prep_nbytes(params)
    if need <= free:
        return None
    return (
        f"the int4 weights stay on the Triton kernel (slower): preparing them for the Mosaic GPU kernel "
        f"needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB is free"
    )


def device_free_bytes() -> int | None:
    """Free bytes of the default device's allocator (None where it reports no statistics)."""
    stats = jax.devices()[0].memory_stats()
    return stats["bytes_limit"] - stats["bytes_in_use"] if stats and "bytes_limit" in stats else None


def prepare_params(params, dtype: str, backend: str):
    """The one-time int4 preparation for a kernel backend (see Engine's `prepare`)."""
    if backend == "reference":
        return prepare_reference(params, dtype)
    if backend == "pallas" and dtype == "bfloat16":
        return prepare_ws(params)
    raise ValueError(f"prepare=True: no int4 preparation for the {backend!r} kernel backend with {dtype} activations")


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
