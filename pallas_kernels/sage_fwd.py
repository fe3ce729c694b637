"""INT8 flash-attention forward (SageAttention), Pallas lowered through Triton.

One program owns ``block_q`` query rows of one (batch, head) and loops over key
tiles: INT8 Q̂K̂ᵀ → int32, online softmax in base 2, P̃ quantized to INT8 per
row (scale = row max / 127, taken from the row max the softmax already has),
INT8 P̂·V̂ → int32 with V̂ stored transposed so both INT8 products contract over
contiguous memory, fp32 accumulators. Also writes the base-2 log-sum-exp L the
backward needs (of the smoothed, scaled scores; +inf for rows that see no key).

Per score element the fast path (per-block K scale, no bias) spends: an integer
add that turns the int32 score into a biased float (no int→float conversion), a
row max, a subtract and a multiply, exp2, the row sum, one FFMA that rounds P to
INT8. Key tiles are split into unmasked ones (no mask arithmetic) and the few
masked ones (ragged tail, causal diagonal).

With e4m3 V̂ᵀ (``SageFwdConfig.pv_format="e4m3"``) P̃ is taken at the running row max and coded e4m3, and the
product runs as a bf16 dot of the e4m3 values (exact products, so the FP8 numerics on any GPU; sm_89+ for the
conversions).

Inputs come from :mod:`pallas_kernels.quantize`; validation is the caller's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import e4m3, int8, sage_tiles
from pallas_kernels._triton import compiler_params, pl, row_mask, store_rows
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.numerics.tile_ranges import key_tile_range, visible

_DOT_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands (K-major)


def _sage_fwd_kernel(
    q_ref, qs_ref, k_ref, ks_ref, vt_ref, vs_ref, *refs,
    block_q, block_k, sq_len, sk_len, causal, k_per_block, has_bias, n_qblocks, e4m3_pv,
):
    if has_bias:
        bias_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    qi = pl.program_id(0)
    if causal:  # heaviest query tiles first: less tail imbalance
        qi = n_qblocks - 1 - qi
    q_start = qi * block_q
    q = q_ref[...]
    qs = qs_ref[...]
    fast = k_per_block and not has_bias

    n_unmasked, n_total = key_tile_range(q_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                         causal=causal)

    rows = q_start + jnp.arange(block_q, dtype=jnp.int32)

    def step(j, carry, masked):
        acc, m_prev, l_prev = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]
        s_int = lax.dot_general(q, k, _DOT_NT, preferred_element_type=jnp.int32)
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)
            mask = visible(rows[:, None], cols[None, :], sq_len, sk_len, causal)
        if fast:
            c = qs * ks_ref[start]  # per-row score scale of this tile
            x = int8.int32_as_biased_float(s_int)  # MAGIC + s, exact
            if masked:
                x = jnp.where(mask, x, -jnp.inf)
            mx = jnp.max(x, axis=1)
            m_cur = (mx - int8.MAGIC) * c
            if masked:
                mx = jnp.where(mx == -jnp.inf, int8.MAGIC, mx)
        else:
            s = s_int.astype(jnp.float32) * qs[:, None] * ks_ref[pl.ds(start, block_k)][None, :]
            if has_bias:
                s = s + bias_ref[pl.ds(start, block_k)][None, :]
            if masked:
                s = jnp.where(mask, s, -jnp.inf)
            m_cur = jnp.max(s, axis=1)
        m_new = jnp.maximum(m_prev, m_cur)
        if masked:
            m_new_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new_ref = m_new
        alpha = jnp.exp2(m_prev - m_new_ref)
        if e4m3_pv:  # P̃·448 at the running max, e4m3 codes
            scores = (x - int8.MAGIC) * c[:, None] if fast else s
            e = jnp.exp2(scores - (m_new_ref - e4m3.LOG2_MAX)[:, None])
            vt = vt_ref[:, pl.ds(start, block_k)]
            # e4m3 × e4m3 products are exact in bf16 × bf16 → f32: a bf16 dot keeps the FP8 numerics on any GPU
            pv = lax.dot_general(e4m3.encode_probabilities(e).astype(jnp.bfloat16), vt.astype(jnp.bfloat16),
                                 _DOT_NT, preferred_element_type=jnp.float32)
            l_new = l_prev * alpha + jnp.sum(e, axis=1)
            if fast:  # a non-finite scale makes the row NaN: its scores' signs alone could make it look masked
                l_new = l_new + (c - c)
            return acc * alpha[:, None] + pv, m_new, l_new
        if fast:
            e = jnp.exp2((x - mx[:, None]) * c[:, None])
        else:
            m_ref = jnp.where(m_cur == -jnp.inf, 0.0, m_cur) if masked else m_cur
            e = jnp.exp2(s - m_ref[:, None])
        beta = jnp.exp2(m_cur - m_new_ref)  # = row max of this tile's P̃
        l_new = l_prev * alpha + beta * jnp.sum(e, axis=1)
        p8 = int8.encode_unit_interval(e, truncating_convert=True)
        vt = vt_ref[:, pl.ds(start, block_k)]
        pv = lax.dot_general(p8, vt, _DOT_NT, preferred_element_type=jnp.int32)
        pv_f = int8.int32_as_biased_float(pv) - int8.MAGIC
        acc = acc * alpha[:, None] + pv_f * (beta * (1.0 / int8.QMAX))[:, None]
        return acc, m_new, l_new

    head_dim = q.shape[-1]
    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), carry)
    if causal or sk_len % block_k:
        carry = lax.fori_loop(n_unmasked, n_total, functools.partial(step, masked=True), carry)
    acc, m, l = carry
    o = acc * int8.reciprocal_or_zero(l)[:, None] * vs_ref[...][None, :]
    lse = sage_tiles.base2_lse(m - e4m3.LOG2_MAX if e4m3_pv else m, l)  # l sums P̃·448 with e4m3
    ragged = sq_len % block_q != 0
    store_rows(o_ref, o.astype(o_ref.dtype), row_mask(q_start, block_q, sq_len) if ragged else None)
    store_rows(lse_ref, lse, (rows < sq_len) if ragged else None)


@functools.partial(
    jax.jit,
    static_argnames=("sq_len", "sk_len", "causal", "k_per_block", "out_dtype", "config", "interpret"),
)
def sage_attention_fwd(
    q8: jax.Array,
    q_scale: jax.Array,
    k8: jax.Array,
    k_scale: jax.Array,
    vt8: jax.Array,
    v_scale: jax.Array,
    bias: jax.Array | None,
    *,
    sq_len: int,
    sk_len: int,
    causal: bool,
    k_per_block: bool,
    out_dtype: jnp.dtype,
    config: SageFwdConfig,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """INT8 attention forward on quantized operands.

    Args:
      q8: int8 (B, Hq, Sq_pad, D); q_scale float32 (B, Hq, Sq_pad) incl. scale·log2 e.
      k8: int8 (B, Hkv, Sk_pad, D); k_scale float32 (B, Hkv, Sk_pad).
      vt8: int8 or float8_e4m3fn (B, Hkv, D, Sk_pad); v_scale float32 (B, Hkv, D). With e4m3 codes
        (``SageFwdConfig.pv_format``), P̃ is taken at the running row max as e4m3 codes of P̃·448
        (:mod:`pallas_kernels.numerics.e4m3`).
      bias: float32 (B, Hq, Sq_pad // block_q, Sk_pad) added to the base-2
        scores of each query block (Q-smoothing), or None.
      sq_len, sk_len: real lengths (padding beyond them is ignored).
      causal: bottom-right aligned causal mask.
      k_per_block: K scales are constant per key tile (enables the fast path).
      out_dtype: dtype of the output.
      config: tiles; block_q/block_k must match the quantization padding.
    Returns:
      o (B, Sq, Hq, D) out_dtype, and the base-2 LSE float32 (B, Hq, Sq).
    """
    b, hq, sq_pad, d = q8.shape
    hkv, sk_pad = k8.shape[1], k8.shape[2]
    group = hq // hkv
    bq, bk = config.block_q, config.block_k
    nqb = sq_pad // bq
    if causal:
        qblk = lambda i: nqb - 1 - i  # noqa: E731  (matches the kernel's reversed order)
    else:
        qblk = lambda i: i  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, bq, d), lambda i, bi, hi: (bi, hi, qblk(i), 0)),
        pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qblk(i))),
        pl.BlockSpec((None, None, sk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0)),
        pl.BlockSpec((None, None, sk_pad), lambda i, bi, hi: (bi, hi // group, 0)),
        pl.BlockSpec((None, None, d, sk_pad), lambda i, bi, hi: (bi, hi // group, 0, 0)),
        pl.BlockSpec((None, None, d), lambda i, bi, hi: (bi, hi // group, 0)),
    ]
    args = [q8, q_scale, k8, k_scale, vt8, v_scale]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, None, None, sk_pad), lambda i, bi, hi: (bi, hi, qblk(i), 0)))
        args.append(bias)
    kernel = functools.partial(
        _sage_fwd_kernel,
        block_q=bq,
        block_k=bk,
        sq_len=sq_len,
        sk_len=sk_len,
        causal=causal,
        k_per_block=k_per_block,
        has_bias=bias is not None,
        n_qblocks=nqb,
        e4m3_pv=vt8.dtype == e4m3.DTYPE,
    )
    o, lse = pl.pallas_call(
        kernel,
        grid=(nqb, b, hq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, qblk(i), hi, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, qblk(i))),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, sq_len, hq, d), out_dtype),
            jax.ShapeDtypeStruct((b, hq, sq_len), jnp.float32),
        ],
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="sage_attention_fwd",
    )(*args)
    return o, lse
