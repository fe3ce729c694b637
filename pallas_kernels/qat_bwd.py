"""Attn-QAT backward: recompute P with the forward's FP4 fake quantization, Pallas lowered through Triton.

docs/spec.md, Attn-QAT, the two principles: (1) P is recomputed from Q̃, K̃ and the
forward's row max m and L (P = exp2(S − m)/l), and dV uses FQ(P) — the same NVFP4
fake quantization (groups of 16 keys per row, relative to the row max) as the
forward's output path; (2) D = rowsum(dO ∘ O') with the
high-precision O' (computed by the XLA-fused preprocess, a memory-bound op).
Straight-through to Q, K, V: the gradients w.r.t. Q̃, K̃, Ṽ are returned as is.

Two kernels, as FlashAttention-2's Triton backward:

* ``qat_bwd_dkdv`` — one program per key tile (and batch, kv head), looping over
  the query tiles of every query head of its GQA group: S, P, dV += FQ(P)ᵀdO,
  dP = dO·Ṽᵀ, dS = P ∘ (dP − D), dK += dSᵀQ̃.
* ``qat_bwd_dq`` — one program per query tile, looping over key tiles: the same
  S, P, dP, dS; dQ += dS·K̃.

``naive=True`` is the mismatched 16-bit backward (the ablation): dV = PᵀdO and
D from the FP4 output O.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import nvfp4
from pallas_kernels.numerics.qat_rows import backward_rows
from pallas_kernels._triton import compiler_params, pl, row_mask, store_rows
from pallas_kernels.configs import QatConfig
from pallas_kernels.numerics.tile_ranges import key_tile_range, query_tile_range, visible

LOG2E = math.log2(math.e)
DOT_NT = (((1,), (1,)), ((), ()))  # A·Bᵀ
DOT_NN = (((1,), (0,)), ((), ()))  # A·B
DOT_TN = (((0,), (0,)), ((), ()))  # Aᵀ·B


def _dkdv_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, dk_ref, dv_ref, *, block_q, block_k, sq_len,
                 sk_len, sk_pad, causal, score_scale, scale, group, n_qblocks, naive):
    kj = pl.program_id(0)
    k_start = kj * block_k
    k = k_ref[...]
    v = v_ref[...]
    cols = k_start + jnp.arange(block_k, dtype=jnp.int32)
    ragged_k = sk_pad != sk_len
    i_first, i_unmasked = query_tile_range(k_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                           causal=causal, n_qblocks=n_qblocks)

    def step(i, carry, g, masked):
        dk, dv = carry
        rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q = q_ref[g, rows, :]
        do = do_ref[g, rows, :]
        s = lax.dot_general(q, k, DOT_NT, preferred_element_type=jnp.float32) * score_scale
        if masked or ragged_k:
            q_idx = i * block_q + jnp.arange(block_q, dtype=jnp.int32)
            s = jnp.where(visible(q_idx[:, None], cols[None, :], sq_len, sk_len, causal), s, -jnp.inf)
        e = jnp.exp2(s - m_ref[g, rows][:, None])  # row max 1: FQ relative to it, as the forward
        inv_l = il_ref[g, rows][:, None]  # 0 for padding and rows that see no key
        p = e * inv_l
        pv = p if naive else nvfp4.fake_quant_probabilities(e, do.dtype, times=inv_l, emulated=False)
        dv = dv + lax.dot_general(pv.astype(do.dtype), do, DOT_TN, preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, DOT_NT, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_ref[g, rows][:, None])).astype(q.dtype)
        dk = dk + lax.dot_general(ds, q, DOT_TN, preferred_element_type=jnp.float32)
        return dk, dv

    def head(g, carry):
        if causal:
            carry = lax.fori_loop(i_first, i_unmasked, functools.partial(step, g=g, masked=True), carry)
        return lax.fori_loop(i_unmasked, n_qblocks, functools.partial(step, g=g, masked=False), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    valid = row_mask(k_start, block_k, sk_len) if ragged_k else None
    store_rows(dk_ref, (dk * scale).astype(dk_ref.dtype), valid)
    store_rows(dv_ref, dv.astype(dv_ref.dtype), valid)


def _dq_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, dq_ref, *, block_q, block_k, sq_len, sk_len, sq_pad,
               causal, score_scale, scale):
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    do = do_ref[...]
    m = m_ref[...]
    inv_l = il_ref[...]
    delta = delta_ref[...]
    rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
    n_unmasked, n_total = key_tile_range(q_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                         causal=causal)

    def step(j, dq, masked):
        keys = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
        k = k_ref[keys, :]
        s = lax.dot_general(q, k, DOT_NT, preferred_element_type=jnp.float32) * score_scale
        if masked:
            cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.where(visible(rows[:, None], cols[None, :], sq_len, sk_len, causal), s, -jnp.inf)
        p = jnp.exp2(s - m[:, None]) * inv_l[:, None]
        dp = lax.dot_general(do, v_ref[keys, :], DOT_NT, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[:, None])).astype(k.dtype)
        return dq + lax.dot_general(ds, k, DOT_NN, preferred_element_type=jnp.float32)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), dq)
    if causal or sk_len % block_k:
        dq = lax.fori_loop(n_unmasked, n_total, functools.partial(step, masked=True), dq)
    store_rows(dq_ref, (dq * scale).astype(dq_ref.dtype), row_mask(q_start, block_q, sq_len) if sq_pad != sq_len
               else None)


@functools.partial(jax.jit, static_argnames=("sq_len", "sk_len", "causal", "scale", "config", "naive", "interpret"))
def qat_attention_bwd(qf, kf, vf, o_aux, lse, m, do, *, sq_len: int, sk_len: int, causal: bool, scale: float,
                      config: QatConfig, naive: bool = False, interpret: bool = False):
    """Attn-QAT gradients w.r.t. the fake-quantized operands (= w.r.t. q, k, v by the STE).

    Args:
      qf: (B, Hq, Sq_pad, D); kf, vf: (B, Hkv, Sk_pad, D) — the forward's residuals.
      o_aux: O' (B, Sq, Hq, D), or the FP4 output O when ``naive``.
      lse, m: the forward's base-2 log-sum-exp and row max, float32 (B, Hq, Sq).
      do: (B, Sq, Hq, D).
    Returns:
      dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D), in do's dtype.
    """
    b, hq, sq_pad, d = qf.shape
    hkv, sk_pad = kf.shape[1], kf.shape[2]
    group = hq // hkv
    bq, bk = config.bwd_block_q, config.bwd_block_k
    nqb, nkb = sq_pad // bq, sk_pad // bk
    delta, m, inv_l, do_h = backward_rows(o_aux, lse, m, do, seq_pad=sq_pad, dtype=qf.dtype)
    params = compiler_params(config.bwd_warps, config.bwd_stages)
    common = dict(block_q=bq, block_k=bk, sq_len=sq_len, sk_len=sk_len, causal=causal, score_scale=scale * LOG2E,
                  scale=scale)

    grp = lambda *tail: pl.BlockSpec((None, group) + tail, lambda j, bi, hi: (bi, hi) + (0,) * len(tail))  # noqa: E731
    kv_tile = pl.BlockSpec((None, None, bk, d), lambda j, bi, hi: (bi, hi, j, 0))
    out_spec = pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, sk_pad=sk_pad, group=group, n_qblocks=nqb, naive=naive, **common),
        grid=(nkb, b, hkv),
        in_specs=[grp(sq_pad, d), grp(sq_pad, d), grp(sq_pad), grp(sq_pad), grp(sq_pad), kv_tile, kv_tile],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, sk_len, hkv, d), do.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="qat_bwd_dkdv",
    )(qf, do_h, m, inv_l, delta, kf, vf)

    q_tile = lambda *tail: pl.BlockSpec((None, None, bq) + tail, lambda i, bi, hi: (bi, hi, i) + (0,) * len(tail))  # noqa: E731
    kv_full = pl.BlockSpec((None, None, sk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, sq_pad=sq_pad, **common),
        grid=(nqb, b, hq),
        in_specs=[q_tile(d), q_tile(d), q_tile(), q_tile(), q_tile(), kv_full, kv_full],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, sq_len, hq, d), do.dtype),
        compiler_params=params,
        interpret=interpret,
        name="qat_bwd_dq",
    )(qf, do_h, m, inv_l, delta, kf, vf)
    return dq, dk, dv
