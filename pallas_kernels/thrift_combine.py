"""ThriftAttention decode, the last launch: the decode kernels' partial softmaxes merged into the output, Pallas-Triton.

The twin is :func:`lowbit_jax.thrift_reference.combine_splits` then
:func:`lowbit_jax.thrift_reference.decode_outputs`. One program owns one (batch, kv head, tile of query rows, chunk
of the head dim): it takes the row maximum over every split of every group first, then sums the weighted partials,
and stores its rows at their place in the (B, T, Hq, D) output in the output dtype. In XLA the same merge is
several small launches (the maxima, the weighted sums, the transposes, the cast), each costing more than its
bytes in a decode step.

A group is one decode kernel's partials: the Triton kernel's acc (B, Hkv, splits, R, D) or the Mosaic GPU kernel's
transposed accᵀ (B, Hkv, splits, D, R), with m and l (B, Hkv, splits, R). Rows from ``rows`` on are padding that
the kernels may have left unwritten (anything, NaN included): they are masked before any arithmetic and not stored.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl, plgpu
from pallas_kernels.configs import next_pow2
from pallas_kernels.numerics import int8
from pallas_kernels.thrift_scalars import HEADER, USABLE, check_scalars, header_block

#: query rows a program (a power of two; more rows are cut into tiles of this many)
ROW_TILE = 64
#: channels a program: the head dim's chunks spread a (batch, kv head)'s bytes over more SMs
D_CHUNK = 32


class Partials(NamedTuple):
    """One decode kernel's partial softmaxes (base-2 m, unnormalized acc); ``transposed``: acc is (…, D, R)."""

    acc: jax.Array
    m: jax.Array
    l: jax.Array
    transposed: bool = False


def _combine_kernel(header_ref, *refs, kinds, rows, tokens, group, kv_heads, row_tile, d_chunk):
    o_ref = refs[-1]
    parts = [refs[3 * i:3 * i + 3] for i in range(len(kinds))]
    x, dc = pl.program_id(1), pl.program_id(2)
    hkv, tile = x // _tiles(rows, row_tile), x % _tiles(rows, row_tile)
    r = tile * row_tile + jnp.arange(row_tile, dtype=jnp.int32)
    real = r < rows

    rws, cols = pl.ds(tile * row_tile, row_tile), pl.ds(dc * d_chunk, d_chunk)
    if all(m_ref.shape[0] & (m_ref.shape[0] - 1) == 0 for _, m_ref, _ in parts):
        num, den = _merge_whole(parts, kinds, real, rws, cols, d_chunk)
    else:
        num, den = _merge_by_split(parts, kinds, real, rws, cols, d_chunk)
    o = num * int8.reciprocal_or_zero(den)[:, None]
    o = jnp.where(header_ref[USABLE] != 0, o, jnp.nan)
    # row g·T + t of kv head h is query head h·G + g at token t: output row t·Hq + h·G + g of the (B, T·Hq, D) view
    out_row = (r % tokens) * (kv_heads * group) + hkv * group + r // tokens
    # both indices whole tiles: the interpreter scatters array indices only; padding rows point past the end, where
    # the masked store writes nothing (an in-bounds duplicate would race the real row's store in the interpreter)
    shape = (row_tile, d_chunk)
    out_rows = jnp.broadcast_to(jnp.where(real, out_row, o_ref.shape[0])[:, None], shape)
    out_cols = jnp.broadcast_to(dc * d_chunk + jnp.arange(d_chunk, dtype=jnp.int32)[None, :], shape)
    plgpu.store(o_ref.at[out_rows, out_cols], o.astype(o_ref.dtype), mask=jnp.broadcast_to(real[:, None], shape))


def _merge_whole(parts, kinds, real, rws, cols, d_chunk):
    """(Σ w·acc, Σ w·l) over every split at once (power-of-two split counts: whole tiles, no loop of loads)."""
    ms = [jnp.where(real[None, :], m_ref[:, rws], -jnp.inf) for _, m_ref, _ in parts]
    m_all = ms[0].max(axis=0)
    for m in ms[1:]:
        m_all = jnp.maximum(m_all, m.max(axis=0))
    m_ref0 = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    num = jnp.zeros((real.shape[0], d_chunk), jnp.float32)
    num_t = jnp.zeros((d_chunk, real.shape[0]), jnp.float32)
    den = jnp.zeros(real.shape, jnp.float32)
    for (acc_ref, _, l_ref), m, transposed in zip(parts, ms, kinds):
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_ref0[None, :]))  # (splits, rows)
        den = den + jnp.sum(jnp.where(real[None, :], l_ref[:, rws], 0.0) * w, axis=0)
        if transposed:  # (splits, channels, rows): summed as is, transposed once
            acc = jnp.where(real[None, None, :], acc_ref[:, cols, rws], 0.0)
            num_t = num_t + jnp.sum(acc * w[:, None, :], axis=0)
        else:
            acc = jnp.where(real[None, :, None], acc_ref[:, rws, cols], 0.0)
            num = num + jnp.sum(acc * w[:, :, None], axis=0)
    if any(kinds):
        num = num + num_t.T
    return num, den


