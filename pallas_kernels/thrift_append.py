"""ThriftAttention's KV-cache append of one new token, in place, in one Pallas-Triton launch.

The twin is :meth:`lowbit_jax.ThriftKVCache.append` (XLA), which a decode step would otherwise run as about a dozen
small launches (a dynamic-update-slice per cache array, the V window's transpose and group maxima, the block
means): at one token per step, the launches, not the bytes, are the cost. A program owns one (batch, kv head) and
writes, at the token's position p:

* the 16-bit k and v rows;
* K's NVFP4 codes and group scales (groups of 16 along D; the two halves of D loaded apart, as
  :func:`pallas_kernels.numerics.nvfp4.pack_halves` pairs channel i with i + D/2);
* V's 16-token group holding p, re-quantized from the 16-bit values (groups run along tokens): its codes go into
  their bytes as the first or second element (a block's token t shares a byte with t + block/2,
  :func:`pallas_kernels.numerics.nvfp4.pack_pair`), the other element's bits kept;
* the mean of K's block holding p (the decode selection's k̄).

Nothing is written when the token does not fit (``fits`` false), as the twin does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._triton import compiler_params, pl, plgpu
from pallas_kernels.numerics import nvfp4


def _append_kernel(meta_ref, k_new_ref, v_new_ref, k_ref, v_ref, k4_ref, ks_ref, v4_ref, vs_ref, km_ref,
                   k_out, v_out, k4_out, ks_out, v4_out, vs_out, km_out, *, block):
    del k_ref, v_ref, k4_ref, ks_ref, v4_ref, vs_ref, km_ref  # aliased to the outputs, read through them
    d = k_new_ref.shape[-1]
    group = nvfp4.GROUP
    fits = meta_ref[1] > 0
    p = jnp.where(fits, meta_ref[0], 0)  # a token that does not fit (p = S_max) addresses slot 0: no read past the end

    def put(ref, value):  # nothing is written when the token does not fit
        plgpu.store(ref, value, mask=jnp.broadcast_to(fits, value.shape))

    k_row = k_new_ref[...].astype(k_out.dtype)  # (1, D) in the cache's dtype, as the twin rounds it
    v_row = v_new_ref[...].astype(v_out.dtype)

    # K: the token's codes and scales, each half of D apart (a byte holds channels i and i + D/2)
    def k_half(cols):
        return nvfp4.encode_last(k_new_ref[:, cols].astype(k_out.dtype).astype(jnp.float32))

    lo, sf_lo = k_half(pl.ds(0, d // 2))
    hi, sf_hi = k_half(pl.ds(d // 2, d // 2))
    put(k4_out.at[pl.ds(p, 1), :], nvfp4.pack_pair(lo, hi).astype(jnp.uint8))
    put(ks_out.at[pl.ds(p, 1), pl.ds(0, d // 2 // group)], sf_lo.astype(ks_out.dtype))
    put(ks_out.at[pl.ds(p, 1), pl.ds(d // 2 // group, d // 2 // group)], sf_hi.astype(ks_out.dtype))

    # V: the token's 16-token group from the 16-bit cache (the new row in place of the cached one, zeros after it)
    g0 = (p // group) * group
    rows = g0 + jax.lax.broadcasted_iota(jnp.int32, (group, 1), 0)
    vg = jnp.where(rows == p, v_row, v_out[pl.ds(g0, group), :]).astype(jnp.float32)  # (16, D)
    codes, sf = nvfp4.encode_last(vg.T)  # groups along tokens: (D, 16) codes, (D, 1) scales
    offset = g0 % block  # the group's first token within its block; a group sits in one half of it
    high = offset >= block // 2
    at = (pl.ds((g0 // block) * d, d), pl.ds(offset % (block // 2), group))  # its block's D rows (block-major)
    old = v4_out[at].astype(jnp.int32)  # (D, 16): V is channel-major within a block
    zero = jnp.zeros_like(codes)  # the other element's bits of each byte kept (nvfp4.HALF_BITS)
    new = jnp.where(high, (old & nvfp4.HALF_BITS[0]) | nvfp4.pack_pair(zero, codes),
                    (old & nvfp4.HALF_BITS[1]) | nvfp4.pack_pair(codes, zero))
    put(v4_out.at[at], new.astype(jnp.uint8))
    put(vs_out.at[pl.ds(p // group, 1), :], sf.T.astype(vs_out.dtype))

    # the mean of K's block holding p, over its 16-bit rows with the new one
    b0 = (p // block) * block
    rows = b0 + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
    kb = jnp.where(rows == p, k_row, k_out[pl.ds(b0, block), :]).astype(jnp.float32)
    put(km_out.at[pl.ds(p // block, 1), :], jnp.mean(kb, axis=0, keepdims=True))

    # last: the 16-bit rows (the V group and the block mean above read the cached rows, not these)
    put(k_out.at[pl.ds(p, 1), :], k_row)
    put(v_out.at[pl.ds(p, 1), :], v_row)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def thrift_append_token(meta: jax.Array, k_new: jax.Array, v_new: jax.Array, k: jax.Array, v: jax.Array,
                        k4: jax.Array, k4_scale: jax.Array, v4: jax.Array, v4_scale: jax.Array, k_mean: jax.Array, *,
                        block: int, interpret: bool = False) -> tuple[jax.Array, ...]:
    """One token into every part of a :class:`lowbit_jax.ThriftKVCache`, in place (the arrays are aliased).

    Args:
      meta: int32 (2,): the token's position p (the cache's length) and 1 if it fits (p < S_max), else 0.
      k_new, v_new: (B, Hkv, 1, D) the token's key and value (any float dtype; rounded to the cache's).
      k, v: (B, S_max, Hkv, D) the 16-bit cache; k4: uint8 (B, Hkv, S_max, D/2), k4_scale: float8_e4m3fn
        (B, Hkv, S_max, D/16); v4: uint8 (B, Hkv, S_max/block · D, block/2), v4_scale: float8_e4m3fn
        (B, Hkv, S_max/16, D);
        k_mean: float32 (B, Hkv, S_max/block, D) (the :class:`lowbit_jax.ThriftKVCache` layout).
      block: the cache's block.
    Returns:
      (k, v, k4, k4_scale, v4, v4_scale, k_mean) with the token written (unchanged when it does not fit).
    """
    b, s_max, hkv, d = k.shape
    seq_major = pl.BlockSpec((None, s_max, None, d), lambda bi, h: (bi, 0, h, 0))
    head = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda bi, h: (bi, h, 0, 0))  # noqa: E731
    row = pl.BlockSpec((None, None, 1, d), lambda bi, h: (bi, h, 0, 0))
    arrays = (k, v, k4, k4_scale, v4, v4_scale, k_mean)
    specs = [seq_major, seq_major] + [head(x) for x in arrays[2:]]
    return pl.pallas_call(
        functools.partial(_append_kernel, block=block),
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((2,), lambda bi, h: (0,)), row, row] + specs,
        out_specs=specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays],
        input_output_aliases={3 + i: i for i in range(len(arrays))},
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
        name="thrift_append_token",
    )(meta, k_new, v_new, *arrays)
