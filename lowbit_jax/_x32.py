"""32-bit tracing for the public entry points, so that ``jax_enable_x64`` changes nothing inside them.

The methods compute in float32/int32 by contract (bf16, fp16 or fp32 in, the same dtype out): under x64 a
Python integer or ``jnp.arange`` would otherwise become int64 in index arithmetic and the kernels' integer
tricks, which ``lax`` refuses to mix with int32 and the GPU kernels would not lower as written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import jax

F = TypeVar("F", bound=Callable)


def x32(fn: F) -> F:
    """``fn`` traced and run with x64 off (``jax.enable_x64(False)``); a no-op where x64 is already off."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.enable_x64(False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
