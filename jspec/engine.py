"""Engine: owns the compiled executables of a model and drives generation.

Host loop (default): per (drafter, gate, tie_guard) setting exactly two step executables — the decode round
(decode_step, M=1) and the verify round (verify_step, M=k+1) — plus one prefill executable per prompt-length
bucket. Each is compiled ahead of time once; the loop state is donated, so the KV cache is updated in place.
On-device loop (`on_device=True`): prefill and the whole loop in one executable per bucket
(`jspec.generate.generate_on_device`), with the same rounds and therefore the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.accept import TieGuard
from jspec.config import ModelConfig
from jspec.gate import HitDensityGate
from jspec.generate import LoopSettings, generate_on_device, prefill_round, run_rounds
from jspec.stats import STOP_REASONS, SpecStats
from pallas_kernels import get_backend, prepare_reference, prepare_ws
from pallas_kernels.matmul import prepared_nbytes, reference_prep_fits, ws_prep_nbytes

MIN_BUCKET = 16
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
    """

    def __init__(
        self, params: dict, cfg: ModelConfig, max_len: int, k: int = 4, dtype=None, prepare: bool | None = None
    ):
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len}")
        self.cfg = cfg
        self.max_len = int(max_len)
        self.k = int(k)
        self.dtype = jnp.dtype(dtype or params["embed"].dtype).name
        backend = get_backend()
        self.prepared = resolve_prepare(prepare, params, self.dtype, backend)
        self.params = prepare_params(params, self.dtype, backend) if self.prepared else params
        LoopSettings(max_len=self.max_len, k=self.k)  # validates k
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
        )

    def bucket(self, prompt_len: int) -> int:
        """Padded prompt length: the next power of two >= MIN_BUCKET, capped at max_len."""
        size = MIN_BUCKET
        while size < prompt_len:
            size *= 2
        return min(size, self.max_len)

    def _compile(self, key: tuple, fn, *args, donate: tuple[int, ...] = ()):
        if key not in self._executables:
            lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
            self._executables[key] = lowered.compile(compiler_options=compiler_options())
            self.num_compiles += 1
        return self._executables[key]

    def _request_args(self, bucket: int):
        return (
            jax.ShapeDtypeStruct((bucket,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32),
        )

    def _prefill_exec(self, settings: LoopSettings, bucket: int, n_eos: int):
        fn = functools.partial(prefill_round, cfg=self.cfg, settings=settings)
        eos = jax.ShapeDtypeStruct((n_eos,), jnp.int32)

        def run(params, prompt, length, max_new, eos_ids):
            return fn(params, prompt=prompt, length=length, max_new=max_new, eos_ids=eos_ids)

        return self._compile(("prefill", settings, bucket, n_eos), run, self.params, *self._request_args(bucket), eos)

    def _round_exec(self, kind: str, settings: LoopSettings, loop_shape):
        """The executable running up to N rounds of one kind (decode or verify): one graph slot per kind."""

        def run(params, loop, max_rounds):
            return run_rounds(params, self.cfg, settings, loop, max_rounds, verify=kind == "verify")

        rounds = jax.ShapeDtypeStruct((), jnp.int32)
        return self._compile(
            (kind, settings, jax.tree.structure(loop_shape)), run, self.params, loop_shape, rounds, donate=(1,)
        )

    def _device_exec(self, settings: LoopSettings, bucket: int, eos_ids: tuple[int, ...]):
        def run(params, prompt, length, max_new):
            return generate_on_device(params, self.cfg, prompt, length, max_new, settings, eos_ids)

        return self._compile(("device", settings, bucket, eos_ids), run, self.params, *self._request_args(bucket))

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
        eos_ids = () if eos_id is None else (eos_id,) if isinstance(eos_id, int) else tuple(int(e) for e in eos_id)
        settings = self.settings(drafter, gate, tie_guard)
        bucket = self.bucket(prompt.size)
        padded = np.zeros((bucket,), np.int32)
        padded[: prompt.size] = prompt
        args = (self.params, padded, np.int32(prompt.size), np.int32(max_new))
        stats = SpecStats(prompt_tokens=int(prompt.size), exact=settings.tie_guard.exact)
        if on_device:
            run = self._device_exec(settings, bucket, eos_ids)
            start = time.perf_counter()
            out = jax.device_get(run(*args))
            stats.wall_time_s = time.perf_counter() - start
            tokens = out.tokens[: int(out.num_tokens)]
            self._fill_stats(stats, out.counters, int(out.stop_reason), len(tokens), settings)
            return GenerationResult([int(t) for t in tokens], stats)
        return self._host_loop(settings, bucket, args, eos_ids, stats, progress, rounds_per_call)

    def _host_loop(
        self, settings, bucket, args, eos_ids, stats: SpecStats, progress: bool, rounds_per_call: int
    ) -> GenerationResult:
        eos = np.asarray(list(eos_ids) or [-1], np.int32)
        prefill_exec = self._prefill_exec(settings, bucket, eos.size)
        loop_shape = prefill_exec.out_info
        decode_exec = self._round_exec("decode", settings, loop_shape)
        verify_exec = self._round_exec("verify", settings, loop_shape) if settings.drafter is not None else None
        start = time.perf_counter()
        loop = prefill_exec(*args, eos)
        bar = _progress_bar(int(args[3])) if progress else None
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
        tokens_all, counters, prompt_len = jax.device_get((loop.state.tokens, loop.counters, loop.prompt_len))
        tokens = tokens_all[int(prompt_len) : int(prompt_len) + int(n_out)]
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


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="generating", leave=False)


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
