"""ThriftAttention decode: split-KV (flash-decoding) over a 16-bit and a 4-bit KV cache, Pallas-Triton.

docs/spec.md, ThriftAttention; the twin is :func:`lowbit_jax.thrift_reference.decode_reference`. A program owns one
tile of query rows (the group's query heads × the new tokens, :func:`lowbit_jax.thrift_reference.decode_rows`)
of one (batch, kv head) and one run of its key blocks in the order of
:func:`lowbit_jax.thrift_reference.block_order`: the first ``config.decode_splits`` programs cut the 4-bit
blocks into contiguous runs, the last ``config.decode_splits_high`` the 16-bit ones. Each writes its partial
softmax (unnormalized O, m, l) of its real rows for :func:`pallas_kernels.thrift_combine.combine_decode` (one
token of a group of 4 heads fills 4 of a 16-row tile: the padding rows are neither written nor read back, 7–14%
of a one-token step at B8–B32); no program branches per block, so Triton pipelines the loads. The products need
16 rows, but the softmax and FQ(P) run on the real rows only (rounded up to a power of two, ``softmax_rows``): the
scores' first rows are taken out of the tile and P is repeated down it again for P·V, whose extra rows are never
stored.

A 4-bit block is read as packed e2m1 codes (:func:`pallas_kernels.numerics.nvfp4.pack_halves`: a byte holds elements
i and i + n/2) with e4m3 group scales, 0.5625 bytes per value instead of 2, and decoded in registers by bit
placement into float16 (:func:`pallas_kernels.numerics.nvfp4.e2m1_decode_f16`, value · 2**-14, no gather; compiled,
four bytes at a time in inline PTX, :func:`pallas_kernels._triton.e2m1_unpack_f16`) times the group scale: one
fp16 multiply per value, exact (the products have at most five significant bits and land on fp16's grid down to
its smallest subnormal); the 2**14 goes into the score scale and into FQ(P). Every product
works on halves: the key block's two halves of ``block/2`` keys (the V bytes' two elements) and the head dim's
two halves (the K bytes' two elements).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import nvfp4
from pallas_kernels._triton import compiler_params, e2m1_unpack_f16, pl, store_rows
from pallas_kernels.configs import ThriftConfig, next_pow2
from pallas_kernels.numerics.online_softmax import online_softmax_step
from pallas_kernels.thrift_scalars import HEADER, N_HIGH, check_scalars, header_block

LOG2E = math.log2(math.e)
DOT_NT = (((1,), (1,)), ((), ()))
DOT_NN = (((1,), (0,)), ((), ()))


def _decode_kernel(q_ref, qf_lo_ref, qf_hi_ref, pos_ref, header_ref, k_ref, v_ref, k4_ref, ks_ref, v4_ref, vs_ref,
                   order_ref, acc_ref, m_ref, l_ref, *, block, splits_low, splits_high, score_scale, dtype,
                   softmax_rows, skip_padding, only_high, interpret):
    half, d = block // 2, q_ref.shape[-1]
    dg = d // 2 // nvfp4.GROUP  # K scale groups per half of the head dim
    vg = half // nvfp4.GROUP  # V scale groups per half of the key block
    tile, srows = q_ref.shape[0], softmax_rows
    pos = pos_ref[pl.ds(0, srows)]
    n_blocks = (jnp.max(pos) + block) // block  # max(pos) + 1 tokens in the cache
    n_high = header_ref[N_HIGH]
    n_low = n_blocks - n_high
    split = pl.program_id(2)
    nt = lambda a, b: lax.dot_general(a, b, DOT_NT, preferred_element_type=jnp.float32)  # noqa: E731
    nn = lambda a, b: lax.dot_general(a, b, DOT_NN, preferred_element_type=jnp.float32)  # noqa: E731
    f16 = jnp.float16
    unpack = functools.partial(e2m1_unpack_f16, interpret=interpret)
    first_rows = functools.partial(_first_rows, rows=srows)
    tiled = functools.partial(_tiled, tile=tile)

    def softmax_step(carry, s_a, s_b, start, update):
        acc, m_prev, l_prev = carry
        s_a, s_b = first_rows(s_a), first_rows(s_b)
        cols = start + jnp.arange(half, dtype=jnp.int32)
        s_a = jnp.where(cols[None, :] <= pos[:, None], s_a, -jnp.inf)
        s_b = jnp.where(cols[None, :] + half <= pos[:, None], s_b, -jnp.inf)
        (p_a, p_b), alpha, m_new, l_new = online_softmax_step([s_a, s_b], m_prev, l_prev)
        return acc * tiled(alpha)[:, None] + update(p_a, p_b), m_new, l_new

    def low_step(i, carry):
        j = order_ref[i].astype(jnp.int32)
        start = j * block
        first, second = pl.ds(start, half), pl.ds(start + half, half)
        qf_lo, qf_hi = qf_lo_ref[...], qf_hi_ref[...]

        def scores(rows):
            lo, hi = unpack(k4_ref[rows, :])
            k_lo = nvfp4.scale_tile_f16(lo, ks_ref[rows, pl.ds(0, dg)], axis=1)
            k_hi = nvfp4.scale_tile_f16(hi, ks_ref[rows, pl.ds(dg, dg)], axis=1)
            return (nt(qf_lo, k_lo) + nt(qf_hi, k_hi)) * (score_scale * nvfp4.E2M1_F16_BIAS)

        def update(p_a, p_b):
            lo, hi = unpack(v4_ref[pl.ds(j * d, d), :])  # (D, half): block j's rows, channel-major
            lo, hi = lo.T, hi.T
            groups = j * (block // nvfp4.GROUP)
            v_a = nvfp4.scale_tile_f16(lo, vs_ref[pl.ds(groups, vg), :], axis=0)
            v_b = nvfp4.scale_tile_f16(hi, vs_ref[pl.ds(groups + vg, vg), :], axis=0)
            fq = lambda p: (nvfp4.fake_quant_last(p, nonnegative=True) * nvfp4.E2M1_F16_BIAS).astype(f16)  # noqa: E731
            return nn(tiled(fq(p_a)), v_a) + nn(tiled(fq(p_b)), v_b)

        return softmax_step(carry, scores(first), scores(second), start, update)

    def high_step(i, carry):
        j = order_ref[i].astype(jnp.int32)
        start = j * block
        first, second = pl.ds(start, half), pl.ds(start + half, half)
        q16 = q_ref[...]
        s_a = nt(q16, k_ref[first, :].astype(dtype)) * score_scale
        s_b = nt(q16, k_ref[second, :].astype(dtype)) * score_scale

        def update(p_a, p_b):
            return nn(tiled(p_a.astype(dtype)), v_ref[first, :].astype(dtype)) + nn(tiled(p_b.astype(dtype)),
                                                                              v_ref[second, :].astype(dtype))

        return softmax_step(carry, s_a, s_b, start, update)

    carry = (jnp.zeros((tile, d), jnp.float32), jnp.full((srows,), -jnp.inf, jnp.float32),
             jnp.zeros((srows,), jnp.float32))

    def run(count, offset, index, n_splits, step):
        per = (count + n_splits - 1) // n_splits
        i0 = offset + index * per
        return lax.fori_loop(i0, jnp.minimum(i0 + per, offset + count), step, carry)

    if only_high:  # the 4-bit runs are another kernel's
        acc, m, l = run(n_high, n_low, split, splits_high, high_step)
    else:
        acc, m, l = lax.cond(split < splits_low,
                             lambda: run(n_low, 0, split, splits_low, low_step),
                             lambda: run(n_high, n_low, split - splits_low, splits_high, high_step))
    # padding rows (position −1) stay unwritten; acc's rows past the softmax's repeat its rows
    tile_pos = pos_ref[...]
    real = (tile_pos >= 0) & (lax.broadcasted_iota(jnp.int32, (tile,), 0) < srows)
    store_rows(acc_ref, acc, real[:, None] if skip_padding else None)  # srows < tile only with padding rows
    store_rows(m_ref.at[pl.ds(0, srows)], m, (pos >= 0) if skip_padding else None)
    store_rows(l_ref.at[pl.ds(0, srows)], l, (pos >= 0) if skip_padding else None)


def _first_rows(x: jax.Array, *, rows: int) -> jax.Array:
    """The first ``rows`` rows of a (tile, n) tile, by a reshape and a masked sum (Triton slices no tiles)."""
    if x.shape[0] == rows:
        return x
    reps = x.shape[0] // rows
    first = lax.broadcasted_iota(jnp.int32, (reps, 1, 1), 0) == 0
    return jnp.sum(jnp.where(first, x.reshape(reps, rows, x.shape[-1]), 0.0), axis=0)


def _tiled(x: jax.Array, *, tile: int) -> jax.Array:
    """(rows, ...) → (tile, ...): the rows repeated down a tile (the products' M dimension is at least 16)."""
    if x.shape[0] == tile:
        return x
    return jnp.broadcast_to(x[None], (tile // x.shape[0],) + x.shape).reshape((tile,) + x.shape[1:])


@functools.partial(jax.jit, static_argnames=("scale", "config", "row_tile", "rows", "only_high", "interpret"))
def thrift_decode(q_rows: jax.Array, qf_rows: jax.Array, scalars: jax.Array, k16: jax.Array,
                  v16: jax.Array, k4: jax.Array, k4_scale_bits: jax.Array, v4: jax.Array, v4_scale_bits: jax.Array,
                  order: jax.Array, *, scale: float, config: ThriftConfig, row_tile: int, rows: int | None = None,
                  only_high: bool = False, interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmaxes of the decode rows over each run of the cache's key blocks.

    Args:
      q_rows: (B, Hkv, R_pad, D) 16-bit query rows (:func:`lowbit_jax.thrift_reference.decode_rows`).
      qf_rows: (B, Hkv, R_pad, D) float16 φ⁻¹(φ(q_rows)) (exact in fp16).
      scalars: int32 (R_pad + 8,) the decode's scalars (:mod:`pallas_kernels.thrift_scalars`): each row's token
        position (−1 for padding rows; max + 1 is the cache length), and in the header
        :data:`~pallas_kernels.thrift_scalars.N_HIGH`, the 16-bit blocks per (batch, kv head).
      k16, v16: (B, S_max, Hkv, D) the 16-bit cache, S_max a multiple of ``config.block``.
      k4: uint8 (B, Hkv, S_max, D/2), k4_scale_bits: uint8 (B, Hkv, S_max, D/16) e4m3 bits;
      v4: uint8 (B, Hkv, S_max/block · D, block/2), v4_scale_bits: uint8 (B, Hkv, S_max/16, D) (the
        :class:`lowbit_jax.ThriftKVCache` layout).
      order: int16 (B, Hkv, Nkb_pad): the blocks, 4-bit then 16-bit (:func:`lowbit_jax.thrift_reference.block_order`),
        Nkb_pad a power of two.
      scale: softmax scale; row_tile: query rows per program (a power of two ≥ 16 dividing R_pad).
      rows: the real query rows (tokens × group), the first of R_pad; below R_pad the padding rows (position
        −1) are left unwritten (:func:`pallas_kernels.thrift_combine.combine_decode` masks them; slice
        ``[..., :rows, :]`` before :func:`lowbit_jax.thrift_reference.combine_splits`). None: every row is written.
      only_high: run the 16-bit runs only (the 4-bit ones are :mod:`pallas_kernels.thrift_decode_mosaic`'s).
    Returns:
      acc (B, Hkv, splits, R_pad, D) float32 (unnormalized), m and l (B, Hkv, splits, R_pad) float32 (base 2),
      splits = ``config.decode_splits + config.decode_splits_high`` (``only_high``: ``config.decode_splits_high``).
    """
    splits_low, splits_high = config.split_counts()
    b, hkv, r_pad, d = q_rows.shape
    check_scalars(scalars, r_pad)
    s_max = k16.shape[1]
    splits = splits_high if only_high else splits_low + splits_high
    n_rt = r_pad // row_tile
    softmax_rows = row_tile if rows is None else min(next_pow2(rows), row_tile)
    kernel = functools.partial(_decode_kernel, block=config.block, splits_low=splits_low,
                               splits_high=splits_high, score_scale=scale * LOG2E, dtype=q_rows.dtype,
                               softmax_rows=softmax_rows, skip_padding=rows is not None and rows < r_pad,
                               only_high=only_high, interpret=interpret)
    row = lambda bi, x, s: (bi, x // n_rt, x % n_rt, 0)  # noqa: E731
    q_spec = pl.BlockSpec((None, None, row_tile, d), row)
    half_spec = lambda off: pl.BlockSpec((None, None, row_tile, d // 2),  # noqa: E731
                                         lambda bi, x, s: (bi, x // n_rt, x % n_rt, off))
    head = lambda shape: pl.BlockSpec((None, None) + shape, lambda bi, x, s: (bi, x // n_rt, 0, 0))  # noqa: E731
    seq_major = pl.BlockSpec((None, s_max, None, d), lambda bi, x, s: (bi, 0, x // n_rt, 0))
    in_specs = [q_spec, half_spec(0), half_spec(1), pl.BlockSpec((row_tile,), lambda bi, x, s: (x % n_rt,)),
                pl.BlockSpec((HEADER,), lambda bi, x, s: (header_block(r_pad),)),
                seq_major, seq_major, head(k4.shape[2:]), head(k4_scale_bits.shape[2:]), head(v4.shape[2:]),
                head(v4_scale_bits.shape[2:]),
                pl.BlockSpec((None, None, order.shape[2]), lambda bi, x, s: (bi, x // n_rt, 0))]
    out_specs = [pl.BlockSpec((None, None, None, row_tile, d), lambda bi, x, s: (bi, x // n_rt, s, x % n_rt, 0)),
                 pl.BlockSpec((None, None, None, row_tile), lambda bi, x, s: (bi, x // n_rt, s, x % n_rt)),
                 pl.BlockSpec((None, None, None, row_tile), lambda bi, x, s: (bi, x // n_rt, s, x % n_rt))]
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((b, hkv, splits, r_pad, d), f32),
                 jax.ShapeDtypeStruct((b, hkv, splits, r_pad), f32), jax.ShapeDtypeStruct((b, hkv, splits, r_pad), f32)]
    return pl.pallas_call(
        kernel,
        grid=(b, hkv * n_rt, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(*config.decode_launch(row_tile)),
        interpret=interpret,
        name="thrift_decode",
    )(q_rows, qf_rows, qf_rows, scalars, scalars, k16, v16, k4, k4_scale_bits, v4, v4_scale_bits, order)
