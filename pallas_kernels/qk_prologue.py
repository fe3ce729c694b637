"""The QK-norm + RoPE prologue (:mod:`pallas_kernels.numerics.qk_prologue`) in Triton kernels: its backward as one pass,
and the helpers with which the forward's kernels apply it to the tiles they load.

The forward's prologue runs inside the kernels that read q and k anyway: SageAttention's quantize kernels
(:mod:`pallas_kernels.quantize`) and Attn-QAT's fake quantization (:mod:`pallas_kernels.fake_quant`), through
:func:`prologue_specs`, :func:`prologue_flags` and :func:`load_tile`. Its backward reads
the attention's gradient dz of the normalized, rotated q (or k) and the pre-norm input x once, and writes dx and
each program's partial sum of the norm scale's gradient: the work XLA splits into a rotation, a row reduction,
an element-wise pass and a column reduction over every token (five passes over the activations). The math is
:func:`pallas_kernels.numerics.qk_prologue.backward_halves`, the function the reference runs on whole arrays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import qk_prologue
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask, store_rows

#: elements (token rows × head dim) per program of the backward pass, and its warps up to head dim 64 and beyond
#: (the fastest measured: 64 rows with 2 warps at head dim 64, 32 rows with 4 warps at 128)
BLOCK_ELEMENTS = 4096
WARPS = 2
WARPS_WIDE = 4


def launch(head_dim: int) -> tuple[int, int]:
    """(token rows per program, warps) of :func:`qk_prologue_bwd` at this head dim (:data:`BLOCK_ELEMENTS`)."""
    return max(16, BLOCK_ELEMENTS // head_dim), WARPS if head_dim <= 64 else WARPS_WIDE


def side_inputs(g: jax.Array | None, cos: jax.Array | None, sin: jax.Array | None, *, block: int, d: int,
                s: int, row_block=lambda bi, hi, i: i) -> tuple[list, list]:
    """The inputs (and block specs) that give a kernel over tiles of ``block`` rows of a (B, s, H, d) array one
    side of a prologue: the norm scale as (1, d) if ``g``; the RoPE tables padded to whole blocks (Triton loads
    whole blocks) if ``cos``. ``row_block`` maps the kernel's grid indices to the tile's row block (default: grid
    (batch, head, row block)). :func:`load_side` reads them in the kernel."""
    args, specs = [], []
    if g is not None:
        args.append(g.reshape(1, d))
        specs.append(pl.BlockSpec((1, d), lambda *_: (0, 0)))
    if cos is not None:
        pad = pl.cdiv(s, block) * block - s
        args += [jnp.pad(t.astype(jnp.float32), ((0, pad), (0, 0))) for t in (cos, sin)]
        specs += [pl.BlockSpec((block, d // 2), lambda *idx: (row_block(*idx), 0))] * 2
    return args, specs


def prologue_specs(prologue: QKPrologue | None, which: str, block: int, d: int, s: int, **kw) -> tuple[list, list]:
    """:func:`side_inputs` of ``prologue``'s ``which`` side ("q" or "k"); none without a prologue."""
    if prologue is None:
        return [], []
    g, cos, sin = prologue.side(which)
    return side_inputs(g, cos, sin, block=block, d=d, s=s, **kw)


class Flags(NamedTuple):
    """What a kernel applies of a :class:`QKPrologue` (static): the norm, RoPE, the norm's epsilon, and whether
    the kernel is interpreted (it then rounds as the reference does, :func:`qk_prologue.exact_rounding`: XLA
    may drop the convert pair that the compiled kernel keeps)."""

    norm: bool = False
    rope: bool = False
    eps: float = 0.0
    interpret: bool = False


def prologue_flags(prologue: QKPrologue | None, interpret: bool) -> Flags:
    """The static :class:`Flags` of a call."""
    if prologue is None:
        return Flags()
    return Flags(prologue.has_norm, prologue.has_rope, prologue.eps, interpret)


def load_tile(x_ref, refs: list, mask, pro: Flags):
    """A kernel's input tile: as loaded (no prologue), or the prologue's two channel halves, float32 (popping its
    refs from ``refs``)."""
    if not (pro.norm or pro.rope):
        return load_rows(x_ref, mask)
    side = load_side(refs, norm=pro.norm, rope=pro.rope)
    return qk_prologue.forward_halves(*load_halves(x_ref, mask), *side, eps=pro.eps,
                                      rounding=qk_prologue.kernel_rounding(x_ref.dtype, pro.interpret))