def _merge_by_split(parts, kinds, real, rws, cols, d_chunk):
    """:func:`_merge_whole` one split at a time (any split count)."""
    m_of = lambda m_ref, s: jnp.where(real, m_ref[s, rws], -jnp.inf)  # noqa: E731
    m_all = jnp.full(real.shape, -jnp.inf, jnp.float32)
    for _, m_ref, _ in parts:
        m_all = lax.fori_loop(0, m_ref.shape[0], lambda s, mx, m_ref=m_ref: jnp.maximum(mx, m_of(m_ref, s)), m_all)
    m_ref0 = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    num = jnp.zeros((real.shape[0], d_chunk), jnp.float32)
    den = jnp.zeros(real.shape, jnp.float32)
    for (acc_ref, m_ref, l_ref), transposed in zip(parts, kinds):
        def body(s, carry, acc_ref=acc_ref, m_ref=m_ref, l_ref=l_ref, transposed=transposed):
            num, den = carry
            m = m_of(m_ref, s)
            w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_ref0))
            acc = acc_ref[s, cols, rws].T if transposed else acc_ref[s, rws, cols]
            acc = jnp.where(real[:, None], acc, 0.0)
            return num + acc * w[:, None], den + jnp.where(real, l_ref[s, rws], 0.0) * w

        num, den = lax.fori_loop(0, m_ref.shape[0], body, (num, den))
    return num, den


def _tiles(rows: int, row_tile: int) -> int:
    return -(-rows // row_tile)


def combine_decode(groups: tuple[Partials, ...], scalars: jax.Array, *, rows: int, tokens: int, num_heads: int,
                   out_dtype, interpret: bool = False) -> jax.Array:
    """The decode output from its kernels' partial softmaxes.

    Args:
      groups: one :class:`Partials` a decode kernel, each with R_pad ≥ ``rows`` rows (a power of two up to 64, or a
        multiple of 64) of which the first ``rows`` are real (row g·T + t: query head g of the kv group at token t,
        :func:`lowbit_jax.thrift_reference.decode_rows`); their splits merge as one concatenation would.
      scalars: int32 (R_pad + 8,) the decode's scalars (:mod:`pallas_kernels.thrift_scalars`): its header's
        :data:`~pallas_kernels.thrift_scalars.USABLE` 0 gives NaN everywhere (a decode on a cache in a bad state).
      rows: T · group; tokens: T; num_heads: Hq; out_dtype: the output's dtype.
    Returns:
      (B, T, Hq, D) in ``out_dtype``: ``combine_splits`` of the groups in :func:`decode_outputs`'s layout.
    """
    acc0 = groups[0].acc
    b, hkv = acc0.shape[:2]
    d = acc0.shape[-2] if groups[0].transposed else acc0.shape[-1]
    r_pad = groups[0].m.shape[-1]
    row_tile = min(next_pow2(rows), ROW_TILE)  # the real rows only: one token of a group of 4 reads 4 of 16
    values = max(g.m.shape[2] for g in groups) * row_tile  # (split, row) pairs a program merges
    d_chunk = max(8, min(D_CHUNK, 8192 // values))  # at most 8,192 values of a group's tile at once
    d_chunk = d_chunk if d % d_chunk == 0 else d
    n_tiles = _tiles(rows, row_tile)
    group = num_heads // hkv
    kernel = functools.partial(_combine_kernel, kinds=tuple(g.transposed for g in groups), rows=rows, tokens=tokens,
                               group=group, kv_heads=hkv, row_tile=row_tile, d_chunk=d_chunk)
    head = lambda x: pl.BlockSpec((None, None) + x.shape[2:],  # noqa: E731  (a (batch, kv head)'s partials)
                                  lambda bi, xi, c: (bi, xi // n_tiles) + (0,) * (x.ndim - 2))
    check_scalars(scalars, r_pad)
    in_specs, args = [pl.BlockSpec((HEADER,), lambda bi, xi, c: (header_block(r_pad),))], [scalars]
    for g in groups:
        if g.m.shape[-1] != r_pad:
            raise ValueError(f"every group needs the same padded rows, got {g.m.shape[-1]} and {r_pad}")
        in_specs += [head(g.acc), head(g.m), head(g.l)]
        args += [g.acc, g.m, g.l]
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv * n_tiles, d // d_chunk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, tokens * num_heads, d), lambda bi, xi, c: (bi, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tokens * num_heads, d), out_dtype),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
        name="thrift_combine",
    )(*args)
    return out.reshape(b, tokens, num_heads, d)
