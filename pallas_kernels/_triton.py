"""The Triton backend of Pallas behind one small module.

Every kernel file imports its backend-specific pieces from here (compiler
parameters, masked tile loads/stores, the lowering-warning filter), so another
Pallas backend could be added beside this one.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# The Triton backend warns (DeprecationWarning, "jax-pallas-triton") on every
# lowering; users of this library should not see it once per kernel call.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\._src\.pallas.*")
warnings.filterwarnings("ignore", message=r".*[Tt]riton.*deprecat.*", category=DeprecationWarning)


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler parameters for ``pl.pallas_call``."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def row_mask(start: jax.Array | int, rows: int, limit: int) -> jax.Array:
    """bool (rows, 1): ``start + r < limit`` for each row r of a tile."""
    return (start + jnp.arange(rows, dtype=jnp.int32) < limit)[:, None]


def load_rows(ref, valid: jax.Array | None, other: float = 0.0) -> jax.Array:
    """Load a tile, masking rows outside the array (jax 0.11.2 does not mask)."""
    if valid is None:
        return ref[...]
    return plgpu.load(ref, mask=valid, other=other)


def store_rows(ref, value: jax.Array, valid: jax.Array | None) -> None:
    """Store a tile, skipping rows outside the array."""
    if valid is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=valid)


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA/ROCm GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


__all__ = ["pl", "plgpu", "compiler_params", "row_mask", "load_rows", "store_rows", "on_gpu"]
