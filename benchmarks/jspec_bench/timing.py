"""Clocks of the bench: the wall-clock `Budget`, the XLA compile counter and compile-time estimator, concurrent
compiles (`run_parallel`), median timers (`torch_median`: the one torch timer, which benchmarks/*.py import too),
the XLA profiler's GPU kernel times (`profile`, `kernel_times`) and `_time_chains`, the timing of jitted steps
chained on their donated states, in interleaved trials."""

from __future__ import annotations

import concurrent.futures
import functools
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax

from jspec_bench.report import _error_text


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


def device_decode_rate(engine, prompt, n: int, repeats: int, **kwargs) -> tuple[list[int], dict]:
    """(tokens, decode rates) of an Engine's on-device generation of n tokens: warm, then the wall of n tokens minus
    that of 1 (the prefill and the first token cancel), median of `repeats`."""
    engine.generate(prompt, n, eos_id=(), on_device=True, **kwargs)  # warm: compile

    def wall(tokens: int):
        t0 = time.perf_counter()
        result = engine.generate(prompt, tokens, eos_id=(), on_device=True, **kwargs)
        return time.perf_counter() - t0, result

    decode_s = statistics.median(wall(n)[0] - wall(1)[0] for _ in range(repeats))
    _, result = wall(n)
    s = result.stats
    rounds = s.decode_steps + s.verify_steps
    return result.tokens, {
        "decode_tok_s": (len(result.tokens) - 1) / decode_s,
        "ms_per_token": 1e3 * decode_s / (len(result.tokens) - 1),
        "ms_per_round": 1e3 * decode_s / max(rounds, 1),
        "mean_accepted": s.mean_accepted,
        "verify_steps": s.verify_steps,
        "decode_steps": s.decode_steps,
    }


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


# Kernel-name substrings of the GPU time groups a step's kernels are summed into (first match wins; else "XLA ops").
KERNEL_GROUPS = (
    ("int4 Mosaic GPU", ("int4_ws",)),
    ("int4 Triton", ("int4_rows", "dense_rows")),
    # under jax.vmap (jspec.batch) a Mosaic GPU kernel is named batched_body (jax's pallas/mosaic_gpu/core.py): of
    # those the batch executables vmap the attention split kernel alone (int4_ws batches rows by custom_vmap)
    ("attention", ("jspec_attention", "batched_body")),
    ("recurrent", ("jspec_gdn",)),
    ("collectives", ("nccl",)),  # a tensor-parallel step's all-reduces and all-gather (NCCL's kernels)
)
TOP_KERNELS = 24  # the costliest kernels a profile names (`kernel_times`' top_kernels_us)


def stream_events(profile):
    """The kernel events of each stream line on the GPU planes of a `jax.profiler.ProfileData`, one list per line,
    in start order."""
    for plane in profile.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    yield sorted(line.events, key=lambda e: e.start_ns)


