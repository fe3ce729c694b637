"""Attn-QAT: NVFP4 fake-quantized attention for quantization-aware training — public API and custom_vjp.

shared/SPEC.md §2. Forward: Q̃, K̃, Ṽ = FQ(Q), FQ(K), FQ(V) (NVFP4 per token, groups
of 16 along D); per key tile S = Q̃K̃ᵀ·scale, P = exp2(S − m), P̃ = FQ(P) (groups of
16 keys per row); O = ΣP̃Ṽ/l (returned) and the high-precision O' = ΣPṼ/l (kept for
the backward); l from the unquantized P. Backward: P recomputed from Q̃, K̃, the
row max m and L; dV = FQ(P)ᵀdO with FQ relative to the row max (as in the
forward: the normalized P of a long row would fall below e4m3's smallest scale);
dP = dO·Ṽᵀ; D = rowsum(dO ∘ O'); dS = P ∘ (dP − D); dQ = dS·K̃·scale,
dK = dSᵀ·Q̃·scale; straight-through to Q, K, V.

``naive_backward=True`` is the failure mode Attn-QAT fixes, kept as an ablation:
the 16-bit FlashAttention backward applied to the FP4 forward (dV = PᵀdO,
D = rowsum(dO ∘ O) with the FP4 output O).

The H200 has no FP4 tensor cores: fake-quantized values are exact in bf16/fp16,
so every product is a 16-bit MMA on them with fp32 accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax

from lowbit_jax._x32 import x32
from lowbit_jax import _checks, prologue_grad
from lowbit_jax.formats import qk_prologue, smoothing
from lowbit_jax.formats.qk_prologue import QKPrologue
from lowbit_jax.qat_reference import (
    fake_quant_operands,
    mma_dtype,
    padded,
    qat_backward_reference,
    qat_forward_reference,
)
from pallas_kernels import fake_quant as fake_quant_kernels
from pallas_kernels import qat_bwd as qat_bwd_kernels
from pallas_kernels import qat_fwd as qat_fwd_kernels
from pallas_kernels import lane_groups, qat_bwd_mosaic, qat_fwd_mosaic
from pallas_kernels._mosaic import on_hopper
from pallas_kernels.configs import QatConfig, qat_config


@dataclasses.dataclass(frozen=True)
class QatOptions:
    """Resolved, hashable options (static under jit and custom_vjp)."""

    causal: bool
    scale: float
    naive_backward: bool
    smooth_k: bool
    implementation: str
    interpret: bool
    config: QatConfig
    seq_q: int
    seq_k: int


@x32
def qat_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    naive_backward: bool = False,
    smooth_k: bool = False,
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: QatConfig | None = None,
    prologue: QKPrologue | None = None,
) -> jax.Array:
    """NVFP4 fake-quantized attention (Attn-QAT); differentiable and jit-able.

    Layout as ``jax.nn.dot_product_attention``; GQA/MQA: Hq a multiple of Hkv.

    Args:
      q: (B, Sq, Hq, D) bfloat16, float16 or float32.
      k, v: (B, Sk, Hkv, D), q's dtype. D in {32, 64, 128, 256}; any Sq, Sk ≥ 1.
      causal: causal mask, bottom-right aligned when Sq ≠ Sk (as
        :func:`lowbit_jax.sage_attention`). Rows that see no key give zeros.
      scale: softmax scale, default D**-0.5.
      naive_backward: use the mismatched 16-bit backward (ablation only).
      smooth_k: subtract K's token mean (per batch, kv head, channel) before
        fake-quantizing it; the softmax is unchanged and the gradient w.r.t. k
        follows by autodiff (its token mean is projected out). Off by default (SPEC).
      implementation: "pallas" (Triton kernels; on CPU only with
        ``interpret=True``), "xla" (pure-JAX twin with identical
        semantics), or None: pallas on GPU, xla elsewhere.
      interpret: run the Pallas kernels in interpret mode.
      config: :class:`QatConfig`; its forward ``block_k`` is part of the numerics.
      prologue: QK-norm and/or RoPE to apply to q and k first (:class:`lowbit_jax.QKPrologue`, as in
        :func:`lowbit_jax.sage_attention`): q and k are then the model's pre-norm projections, and the Pallas
        implementation normalizes and rotates each tile inside the fake-quantization kernel (the values of
        FQ(``qk_prologue.apply(q, …)``)); its backward is one Triton pass per side after the straight-through
        estimator. Gradients flow to q, k and the norm scales (the RoPE tables get zeros). The pre-norm q and k
        are kept for that backward. With ``smooth_k`` the prologue runs unfused (XLA, before the smoothing).
    Returns:
      O, (B, Sq, Hq, D) in q's dtype (the FP4 output path). The products run in
      bfloat16 (float16 for float16 inputs) with fp32 accumulation.
    Raises:
      ValueError / TypeError on bad shapes, dtypes or options (before compiling).
    """
    opts = resolve_qat_options(q, k, v, causal=causal, scale=scale, naive_backward=naive_backward,
                               smooth_k=smooth_k, implementation=implementation, interpret=interpret,
                               config=config, prologue=prologue)
    if opts.smooth_k:
        # K's token mean is of the normalized, rotated k: the prologue unfused, by autodiff
        q, k = qk_prologue.apply_qk(q, k, prologue)
        prologue = None
        k = smoothing.subtract_token_mean(k)
    return _qat_attention(q, k, v, prologue, opts)


def resolve_qat_options(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                        scale: float | None = None, naive_backward: bool = False, smooth_k: bool = False,
                        implementation: str | None = None, interpret: bool = False,
                        config: QatConfig | None = None, prologue: QKPrologue | None = None) -> QatOptions:
    """Validate eagerly (shapes, dtypes, option types, the prologue's fields) and resolve defaults into static
    options."""
    shape = _checks.check_qkv(q, k, v)
    _checks.check_prologue(prologue, shape)
    causal = _checks.check_bool("causal", causal)
    naive_backward = _checks.check_bool("naive_backward", naive_backward)
    smooth_k = _checks.check_bool("smooth_k", smooth_k)
    interpret = _checks.check_bool("interpret", interpret)
    scale = _checks.check_scale(scale, shape.head_dim)
    impl = _checks.check_implementation(implementation, interpret)
    if config is None:
        config = qat_config(shape.head_dim, causal)
    elif not isinstance(config, QatConfig):
        raise TypeError(f"config must be a QatConfig, got {type(config).__name__}")
    return QatOptions(causal=causal, scale=scale, naive_backward=naive_backward, smooth_k=smooth_k,
                      implementation=impl, interpret=interpret,
                      config=config.fitted(shape.seq_q, shape.seq_k).with_backends(
                          impl == "pallas" and not interpret and on_hopper()),
                      seq_q=shape.seq_q, seq_k=shape.seq_k)


def quantize_operands(q: jax.Array, k: jax.Array, v: jax.Array, opts: QatOptions, *,
                      lane_order: bool = False,
                      prologue: QKPrologue | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q̃, K̃, Ṽ: (B, H, S_pad, D) bf16/fp16, head-major and padded, by the implementation ``opts`` names;
    ``lane_order`` (Pallas only): K̃ and Ṽ in the Mosaic kernels' lane order (:mod:`pallas_kernels.lane_groups`);
    ``prologue``: q and k are pre-norm, normalized and rotated first (in the fake-quantization kernel)."""
    cfg = opts.config
    if opts.implementation != "pallas":
        return fake_quant_operands(*qk_prologue.apply_qk(q, k, prologue), v, config=cfg)

    fqk = fake_quant_kernels

    def kw(x, lanes, pro=None):
        return dict(seq_pad=padded(x.shape[1], cfg.pad),
                    block=max(cfg.quant_block, lane_groups.BLOCK) if lanes else cfg.quant_block,
                    out_dtype=mma_dtype(x.dtype), lane_order=lanes,
                    num_warps=fqk.warps_for(cfg.quant_warps, x.shape[-1], pro), interpret=opts.interpret)

    qf = fqk.fp4_fake_quant_heads(q, prologue, "q", **kw(q, False, prologue))
    if fqk.PAIR_KV:  # one launch for both (k and v share shape and dtype: checked)
        return qf, *fqk.fp4_fake_quant_kv(k, v, prologue, **kw(k, lane_order, prologue))
    return (qf, fqk.fp4_fake_quant_heads(k, prologue, "k", **kw(k, lane_order, prologue)),
            fqk.fp4_fake_quant_heads(v, **kw(v, lane_order)))


def _runs_mosaic_forward(opts: QatOptions, head_dim: int, dtype) -> bool:
    return opts.implementation == "pallas" and opts.config.fwd_backend == "mosaic" and qat_fwd_mosaic.supports(
        sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=padded(opts.seq_q, opts.config.pad), head_dim=head_dim,
        causal=opts.causal, out_dtype=dtype, config=opts.config)


def kv_lane_order(opts: QatOptions, head_dim: int, dtype) -> bool:
    """Whether the forward's K̃, Ṽ (and so the backward's residuals) are in lane order: when the Mosaic
    forward runs with ``lane_groups.ENABLED``. ``dtype``: q's."""
    return lane_groups.ENABLED and _runs_mosaic_forward(opts, head_dim, dtype)


def kv_in_key_order(kf: jax.Array, vf: jax.Array, opts: QatOptions, dtype) -> tuple[jax.Array, jax.Array]:
    """The forward's K̃, Ṽ residuals (B, Hkv, Sk_pad, D) in key order, as the reference and the Triton kernels
    take them (undoing the lane order where :func:`kv_lane_order` says the forward left it). ``dtype``: q's."""
    if kv_lane_order(opts, kf.shape[3], dtype):
        return lane_groups.from_lane_order(kf, 2), lane_groups.from_lane_order(vf, 2)
    return kf, vf


@functools.partial(jax.jit, static_argnames=("opts", "with_aux"))
def qat_forward(q: jax.Array, k: jax.Array, v: jax.Array, prologue: QKPrologue | None = None, *, opts: QatOptions,
                with_aux: bool):
    """Forward with residuals: (o, o_aux or None, lse, m, (q̃, k̃, ṽ)).

    Shapes as :func:`pallas_kernels.qat_fwd.qat_attention_fwd` and :func:`quantize_operands`; k̃ and ṽ
    are in lane order where :func:`kv_lane_order` says so. ``prologue``: as :func:`qat_attention`'s.
    """
    mosaic = _runs_mosaic_forward(opts, q.shape[-1], q.dtype)
    lane_order = mosaic and lane_groups.ENABLED  # = kv_lane_order(opts, …)
    qf, kf, vf = quantize_operands(q, k, v, opts, lane_order=lane_order, prologue=prologue)
    kw = dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, scale=opts.scale, config=opts.config,
              out_dtype=q.dtype, with_aux=with_aux)
    if opts.implementation == "pallas":
        forward = qat_fwd_kernels.qat_attention_fwd
        if mosaic:
            forward = functools.partial(qat_fwd_mosaic.qat_attention_fwd_mosaic, lane_ordered=lane_order)
        o, o_aux, lse, m = forward(qf, kf, vf, interpret=opts.interpret, **kw)
    else:
        o, o_aux, lse, m = qat_forward_reference(qf, kf, vf, **kw)
    return o, o_aux, lse, m, (qf, kf, vf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _qat_attention(q, k, v, prologue, opts: QatOptions):
    return qat_forward(q, k, v, prologue, opts=opts, with_aux=False)[0]


def _qat_fwd(q, k, v, prologue, opts: QatOptions):
    o, o_aux, lse, m, operands = qat_forward(q, k, v, prologue, opts=opts, with_aux=not opts.naive_backward)
    # the prologue's backward needs its inputs
    return o, (operands, o if opts.naive_backward else o_aux, lse, m, prologue_grad.residuals(q, k, prologue))


@x32
def _qat_bwd(opts: QatOptions, residuals, do):
    *residuals, pre = residuals
    dq, dk, dv = _qat_operand_grads(opts, residuals, do)
    dq, dk, dpro = prologue_grad.cotangents(pre, dq, dk, pallas=opts.implementation == "pallas",
                                            interpret=opts.interpret)
    return dq, dk, dv, dpro


def _qat_operand_grads(opts: QatOptions, residuals, do):
    """The gradients w.r.t. Q̃, K̃, Ṽ (= w.r.t. the fake-quantizers' inputs by the STE)."""
    (qf, kf, vf), o_aux, lse, m = residuals
    kw = dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, scale=opts.scale, config=opts.config,
              naive=opts.naive_backward)
    if opts.implementation == "pallas":
        if opts.config.bwd_backend == "mosaic" and qat_bwd_mosaic.supports(
                sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=qf.shape[2], sk_pad=kf.shape[2], head_dim=qf.shape[3],
                causal=opts.causal, dtype=qf.dtype, do_dtype=do.dtype):
            return qat_bwd_mosaic.qat_attention_bwd_mosaic(
                qf, kf, vf, o_aux, lse, m, do, sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal,
                scale=opts.scale, naive=opts.naive_backward,
                fused_dq=opts.config.fuses_dq(qf.shape[3], opts.causal),
                lane_ordered=kv_lane_order(opts, qf.shape[3], do.dtype), interpret=opts.interpret)
        kf, vf = kv_in_key_order(kf, vf, opts, do.dtype)  # the Triton kernels take keys in order
        return qat_bwd_kernels.qat_attention_bwd(qf, kf, vf, o_aux, lse, m, do, interpret=opts.interpret, **kw)
    return qat_backward_reference(qf, kf, vf, o_aux, lse, m, do, **kw)


_qat_attention.defvjp(_qat_fwd, _qat_bwd)
