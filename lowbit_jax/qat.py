"""Attn-QAT: NVFP4 fake-quantized attention for quantization-aware training — public API and custom_vjp.

docs/spec.md, Attn-QAT. Forward: Q̃, K̃, Ṽ = FQ(Q), FQ(K), FQ(V) (NVFP4 per token, groups
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

Hopper has no FP4 tensor cores: fake-quantized values are exact in bf16/fp16, so every product is a 16-bit MMA
on them with fp32 accumulation. Implementations (:mod:`lowbit_jax.qat_backends`): forward and backward each on
Mosaic GPU (Hopper), Triton, or XLA (the reference, :mod:`lowbit_jax.qat_reference`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from lowbit_jax import _checks, prologue_grad
from lowbit_jax._x32 import x32
from lowbit_jax.qat_backends import QatCall, QatOptions, backward_for, forward_for, kv_in_key_order
from pallas_kernels._mosaic import on_hopper
from pallas_kernels.configs import QatConfig, qat_config
from pallas_kernels.numerics import qk_prologue, smoothing
from pallas_kernels.numerics.qk_prologue import QKPrologue


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
        follows by autodiff (its token mean is projected out). Off by default (the spec).
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


def call_of(opts: QatOptions, head_dim: int, dtype) -> QatCall:
    """The call the implementations are picked for (``dtype``: q's)."""
    return QatCall(opts, head_dim, jax.numpy.dtype(dtype))


def kv_lane_order(opts: QatOptions, head_dim: int, dtype) -> bool:
    """Whether the forward's K̃, Ṽ (and so the backward's residuals) are in lane order (the Mosaic forward's).
    ``dtype``: q's."""
    call = call_of(opts, head_dim, dtype)
    return forward_for(call).lane_order(call)


@functools.partial(jax.jit, static_argnames=("opts", "with_aux"))
def qat_forward(q: jax.Array, k: jax.Array, v: jax.Array, prologue: QKPrologue | None = None, *, opts: QatOptions,
                with_aux: bool):
    """Forward with residuals: (o, o_aux or None, lse, m, (q̃, k̃, ṽ)).

    Shapes as :func:`pallas_kernels.qat_fwd.qat_attention_fwd`; q̃, k̃, ṽ (B, H, S_pad, D) head-major and padded,
    k̃ and ṽ in lane order where :func:`kv_lane_order` says so. ``prologue``: as :func:`qat_attention`'s.
    """
    call = call_of(opts, q.shape[-1], q.dtype)
    forward = forward_for(call)
    lane_order = forward.lane_order(call)
    qf, kf, vf = forward.quantize(q, k, v, opts, lane_order=lane_order, prologue=prologue)
    o, o_aux, lse, m = forward.attend(qf, kf, vf, opts, q.dtype, with_aux=with_aux, lane_order=lane_order)
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
    call = call_of(opts, qf.shape[3], do.dtype)
    return backward_for(call).grads(qf, kf, vf, o_aux, lse, m, do, opts,
                                    lane_order=forward_for(call).lane_order(call))


_qat_attention.defvjp(_qat_fwd, _qat_bwd)
