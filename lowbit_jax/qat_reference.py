"""Pure-JAX references of Attn-QAT with the kernels' exact fake quantization.

docs/spec.md, Attn-QAT. The fake quantizer of Q, K, V is :func:`pallas_kernels.numerics.nvfp4.fake_quant_last`; that of
P
is :func:`pallas_kernels.numerics.nvfp4.fake_quant_probabilities` — for bf16 operands P rounded to bf16 and quantized in
bf16 arithmetic (emulated here, native in the kernels, equal bit for bit), which halves its cost on the GPU.
Three references:

* :func:`fake_quant_operands` / :func:`qat_forward_reference` /
  :func:`qat_backward_reference` — twins of the kernels (same tiles for the
  forward's P̃, same operand dtypes), used by ``implementation="xla"``;
* :func:`qat_attention_ste` — the Attn-QAT gradient written as a plain JAX graph
  (fake quantizers with straight-through estimators, P̃ = P + sg(FQ(P) − P)),
  whose autodiff the backward must reproduce.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import int8, nvfp4, sage_tiles
from pallas_kernels.numerics.qat_rows import backward_rows, head_major
from lowbit_jax.reference import causal_mask
from pallas_kernels.configs import QatConfig
from pallas_kernels.numerics.online_softmax import online_softmax_step
from pallas_kernels.numerics.tile_ranges import visible

LOG2E = math.log2(math.e)


def mma_dtype(dtype) -> jnp.dtype:
    """16-bit operand dtype of the tensor-core products: float16 for float16 inputs, else bfloat16.

    Fake-quantized values (e2m1 · e4m3) are exact in both.
    """
    return jnp.dtype(jnp.float16) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(jnp.bfloat16)


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fake_quant_operands(q, k, v, *, config: QatConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q̃, K̃, Ṽ: NVFP4 fake quantization per token (groups of 16 along D), head-major and padded.

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D).
    Returns:
      (B, Hq, Sq_pad, D), (B, Hkv, Sk_pad, D) ×2 in :func:`mma_dtype`; padding
      rows are zeros; pads are multiples of ``config.pad``.
    """
    dt = mma_dtype(q.dtype)
    def fq(x):
        return head_major(nvfp4.fake_quant_last(x.astype(jnp.float32)), padded(x.shape[1], config.pad), dt)
    return fq(q), fq(k), fq(v)


def _repeat_kv(x: jax.Array, group: int) -> jax.Array:
    return jnp.repeat(x, group, axis=1) if group > 1 else x