def kernel_times(profile, calls: int) -> dict:
    """GPU kernel time per call from a `jax.profiler.ProfileData` of `calls` calls: every kernel event on the GPU
    planes' stream lines, summed by name and by `KERNEL_GROUPS` group, in microseconds per call; and where the
    stream stood idle between its first and last kernel (the part of a step's wall its kernels do not fill:
    launch gaps), in total and by the kernel each gap came before (`idle_before_us`)."""
    by_name: dict[str, float] = {}
    idle_before: dict[str, float] = {}
    launches = 0
    for events in stream_events(profile):
        end = None
        for event in events:
            by_name[event.name] = by_name.get(event.name, 0.0) + event.duration_ns / 1e3 / calls
            launches += 1
            if end is not None and event.start_ns > end:
                gap = (event.start_ns - end) / 1e3 / calls
                idle_before[event.name] = idle_before.get(event.name, 0.0) + gap
            end = max(end or 0, event.end_ns)
    groups: dict[str, float] = {}
    for name, us in by_name.items():
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "XLA ops")
        groups[group] = groups.get(group, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {
        "kernel_us": round(sum(by_name.values()), 1),
        "launches": launches // calls,
        "groups_us": {g: round(us, 1) for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels_us": {name[:80]: round(us, 1) for name, us in top},
        "idle_us": round(sum(idle_before.values()), 1),
        "idle_before_us": {
            name[:80]: round(us, 1) for name, us in sorted(idle_before.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        },
    }


def describe_kernels(hlo_text: str, names) -> dict:
    """{kernel name: "<shape> <kind>: <op_name>"} for the profiler's kernel `names` that are instructions of an
    optimized HLO module (`compiled.as_text()`): an XLA fusion's output shape, its fusion kind and the jax source
    op its metadata names, so a profile's anonymous `loop_multiply_fusion` says where it comes from. A kernel's
    name is its instruction's with the numeric suffix's dot an underscore (`loop_add_fusion_127` runs
    `%loop_add_fusion.127`)."""
    out = {}
    for name in names:
        instruction = re.escape(name) + "|" + re.escape(re.sub(r"_(\d+)$", r".\1", name))
        m = re.search(rf"^\s*(?:ROOT )?%(?:{instruction}) = (\S+) (\w+)\(.*?\)(.*)$", hlo_text, re.MULTILINE)
        if m:
            kind = re.search(r"kind=(\w+)", m.group(3))
            op = re.search(r'op_name="([^"]*)"', m.group(3))
            out[name] = f"{m.group(1)} {kind.group(1) if kind else m.group(2)}: {op.group(1) if op else '?'}"
    return out


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


# Untimed calls of a chain at the start of each of its trials, after the other chains' calls. On the H200 a
# Qwen3.5 step timed right after another executable's calls ran 0.3-0.5 ms above its GPU kernels where a chain timed
# alone ran ~0.1 ms above them (docs/performance.md): the calls after a switch are timed apart (`after_switch_s`).
SETTLE_CALLS = 2


class ChainTiming(NamedTuple):
    """One chain's timing (`_time_chains`): seconds, the median per call over the trials; trial_times, each trial's
    seconds per call; kernels, GPU kernel times of 3 more calls (`kernel_times`; None off the GPU); after_switch_s,
    the median per call of each trial's SETTLE_CALLS untimed calls, made right after another chain's; dispatch_s,
    the median over trials of the host's time to enqueue a call (the wall of a trial's calls before it blocks)."""

    seconds: float
    trial_times: list
    kernels: dict | None
    after_switch_s: float
    dispatch_s: float


def _time_chain(fn, params, state, extra: tuple, reps: int, trials: int, warmup_s: float) -> ChainTiming:
    """`_time_chains` of one step."""
    return _time_chains({0: (fn, params, state, extra)}, reps, trials, warmup_s)[0]


def _time_chains(chains: dict, reps: int, trials: int, warmup_s: float) -> dict:
    """Seconds per call of each chain {key: (fn, params, state, extra)}, state, out = fn(params, state, *extra)
    chained (state donated): the median over trials of `reps` back-to-back calls, after `warmup_s` seconds of untimed
    calls of each (at least one: on the H200 the first timed trials of a step ran up to 30% slow after a single
    warm-up call, docs/performance.md). The chains' trials interleave (trial t times every chain, in reverse order
    on odd t), so a drift of the clocks over the run reaches every chain alike rather than the one timed last: the
    ratios of their medians are what a run compares. Each trial of a chain starts with SETTLE_CALLS calls timed apart
    (the cost of a switch between executables is not a step's). Returns {key: ChainTiming}."""
    states = {key: state for key, (_, _, state, _) in chains.items()}  # each chain's latest (donated) state

    def calls(key, n: int) -> float:
        """n chained calls, blocked on at the end; returns the seconds the host took to enqueue them."""
        fn, params, _, extra = chains[key]
        state = states[key]
        t0 = time.perf_counter()
        for _ in range(n):
            state, out = fn(params, state, *extra)
        enqueued = time.perf_counter() - t0
        states[key] = state
        jax.block_until_ready((state, out))
        return enqueued

    for key in chains:
        end = time.perf_counter() + warmup_s
        calls(key, 1)
        while time.perf_counter() < end:
            calls(key, 1)
    times, switch, dispatch = ({key: [] for key in chains} for _ in range(3))
    for t in range(trials):
        for key in list(chains)[:: -1 if t % 2 else 1]:
            t0 = time.perf_counter()
            calls(key, SETTLE_CALLS)
            t1 = time.perf_counter()
            enqueued = calls(key, reps)
            times[key].append((time.perf_counter() - t1) / reps)
            switch[key].append((t1 - t0) / SETTLE_CALLS)
            dispatch[key].append(enqueued / reps)
    out = {}
    for key in chains:
        kernels = None
        if jax.default_backend() == "gpu":
            try:
                kernels = kernel_times(profile(functools.partial(calls, key, 3)), 3)
            except Exception as e:  # the profiler is an add-on (another tool may hold CUPTI): record why, keep timing
                kernels = {"error": _error_text(e)}
        median = statistics.median
        out[key] = ChainTiming(median(times[key]), times[key], kernels, median(switch[key]), median(dispatch[key]))
    return out
