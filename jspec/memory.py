"""What an Engine will allocate, checked against what the machine has before anything is allocated.

A generation allocates its loop state (the KV cache of every attention layer, recurrent states, the token history,
a drafter's own caches: exact sizes from `jax.eval_shape`) and a prefill chunk's activations; `Engine` sums them
and raises `MemoryBudgetError` with the numbers when they exceed the free memory of the device (its allocator's
limit minus what is in use) or, on the CPU, the host's available memory (MemAvailable, or the cgroup's limit when
lower). Where neither is known (a backend without statistics) nothing is checked.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

HEADROOM = 0.9  # the share of the free memory a generation may plan to use (the rest: XLA's own temporaries)


class MemoryBudgetError(MemoryError):
    """An Engine's planned allocation exceeds the memory that is free (the message gives both, by part)."""


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs (`jax.eval_shape` output)."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def free_bytes() -> tuple[int | None, str]:
    """(bytes free for new allocations, where they were measured); (None, why) when it cannot be known."""
    device = jax.devices()[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), f"free on {device.device_kind}"
    if device.platform == "cpu":
        host = host_available_bytes()
        if host is not None:
            return host, "available host memory"
    return None, f"{device.platform} reports no memory statistics"


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by a cgroup v2 memory limit (memory.max - memory.current)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    if available is None and hasattr(os, "sysconf"):
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
    return available


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(parts: dict[str, int], what: str, advice: str) -> None:
    """Raise MemoryBudgetError unless sum(parts) fits HEADROOM of the free memory."""
    need = sum(parts.values())
    free, where = free_bytes()
    if free is None or need <= HEADROOM * free:
        return
    detail = ", ".join(f"{name} {gib(n)}" for name, n in parts.items() if n)
    raise MemoryBudgetError(
        f"{what} needs {gib(need)} ({detail}) but only {gib(free)} is {where} (using at most {HEADROOM:.0%}); {advice}"
    )