def qat_forward_reference(qf, kf, vf, *, sq_len: int, sk_len: int, causal: bool, scale: float, config: QatConfig,
                          out_dtype, with_aux: bool = True):
    """Twin of :func:`pallas_kernels.qat_fwd.qat_attention_fwd`: online softmax over key tiles.

    P̃ = FQ(exp2(S − m_running)) per key tile of ``config.block_k`` (groups of 16
    keys per row); O = Σ P̃Ṽ / l and O' = Σ PṼ / l with l from the unquantized P.

    Args:
      qf: (B, Hq, Sq_pad, D); kf, vf: (B, Hkv, Sk_pad, D) fake-quantized operands.
    Returns:
      o (B, Sq, Hq, D), o_aux (same, or None without ``with_aux``), base-2 lse float32 (B, Hq, Sq)
      (+inf where a row sees no key), base-2 row max m float32 (B, Hq, Sq; −inf there).
    """
    b, hq, sq_pad, d = qf.shape
    group = hq // kf.shape[1]
    kf, vf = _repeat_kv(kf, group), _repeat_kv(vf, group)
    bk = config.block_k
    nkb = -(-sk_len // bk)  # Sk_pad is a multiple of config.pad ≥ block_k, so nkb tiles fit
    c = scale * LOG2E
    rows = jnp.arange(sq_pad)[:, None]
    dt = qf.dtype

    def step(carry, j):
        acc, acc2, m_prev, l_prev = carry
        kj = jax.lax.dynamic_slice_in_dim(kf, j * bk, bk, axis=2)
        vj = jax.lax.dynamic_slice_in_dim(vf, j * bk, bk, axis=2)
        s = jnp.einsum("bhqd,bhkd->bhqk", qf, kj, preferred_element_type=jnp.float32) * c
        cols = j * bk + jnp.arange(bk)[None, :]
        s = jnp.where(visible(rows, cols, sq_len, sk_len, causal), s, -jnp.inf)
        (p,), alpha, m_new, l_new = online_softmax_step([s], m_prev, l_prev)
        pq = nvfp4.fake_quant_probabilities(p, dt)
        acc = acc * alpha[..., None] + jnp.einsum("bhqk,bhkd->bhqd", pq.astype(dt), vj,
                                                  preferred_element_type=jnp.float32)
        if with_aux:
            acc2 = acc2 * alpha[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p.astype(dt), vj,
                                                        preferred_element_type=jnp.float32)
        return (acc, acc2, m_new, l_new), None

    zeros = jnp.zeros((b, hq, sq_pad, d), jnp.float32)
    init = (zeros, zeros, jnp.full((b, hq, sq_pad), -jnp.inf, jnp.float32), jnp.zeros((b, hq, sq_pad), jnp.float32))
    (acc, acc2, m, l), _ = jax.lax.scan(step, init, jnp.arange(nkb))
    inv_l = int8.reciprocal_or_zero(l)[..., None]
    lse = sage_tiles.base2_lse(m, l)
    out = lambda a: jnp.swapaxes(a * inv_l, 1, 2)[:, :sq_len].astype(out_dtype)  # noqa: E731
    return out(acc), (out(acc2) if with_aux else None), lse[:, :, :sq_len], m[:, :, :sq_len]


def qat_backward_reference(qf, kf, vf, o_aux, lse, m, do, *, sq_len: int, sk_len: int, causal: bool, scale: float,
                           config: QatConfig, naive: bool = False, intermediates: bool = False):
    """Twin of :func:`pallas_kernels.qat_bwd.qat_attention_bwd`.

    Recompute S from Q̃, K̃; E = exp2(S − m) (row max 1), P = E/l; dV = (FQ(E)/l)ᵀdO
    — FQ(P) taken relative to the row max as in the forward (the normalized P of a
    long row lies below e4m3's smallest group scale) — or PᵀdO if ``naive``;
    dP = dO·Ṽᵀ; D = rowsum(dO ∘ o_aux) with o_aux = O' (O if naive);
    dS = P ∘ (dP − D); dQ = dS·K̃·scale; dK = dSᵀ·Q̃·scale. Scans over query tiles.

    Args:
      intermediates: also return {"D", "P", "dP", "dS"} (head-major, (B, Hq, Sq[, Sk])).
    Returns:
      dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D) in do's dtype [, intermediates].
    """
    b, hq, sq_pad, d = qf.shape
    hkv, sk_pad = kf.shape[1], kf.shape[2]
    group = hq // hkv
    bq = config.bwd_block_q
    nqb = sq_pad // bq
    dt = qf.dtype
    k_all, v_all = _repeat_kv(kf, group), _repeat_kv(vf, group)
    delta, m_p, inv_l, do_h = backward_rows(o_aux, lse, m, do, seq_pad=sq_pad, dtype=dt)
    tiles = lambda x: jnp.moveaxis(x.reshape(x.shape[:2] + (nqb, bq) + x.shape[3:]), 2, 0)  # noqa: E731
    c = scale * LOG2E
    cols = jnp.arange(sk_pad)[None, :]

    def step(carry, xs):
        dk, dv = carry
        i, q_i, do_i, m_i, inv_l_i, delta_i = xs
        rows = i * bq + jnp.arange(bq)[:, None]
        s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_all, preferred_element_type=jnp.float32) * c
        s = jnp.where(visible(rows, cols, sq_len, sk_len, causal), s, -jnp.inf)
        e = jnp.exp2(s - m_i[..., None])
        p = e * inv_l_i[..., None]
        pv = p if naive else nvfp4.fake_quant_probabilities(e, dt, times=inv_l_i[..., None])
        dv = dv + jnp.einsum("bhqk,bhqd->bhkd", pv.astype(dt), do_i, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, v_all, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_i[..., None])).astype(dt)
        dk = dk + jnp.einsum("bhqk,bhqd->bhkd", ds, q_i, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bhqk,bhkd->bhqd", ds, k_all, preferred_element_type=jnp.float32) * scale
        extra = (p, dp, ds.astype(jnp.float32)) if intermediates else ()
        return (dk, dv), (dq_i,) + extra

    zeros = jnp.zeros((b, hq, sk_pad, d), jnp.float32)
    xs = (jnp.arange(nqb), tiles(qf), tiles(do_h), tiles(m_p), tiles(inv_l), tiles(delta))
    (dk, dv), outs = jax.lax.scan(step, (zeros, zeros), xs)
    dq = jnp.moveaxis(outs[0], 0, 2).reshape(b, hq, sq_pad, d)
    dq = jnp.swapaxes(dq, 1, 2)[:, :sq_len].astype(do.dtype)

    def kv_grad(x, factor=1.0):
        x = x.reshape(b, hkv, group, sk_pad, d).sum(axis=2) * factor
        return jnp.swapaxes(x, 1, 2)[:, :sk_len].astype(do.dtype)

    grads = (dq, kv_grad(dk, scale), kv_grad(dv))
    if not intermediates:
        return grads
    full = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, hq, sq_pad, sk_pad)[:, :, :sq_len, :sk_len]  # noqa: E731
    return grads, {"D": delta[:, :, :sq_len], "P": full(outs[1]), "dP": full(outs[2]), "dS": full(outs[3])}


