"""The roofline section: the HBM read bandwidth every step's cost is compared with, the best of torch `x.sum()` and
XLA `jnp.sum` over a large bf16 array."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec_bench.report import Context, _error_text
from jspec_bench.timing import BATCH, _median_wall, torch_median


def section_roofline(ctx: Context, sec: dict) -> None:
    """The roofline of opts.roofline_bytes (`measure_roofline`) into sec and ctx.roofline_Bps."""
    sec.update(measure_roofline(ctx.opts.roofline_bytes))
    ctx.roofline_Bps = sec["roofline_Bps"]
    print(f"  roofline {sec['roofline_Bps'] / 1e12:.3f} TB/s ({sec['best']}; xla {sec['xla_sum_Bps'] / 1e12:.3f})")


def measure_roofline(nbytes: int) -> dict:
    """Best HBM read bandwidth of torch `x.sum()` and XLA `jnp.sum` over a bf16 array of nbytes: the section's
    fields (`roofline_Bps` the best, `best` whose it is, each one's figure, torch's device and version or error).

    Each is timed over BATCH back-to-back calls (so host dispatch overlaps), median of 5 such trials."""
    n = nbytes // 2
    sec = {"bytes": 2 * n, "xla_sum_Bps": _xla_sum_Bps(n)}
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        sec["torch_sum_Bps"] = _torch_sum_Bps(n, device)
        sec["torch_device"] = device
        sec["torch"] = torch.__version__
        if device == "cuda":
            torch.cuda.empty_cache()
    except Exception as e:  # torch is a reference here, not the product: record and use XLA's number
        sec["torch_error"] = _error_text(e)
    best = max(("xla_sum_Bps", "torch_sum_Bps"), key=lambda k: sec.get(k, 0.0))
    sec["roofline_Bps"] = sec[best]
    sec["best"] = best.removesuffix("_Bps")
    return sec


def _xla_sum_Bps(n: int) -> float:
    a = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return 2 * n * BATCH / _median_wall(lambda: jax.block_until_ready([f(a) for _ in range(BATCH)]), 5)


def _torch_sum_Bps(n: int, device: str) -> float:
    import torch

    t = torch.ones(n, dtype=torch.bfloat16, device=device)
    return 2 * n * BATCH / torch_median(lambda: [t.sum() for _ in range(BATCH)], 5, device)
