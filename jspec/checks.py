"""Input checks shared by the public API: refuse, with a message that names the input, what would otherwise be
coerced (a float count truncated, a 2-D prompt flattened, a bool taken for 1) or fail deep inside a trace.

Every check raises `ValueError` or `TypeError` before any compute; docs/api.md lists what is refused and why.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np


def integer(value, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """value as a Python int, refusing bools, floats (2.5, and 2.0 too: a count is never a float), strings."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def real(value, name: str, lo: float | None = None, hi: float | None = None, *, open_lo: bool = False) -> float:
    """value as a finite Python float (ints accepted), in [lo, hi] ((lo, hi] with open_lo)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if lo is not None and (value <= lo if open_lo else value < lo):
        raise ValueError(f"{name} must be {'>' if open_lo else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def token_ids(ids, name: str, vocab_size: int, *, allow_empty: bool = False) -> np.ndarray:
    """A 1-D sequence of token ids (list, tuple, numpy or jax array of integers) -> int32 numpy array.

    Refused: strings (text needs a tokenizer: `jspec.load(dir).generate(text)`), 0-D or 2-D arrays (one prompt
    is one sequence; batches go to `Engine.generate_batch`), float or bool ids, ids outside [0, vocab_size)
    (a gather would silently clamp them), and the empty sequence unless allow_empty.
    """
    if isinstance(ids, str | bytes):
        raise TypeError(
            f"{name} must be token ids, got text {ids[:40]!r}; encode it first (or use jspec.load(dir).generate(text))"
        )
    if not isinstance(ids, Sequence | np.ndarray) and not hasattr(ids, "__array__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return arr.astype(np.int32)
        raise ValueError(f"{name} is empty: at least one token is needed")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        bad = next((x for x in arr.tolist() if isinstance(x, bool) or not isinstance(x, numbers.Integral)), arr[0])
        raise TypeError(f"{name} must hold integer token ids, got {arr.dtype} (e.g. {bad!r})")
    out_of_range = arr[(arr < 0) | (arr >= vocab_size)]
    if out_of_range.size:
        index = int(np.flatnonzero((arr < 0) | (arr >= vocab_size))[0])
        raise ValueError(
            f"{name}: token id {int(out_of_range[0])} at index {index} is out of range for vocab_size {vocab_size}"
        )
    return arr.astype(np.int32)


def instance(value, types: type | tuple[type, ...], name: str, what: str, *, optional: bool = True):
    """value unchanged if it is one of `types` (or None when optional), else a TypeError naming what was expected."""
    if (value is None and optional) or isinstance(value, types):
        return value
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