def load_side(refs: list, *, norm: bool, rope: bool) -> tuple:
    """In a kernel: ``(g1, g2, cos, sin)`` from the refs :func:`side_inputs` made (popped from the front of
    ``refs``): the norm scale's halves (1, d/2) and the tile's tables (rows, d/2), None where absent."""
    g1 = g2 = cos = sin = None
    if norm:
        g1, g2 = load_halves(refs.pop(0), None)
    if rope:
        cos, sin = refs.pop(0)[...], refs.pop(0)[...]
    return g1, g2, cos, sin


def load_halves(ref, valid) -> tuple[jax.Array, jax.Array]:
    """A (rows, d) tile loaded as its two channel halves (rows outside ``valid`` as zeros; None: all rows)."""
    h = ref.shape[-1] // 2
    return load_rows(ref.at[:, pl.ds(0, h)], valid), load_rows(ref.at[:, pl.ds(h, h)], valid)


def store_parts(ref, value, *, axis: int = 1, rows: jax.Array | None = None) -> None:
    """Store a tile given whole, or as its two channel halves (a tuple) along ``axis`` of ``ref``; ``rows`` (int32,
    axis 1 only): tile row r goes to row ``rows[r]`` of ``ref`` (a permutation), else to row r."""
    if rows is not None and axis != 1:
        raise ValueError("store_parts: rows needs axis=1")
    first = slice(None) if rows is None else rows
    if not isinstance(value, tuple):
        ref[... if rows is None else (rows, slice(None))] = value
        return
    h = ref.shape[axis] // 2
    for j, part in enumerate(value):
        idx = (first, pl.ds(j * h, h)) if axis == 1 else (pl.ds(j * h, h), slice(None))
        ref[idx] = part


def _bwd_kernel(x_ref, dz_ref, *refs, seq_len, block, ragged, norm, rope, eps, interpret):
    refs = list(refs)
    h = x_ref.shape[-1] // 2
    g1, g2, cos, sin = load_side(refs, norm=norm, rope=rope)
    dx_ref = refs.pop(0)
    valid = row_mask(pl.program_id(2) * block, block, seq_len) if ragged else None
    dx1, dx2, dg1, dg2 = qk_prologue.backward_halves(
        *load_halves(x_ref, valid), *load_halves(dz_ref, valid), g1, g2, cos, sin, eps=eps,
        rounding=qk_prologue.kernel_rounding(x_ref.dtype, interpret))
    store_rows(dx_ref.at[:, pl.ds(0, h)], dx1.astype(dx_ref.dtype), valid)
    store_rows(dx_ref.at[:, pl.ds(h, h)], dx2.astype(dx_ref.dtype), valid)
    if norm:  # padding rows load as zeros and add nothing
        store_parts(refs.pop(0), (jnp.sum(dg1, axis=0, keepdims=True), jnp.sum(dg2, axis=0, keepdims=True)))


@functools.partial(jax.jit, static_argnames=("eps", "block", "num_warps", "interpret"))
def qk_prologue_bwd(
    x: jax.Array,
    dz: jax.Array,
    g: jax.Array | None,
    cos: jax.Array | None,
    sin: jax.Array | None,
    *,
    eps: float,
    block: int | None = None,
    num_warps: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Gradients of ``qk_prologue.apply(x, g, cos, sin)`` for the cotangent ``dz``.

    Args:
      x: (B, S, H, D) bf16/fp16/fp32, the pre-norm input (D even).
      dz: (B, S, H, D) any float dtype, the cotangent of the prologue's output.
      g: (D,) the norm scale or None; cos, sin: float32 (S, D/2) or None.
      eps: the norm's epsilon.
      block, num_warps: token rows per program and warps; None: :func:`launch`'s for D.
    Returns:
      dx (B, S, H, D) in x's dtype and the norm scale's gradient float32 (D,) (None without a norm).
    """
    b, s, h, d = x.shape
    if dz.shape != x.shape:
        raise ValueError(f"dz must have x's shape {tuple(x.shape)}, got {tuple(dz.shape)}")
    norm, rope = g is not None, cos is not None
    default_block, default_warps = launch(d)
    block, num_warps = block or default_block, num_warps or default_warps
    nblk = pl.cdiv(s, block)
    row = pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    side_args, side_specs = side_inputs(g, cos, sin, block=block, d=d, s=s)
    args, specs = [x, dz, *side_args], [row, row, *side_specs]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row]
    if norm:
        out_shape.append(jax.ShapeDtypeStruct((b, h, nblk, d), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, 1, d), lambda bi, hi, i: (bi, hi, i, 0)))
    kernel = functools.partial(_bwd_kernel, seq_len=s, block=block, ragged=s % block != 0, norm=norm, rope=rope,
                               eps=eps, interpret=interpret)
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, nblk),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="qk_prologue_bwd",
    )(*args)
    return outs[0], (jnp.sum(outs[1], axis=(0, 1, 2)) if norm else None)
