"""Attn-QAT forward: flash attention with NVFP4 fake-quantized P, Pallas lowered through Triton.

docs/spec.md, Attn-QAT. One program owns ``block_q`` query rows of one (batch, head)
and loops over key tiles of the fake-quantized K̃, Ṽ (from
:mod:`pallas_kernels.fake_quant`): S = Q̃K̃ᵀ·scale·log2 e (16-bit MMA, fp32
accumulation), online softmax in base 2, P = exp2(S − m), P̃ = FQ(P) in groups of
16 keys per row (in registers, :func:`pallas_kernels.numerics.nvfp4.fake_quant_probabilities`; bf16 arithmetic
for bf16 operands),
O += P̃Ṽ and — for the backward — the high-precision O' += PṼ; l from the
unquantized P. Writes O, O' (optional), the base-2 log-sum-exp L (+inf for
rows that see no key) and the row max m (the backward's FQ(P) reference point). The H200 has no FP4 tensor cores: FP4 is emulated, the
MMAs are bf16/fp16 on exactly representable values.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import int8, nvfp4, sage_tiles
from pallas_kernels._triton import compiler_params, pl, row_mask, store_rows
from pallas_kernels.configs import QatConfig
from pallas_kernels.numerics.online_softmax import online_softmax_step
from pallas_kernels.numerics.tile_ranges import key_tile_range, visible

LOG2E = math.log2(math.e)
DOT_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands
DOT_NN = (((1,), (0,)), ((), ()))


def _qat_fwd_kernel(q_ref, k_ref, v_ref, *refs, block_q, block_k, sq_len, sk_len, causal, score_scale, with_aux,
                    n_qblocks):
    if with_aux:
        o_ref, o2_ref, lse_ref, m_ref_out = refs
    else:
        (o_ref, lse_ref, m_ref_out), o2_ref = refs, None
    qi = pl.program_id(0)
    if causal:  # heaviest query tiles first
        qi = n_qblocks - 1 - qi
    q_start = qi * block_q
    q = q_ref[...]
    rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
    n_unmasked, n_total = key_tile_range(q_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                         causal=causal)

    def step(j, carry, masked):
        acc, acc2, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        s = lax.dot_general(q, k, DOT_NT, preferred_element_type=jnp.float32) * score_scale
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.where(visible(rows[:, None], cols[None, :], sq_len, sk_len, causal), s, -jnp.inf)
        (p,), alpha, m_new, l_new = online_softmax_step([s], m_prev, l_prev, masked=masked)
        v = v_ref[pl.ds(start, block_k), :]
        pq = nvfp4.fake_quant_probabilities(p, v.dtype, emulated=False).astype(v.dtype)
        acc = acc * alpha[:, None] + lax.dot_general(pq, v, DOT_NN, preferred_element_type=jnp.float32)
        if with_aux:
            acc2 = acc2 * alpha[:, None] + lax.dot_general(p.astype(v.dtype), v, DOT_NN,
                                                           preferred_element_type=jnp.float32)
        return acc, acc2, m_new, l_new

    zeros = jnp.zeros(q.shape, jnp.float32)
    carry = (zeros, zeros, jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), carry)
    if causal or sk_len % block_k:
        carry = lax.fori_loop(n_unmasked, n_total, functools.partial(step, masked=True), carry)
    acc, acc2, m, l = carry
    inv_l = int8.reciprocal_or_zero(l)[:, None]
    lse = sage_tiles.base2_lse(m, l)
    valid = row_mask(q_start, block_q, sq_len) if sq_len % block_q else None
    store_rows(o_ref, (acc * inv_l).astype(o_ref.dtype), valid)
    if with_aux:
        store_rows(o2_ref, (acc2 * inv_l).astype(o2_ref.dtype), valid)
    store_rows(lse_ref, lse, (rows < sq_len) if sq_len % block_q else None)
    store_rows(m_ref_out, m, (rows < sq_len) if sq_len % block_q else None)


@functools.partial(
    jax.jit, static_argnames=("sq_len", "sk_len", "causal", "scale", "out_dtype", "config", "with_aux", "interpret")
)
def qat_attention_fwd(qf: jax.Array, kf: jax.Array, vf: jax.Array, *, sq_len: int, sk_len: int, causal: bool,
                      scale: float, out_dtype, config: QatConfig, with_aux: bool = True, interpret: bool = False):
    """Attn-QAT forward on fake-quantized operands.

    Args:
      qf: (B, Hq, Sq_pad, D); kf, vf: (B, Hkv, Sk_pad, D), bf16/fp16, padded to
        multiples of the tiles (rows beyond the real lengths are ignored).
      sq_len, sk_len: real lengths. causal: bottom-right aligned mask.
      scale: softmax scale. out_dtype: dtype of O and O'.
      config: tiles (``block_k`` sets the FP4 groups of P̃ relative to the running max).
      with_aux: also return O' (needed for the backward).
    Returns:
      o (B, Sq, Hq, D), o_aux (same, or None), base-2 lse float32 (B, Hq, Sq), and
      the base-2 row max m of the scores float32 (B, Hq, Sq; −inf for rows that see
      no key) — the backward quantizes P relative to it, as the forward did.
    """
    b, hq, sq_pad, d = qf.shape
    hkv, sk_pad = kf.shape[1], kf.shape[2]
    group = hq // hkv
    bq, bk = config.block_q, config.block_k
    nqb = sq_pad // bq
    qblk = (lambda i: nqb - 1 - i) if causal else (lambda i: i)
    kv_spec = pl.BlockSpec((None, None, sk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0))
    o_spec = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, qblk(i), hi, 0))
    o_shape = jax.ShapeDtypeStruct((b, sq_len, hq, d), out_dtype)
    row_spec = pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qblk(i)))
    row_shape = jax.ShapeDtypeStruct((b, hq, sq_len), jnp.float32)
    out_specs = [o_spec] + ([o_spec] if with_aux else []) + [row_spec, row_spec]
    out_shape = [o_shape] + ([o_shape] if with_aux else []) + [row_shape, row_shape]
    kernel = functools.partial(_qat_fwd_kernel, block_q=bq, block_k=bk, sq_len=sq_len, sk_len=sk_len, causal=causal,
                               score_scale=scale * LOG2E, with_aux=with_aux, n_qblocks=nqb)
    outs = pl.pallas_call(
        kernel,
        grid=(nqb, b, hq),
        in_specs=[pl.BlockSpec((None, None, bq, d), lambda i, bi, hi: (bi, hi, qblk(i), 0)), kv_spec, kv_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="qat_attention_fwd",
    )(qf, kf, vf)
    if with_aux:
        return tuple(outs)
    return outs[0], None, outs[1], outs[2]
