"""ThriftAttention prefill: one online softmax over 16-bit and NVFP4 key blocks, Pallas lowered through Triton.

shared/SPEC.md §3.2–3.3; the twin is :func:`lowbit_jax.thrift_reference.prefill_reference`. A program owns
one query block (``config.block`` rows) of one (batch, head) and walks its valid key blocks in the
order of :func:`lowbit_jax.thrift_reference.block_order` (from the selection of
:mod:`pallas_kernels.thrift_select`): first the NVFP4 blocks (S = Q̃K̃ᵀ, O += FQ(P)·Ṽ, FQ(P) in groups of
16 keys by the shared :func:`lowbit_jax.formats.nvfp4.fake_quant_last`) — those every row sees whole
without a mask, then the masked ones — then the 16-bit blocks (S = QKᵀ, O += P·V): three loops without a
branch inside, so Triton pipelines their loads (on the H200, with every block 16-bit: 6.9 ms at B1 H32/8
S16384 D128 causal against 9.7 ms with a branch per block; cuDNN 3.7 ms). Q̃ is fake-quantized once per
program in registers; the 16-bit blocks are read from K and V in place (no copy), K̃ and Ṽ come from one
fused pass each (:func:`pallas_kernels.fake_quant.fp4_fake_quant_heads`) as 16-bit arrays. The H200 has no
FP4 tensor cores: the FP4 path runs bf16 MMAs on exactly representable values and adds FQ(P) in registers,
so on this card the prefill is slower than 16-bit attention (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowbit_jax.formats import int8, nvfp4
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask, store_rows
from pallas_kernels.configs import ThriftConfig
from pallas_kernels.online_softmax import online_softmax_step
from pallas_kernels.tile_ranges import key_tile_range, selectable_key_blocks, visible

LOG2E = math.log2(math.e)
DOT_NT = (((1,), (1,)), ((), ()))
DOT_NN = (((1,), (0,)), ((), ()))


def _prefill_kernel(q_ref, k_ref, v_ref, kq_ref, vq_ref, order_ref, o_ref, *, block, sq_len, sk_len, causal,
                    score_scale, n_qblocks, k, dtype):
    qi = pl.program_id(0)
    if causal:  # heaviest query blocks first
        qi = n_qblocks - 1 - qi
    q_start = qi * block
    ragged = sq_len % block != 0
    valid = row_mask(q_start, block, sq_len) if ragged else None
    qf = load_rows(q_ref, valid).astype(jnp.float32)
    q16, qfq = qf.astype(dtype), nvfp4.fake_quant_last(qf).astype(dtype)
    rows = q_start + jnp.arange(block, dtype=jnp.int32)
    n_kb = pl.cdiv(sk_len, block)
    n_valid = selectable_key_blocks(q_start, block=block, sq_len=sq_len, sk_len=sk_len, causal=causal)
    n_high = jnp.minimum(n_valid, k)
    n_low = n_valid - n_high
    n_unmasked, _ = key_tile_range(q_start, block_q=block, block_k=block, sq_len=sq_len, sk_len=sk_len,
                                   causal=causal)
    order = order_ref[...].astype(jnp.int32)
    entries = jnp.arange(order.shape[0], dtype=jnp.int32)
    n_low_whole = jnp.sum(((entries < n_low) & (order < n_unmasked)).astype(jnp.int32))  # ascending: a prefix

    def step(i, carry, masked, high):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(order_ref[i].astype(jnp.int32) * block, block)
        keys = pl.ds(start, block)
        k_tile = k_ref[keys, :].astype(dtype) if high else kq_ref[keys, :]
        s = lax.dot_general(q16 if high else qfq, k_tile, DOT_NT, preferred_element_type=jnp.float32) * score_scale
        if masked:
            cols = start + jnp.arange(block, dtype=jnp.int32)
            s = jnp.where(visible(rows[:, None], cols[None, :], sq_len, sk_len, causal), s, -jnp.inf)
        (p,), alpha, m_new, l_new = online_softmax_step([s], m_prev, l_prev, masked=masked)
        pq = p if high else nvfp4.fake_quant_last(p, nonnegative=True)
        v_tile = v_ref[keys, :].astype(dtype) if high else vq_ref[keys, :]
        update = lax.dot_general(pq.astype(dtype), v_tile, DOT_NN, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + update, m_new, l_new

    carry = (jnp.zeros(qf.shape, jnp.float32), jnp.full((block,), -jnp.inf, jnp.float32),
             jnp.zeros((block,), jnp.float32))
    if k < n_kb:  # some block in 4-bit (static: k covers every row's valid blocks)
        carry = lax.fori_loop(0, n_low_whole, functools.partial(step, masked=False, high=False), carry)
        carry = lax.fori_loop(n_low_whole, n_low, functools.partial(step, masked=True, high=False), carry)
    if k > 0:
        carry = lax.fori_loop(n_low, n_valid, functools.partial(step, masked=True, high=True), carry)
    acc, _, l = carry
    store_rows(o_ref, (acc * int8.reciprocal_or_zero(l)[:, None]).astype(o_ref.dtype), valid)


@functools.partial(jax.jit, static_argnames=("sq_len", "sk_len", "causal", "scale", "k", "config", "interpret"))
def thrift_prefill(q: jax.Array, k16: jax.Array, v16: jax.Array, kq: jax.Array, vq: jax.Array, order: jax.Array, *,
                   sq_len: int, sk_len: int, causal: bool, scale: float, k: int, config: ThriftConfig,
                   interpret: bool = False) -> jax.Array:
    """Mixed-precision attention forward.

    Args:
      q: (B, Sq, Hq, D) bf16/fp16/fp32.
      k16, v16: (B, Sk_pad, Hkv, D) K and V as the caller gave them (rows ≥ Sk zero), read in place for the
        16-bit blocks and cast to kq's dtype in registers; Sk_pad a multiple of ``config.block``.
      kq, vq: (B, Hkv, Sk_pad, D) 16-bit K̃, Ṽ (:func:`pallas_kernels.fake_quant.fp4_fake_quant_heads`,
        "channels" for K and "tokens" for V).
      order: int16 (B, Hq, Nqb_pad, Nkb_pad): each query block's key blocks, its 4-bit ones then its 16-bit ones
        (:func:`lowbit_jax.thrift_reference.block_order` of the selection).
      sq_len, sk_len, causal: real lengths and the bottom-right aligned mask; scale: softmax scale.
      k: 16-bit blocks per query block (:func:`lowbit_jax.thrift_reference.topk_count`; fewer where a query
        block has fewer valid ones).
    Returns:
      (B, Sq, Hq, D) in q's dtype; rows that see no key are zeros.
    """
    b, _, hq, d = q.shape
    hkv, sk_pad = kq.shape[1], kq.shape[2]
    group = hq // hkv
    bk = config.block
    nqb = -(-sq_len // bk)
    qblk = (lambda i: nqb - 1 - i) if causal else (lambda i: i)
    seq_major = pl.BlockSpec((None, sk_pad, None, d), lambda i, bi, hi: (bi, 0, hi // group, 0))
    head_major = pl.BlockSpec((None, None, sk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0))
    row_spec = pl.BlockSpec((None, bk, None, d), lambda i, bi, hi: (bi, qblk(i), hi, 0))
    order_spec = pl.BlockSpec((None, None, None, order.shape[3]), lambda i, bi, hi: (bi, hi, qblk(i), 0))
    kernel = functools.partial(_prefill_kernel, block=bk, sq_len=sq_len, sk_len=sk_len, causal=causal,
                               score_scale=scale * LOG2E, n_qblocks=nqb, k=k, dtype=kq.dtype)
    return pl.pallas_call(
        kernel,
        grid=(nqb, b, hq),
        in_specs=[row_spec, seq_major, seq_major, head_major, head_major, order_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="thrift_prefill",
    )(q, k16, v16, kq, vq, order)