def qat_attention_ste(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                      scale: float | None = None, operand_dtype=jnp.bfloat16) -> jax.Array:
    """Attn-QAT as a differentiable JAX graph (float32): its autodiff is the Attn-QAT gradient.

    Q̃, K̃, Ṽ = fake_quant (straight-through); P = softmax(Q̃K̃ᵀ·scale) exact;
    P̃ = FQ(P / rowmax P)·rowmax P (quantized relative to the row max, as the
    kernels do, with their quantizer for ``operand_dtype``: :func:`nvfp4.fake_quant_probabilities`, bfloat16 for
    bf16 and float32 inputs); O = (P + sg(P̃ − P))·Ṽ. Autodiff gives dV = P̃ᵀdO, dP = dO·Ṽᵀ and the
    softmax backward with rowsum(P ∘ dP) = rowsum(dO ∘ PṼ) = rowsum(dO ∘ O').
    (Its forward value quantizes the *normalized* P, the kernels the per-tile P:
    compare gradients, not outputs, with it.)

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D).
    Returns:
      (B, Sq, Hq, D) float32.
    """
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (nvfp4.fake_quant(x.astype(jnp.float32), axis=-1) for x in (q, k, v))
    kt, vt = jnp.repeat(kt, group, axis=2), jnp.repeat(vt, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qt, kt, precision=jax.lax.Precision.HIGHEST) * scale
    if causal:
        s = jnp.where(causal_mask(q.shape[1], k.shape[1]), s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l == 0.0, 1.0, l)
    sk = k.shape[1]
    pad = padded(sk, nvfp4.GROUP) - sk
    p_pad = jnp.pad(p, ((0, 0), (0, 0), (0, 0), (0, pad)))
    pmax = jnp.max(p_pad, axis=-1, keepdims=True)
    rel = p_pad * jnp.where(pmax > 0, 1.0 / jnp.where(pmax > 0, pmax, 1.0), 0.0)
    pq = jax.lax.stop_gradient(nvfp4.fake_quant_probabilities(rel, operand_dtype, times=pmax)[..., :sk] - p)
    return jnp.einsum("bhqk,bkhd->bqhd", p + pq, vt, precision=jax.lax.Precision.HIGHEST)
