"""Argument validation shared by every attention method.

Runs eagerly on shapes and dtypes (also under ``jit``: shapes are static), so a
bad call fails with a message naming the argument before anything compiles.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels._triton import on_gpu

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
IMPLEMENTATIONS = (None, "pallas", "xla")


class AttentionShape(NamedTuple):
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: jnp.dtype


def check_array(name: str, x) -> None:
    """A rank-4 (batch, seq, heads, head_dim) array of a supported float dtype, else TypeError/ValueError."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4 (batch, seq, heads, head_dim), got shape {tuple(x.shape)}")
    if not any(np.dtype(x.dtype) == np.dtype(d) for d in SUPPORTED_DTYPES):
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {np.dtype(x.dtype).name}")


def check_qkv(q, k, v) -> AttentionShape:
    """Validate q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D); return the sizes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, sq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    bk, sk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size of k/v ({bk}) must equal that of q ({b})")
    if dk != d:
        raise ValueError(f"head_dim of k/v ({dk}) must equal that of q ({d})")
    if sq < 1 or sk < 1:
        raise ValueError(f"sequence lengths must be >= 1, got q {sq} and k/v {sk}")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of the number of k/v heads ({hkv})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    return AttentionShape(b, sq, sk, hq, hkv, d, jnp.dtype(q.dtype))


def check_scale(scale, head_dim: int) -> float:
    """Resolve ``scale`` (None → D**-0.5); it must be a finite positive number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python number, not a traced value")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale must be finite and positive, got {scale!r}")
    return value


def check_implementation(implementation: str | None, interpret: bool) -> str:
    """Resolve ``implementation`` to "pallas" or "xla".

    None picks "pallas" on a GPU and "xla" elsewhere; "pallas" off-GPU needs
    ``interpret=True``.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    gpu = on_gpu()
    if implementation is None:
        return "pallas" if (gpu or interpret) else "xla"
    if implementation == "pallas" and not gpu and not interpret:
        raise ValueError(
            f'implementation="pallas" needs a GPU (default backend is {jax.default_backend()!r}); '
            "pass interpret=True to run the kernels in Pallas interpret mode, or use implementation=\"xla\""
        )
    return implementation


def check_fp8_device(name: str, fmt: str, implementation: str, interpret: bool) -> None:
    """An e4m3 operand format (``name``) needs FP8 conversions: an sm_89+ GPU for the Pallas kernels (Triton and
    Mosaic GPU refuse to lower them below), or the interpreter, or the XLA reference."""
    if fmt != "e4m3" or implementation != "pallas" or interpret:
        return
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is not None and tuple(int(x) for x in str(cc).split(".")[:2]) < (8, 9):
        raise ValueError(f"{name}='e4m3' needs an sm_89+ GPU for the Pallas kernels (this one is sm_{cc}); use "
                         f"{name}='int8'")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_prologue(prologue, shape: AttentionShape) -> None:
    """Accept a :class:`pallas_kernels.numerics.qk_prologue.QKPrologue` fitting q (B, Sq, Hq, D) and k (B, Sk, Hkv, D),
    or None; else TypeError/ValueError naming the field."""
    if prologue is None:
        return
    if not isinstance(prologue, QKPrologue):
        raise TypeError(f"prologue must be a QKPrologue or None, got {type(prologue).__name__}")
    d = shape.head_dim
    if d % 2:
        raise ValueError(f"prologue: RoPE and the fused QK-norm need an even head_dim, got {d}")
    if (prologue.q_norm is None) != (prologue.k_norm is None):
        raise ValueError("prologue: q_norm and k_norm must both be given or both be None")
    tables = (prologue.cos_q, prologue.sin_q, prologue.cos_k, prologue.sin_k)
    if any(t is None for t in tables) and not all(t is None for t in tables):
        raise ValueError("prologue: cos_q, sin_q, cos_k and sin_k must all be given or all be None")
    if prologue.q_norm is None and prologue.cos_q is None:
        raise ValueError("prologue: give a norm (q_norm, k_norm), RoPE tables, or both")
    for name in ("q_norm", "k_norm"):
        g = getattr(prologue, name)
        if g is not None and (not hasattr(g, "shape") or tuple(g.shape) != (d,)):
            raise ValueError(f"prologue.{name} must have shape ({d},), got {getattr(g, 'shape', type(g).__name__)}")
    for name, seq in (("cos_q", shape.seq_q), ("sin_q", shape.seq_q), ("cos_k", shape.seq_k),
                      ("sin_k", shape.seq_k)):
        t = getattr(prologue, name)
        if t is not None and (not hasattr(t, "shape") or tuple(t.shape) != (seq, d // 2)):
            raise ValueError(f"prologue.{name} must have shape ({seq}, {d // 2}), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    eps = prologue.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"prologue.eps must be a finite positive number, got {eps!r}")
