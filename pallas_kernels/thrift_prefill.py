"""ThriftAttention prefill: one online softmax over 16-bit and NVFP4 key blocks, Pallas lowered through Triton.

docs/spec.md, ThriftAttention; the twin is :func:`lowbit_jax.thrift_reference.prefill_reference`. A program owns
one query block (``config.block`` rows) of one (batch, head) and walks its valid key blocks in the
order of :func:`lowbit_jax.thrift_reference.block_order` (from the selection of
:mod:`pallas_kernels.thrift_select`): first the NVFP4 blocks (S = Q̃K̃ᵀ, O += FQ(P)·Ṽ, FQ(P) in groups of
16 keys by the shared :func:`pallas_kernels.numerics.nvfp4.fake_quant_last`) — those every row sees whole
without a mask, then the masked ones — then the 16-bit blocks (S = QKᵀ, O += P·V): three loops without a
branch inside, so Triton pipelines their loads (on the H200, with every block 16-bit: 6.9 ms at B1 H32/8
S16384 D128 causal against 9.7 ms with a branch per block; cuDNN 3.7 ms). Q̃ is fake-quantized once per
program in registers; the 16-bit blocks are read from K and V in place (no copy), K̃ and Ṽ come from one
fused pass each (:func:`pallas_kernels.fake_quant.fp4_fake_quant_heads`) as 16-bit arrays. The H200 has no
FP4 tensor cores: the FP4 path runs bf16 MMAs on exactly representable values and adds FQ(P) in registers,
so on Hopper the prefill is slower than 16-bit attention (benchmarks/RESULTS.md). A call covers
``n_blocks`` query blocks from a traced ``first_block`` and can update an output in place, so that
:mod:`lowbit_jax.thrift` runs a long prefill in chunks of ``ThriftConfig.prefill_chunk`` blocks (one compiled
kernel for every chunk) and only a chunk's selection and block order exist at a time.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import int8, nvfp4
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask, store_rows
from pallas_kernels.configs import ThriftConfig
from pallas_kernels.numerics.online_softmax import online_softmax_step
from pallas_kernels.numerics.tile_ranges import key_tile_range, selectable_key_blocks, visible

LOG2E = math.log2(math.e)
DOT_NT = (((1,), (1,)), ((), ()))
DOT_NN = (((1,), (0,)), ((), ()))


def _prefill_kernel(first_ref, q_ref, k_ref, v_ref, kq_ref, vq_ref, order_ref, *out_refs, block, sq_len, sk_len,
                    causal, score_scale, n_programs, k, dtype):
    o_ref = out_refs[-1]  # (an aliased accumulator input comes before it)
    qi = pl.program_id(0)
    if causal:  # heaviest query blocks first
        qi = n_programs - 1 - qi
    q_start = pl.multiple_of((first_ref[0] + qi) * block, block)
    ragged = sq_len % block != 0
    valid = row_mask(q_start, block, sq_len) if ragged else None
    qf = load_rows(q_ref.at[pl.ds(q_start, block), :], valid).astype(jnp.float32)
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
    store_rows(o_ref.at[pl.ds(q_start, block), :], (acc * int8.reciprocal_or_zero(l)[:, None]).astype(o_ref.dtype),
               valid)


@functools.partial(jax.jit, static_argnames=("n_blocks", "sq_len", "sk_len", "causal", "scale", "k", "config",
                                             "interpret"))
def thrift_prefill(q: jax.Array, k16: jax.Array, v16: jax.Array, kq: jax.Array, vq: jax.Array, order: jax.Array,
                   first_block: jax.Array | int = 0, out: jax.Array | None = None, *, n_blocks: int | None = None,
                   sq_len: int, sk_len: int, causal: bool, scale: float, k: int, config: ThriftConfig,
                   interpret: bool = False) -> jax.Array:
    """Mixed-precision attention forward of ``n_blocks`` query blocks from ``first_block`` on (default: all).

    Args:
      q: (B, Sq_pad, Hq, D) bf16/fp16/fp32, Sq_pad a multiple of ``config.block`` (zero rows after ``sq_len``).
      k16, v16: (B, Sk_pad, Hkv, D) K and V as the caller gave them (rows ≥ Sk zero), read in place for the
        16-bit blocks and cast to kq's dtype in registers; Sk_pad a multiple of ``config.block``.
      kq, vq: (B, Hkv, Sk_pad, D) 16-bit K̃, Ṽ (:func:`pallas_kernels.fake_quant.fp4_fake_quant_heads`,
        "channels" for K and "tokens" for V).
      order: int16 (B, Hq, ≥ n_blocks, Nkb_pad): each of these query blocks' key blocks, its 4-bit ones then its
        16-bit ones (:func:`lowbit_jax.thrift_reference.block_order` of the selection), row 0 for ``first_block``.
      first_block: int32 scalar (may be traced: one compiled kernel serves every chunk of a long prefill).
      out: (B, Sq_pad, Hq, D) q's dtype, updated in place (its other rows kept), or None for a new array whose
        rows outside these blocks are undefined.
      n_blocks: query blocks of this call (static), default all ``ceil(sq_len / block)``.
      sq_len, sk_len, causal: real lengths and the bottom-right aligned mask; scale: softmax scale.
      k: 16-bit blocks per query block (:func:`lowbit_jax.thrift_reference.topk_count`; fewer where a query
        block has fewer valid ones).
    Returns:
      (B, Sq_pad, Hq, D) in q's dtype; rows that see no key are zeros.
    """
    b, sq_pad, hq, d = q.shape
    hkv, sk_pad = kq.shape[1], kq.shape[2]
    group = hq // hkv
    bk = config.block
    n = -(-sq_len // bk) if n_blocks is None else n_blocks
    qblk = (lambda i: n - 1 - i) if causal else (lambda i: i)
    seq_major = lambda rows, heads: pl.BlockSpec((None, rows, None, d),  # noqa: E731
                                                 lambda i, bi, hi: (bi, 0, heads(hi), 0))
    head_major = pl.BlockSpec((None, None, sk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0))
    order_spec = pl.BlockSpec((None, None, None, order.shape[3]), lambda i, bi, hi: (bi, hi, qblk(i), 0))
    first = jnp.asarray(first_block, jnp.int32).reshape(1)
    kernel = functools.partial(_prefill_kernel, block=bk, sq_len=sq_len, sk_len=sk_len, causal=causal,
                               score_scale=scale * LOG2E, n_programs=n, k=k, dtype=kq.dtype)
    q_spec, kv_spec = seq_major(sq_pad, lambda hi: hi), seq_major(sk_pad, lambda hi: hi // group)
    in_specs = [pl.BlockSpec((1,), lambda i, bi, hi: (0,)), q_spec, kv_spec, kv_spec, head_major, head_major,
                order_spec]
    args = [first, q, k16, v16, kq, vq, order]
    if out is not None:
        in_specs.append(q_spec)
        args.append(out)
    return pl.pallas_call(
        kernel,
        grid=(n, b, hq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases={} if out is None else {len(args) - 1: 0},
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="thrift_prefill",
    )(*args)
