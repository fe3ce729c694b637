"""SageAttention / SageBwd: trainable INT8 attention — public API and custom_vjp.

Papers: SageAttention (Zhang et al., 2024) for the forward, SageBwd for the INT8 backward. What is quantized where
(docs/spec.md, SageBwd):

Forward
* K-smoothing (on by default): K' = K − mean over tokens, per (batch, kv-head, channel); the softmax is
  unchanged. Optional Q-smoothing: Q' = Q − q̄ per query block, q̄·K̂ᵀ added back to the scores in fp32.
* Q̂, K̂: INT8 per block (one scale per tile, SageAttention's default) or per token; ``softmax_scale · log2(e)``
  is folded into Q's scale.
* S = int32(Q̂K̂ᵀ)·s_Q·s_K in fp32, online softmax in base 2.
* P̃ INT8 per row and key tile (scale = row max / 127, round half to even); V̂ INT8 per channel over all tokens,
  stored transposed.
* O = Σ int32(P̂V̂)·s_P·s_V / l, fp32 accumulation.

Backward (``backward="int8"``, the default): SageBwd, 6 of its 7 matmuls INT8 (dP = dO·Vᵀ 16-bit). Residuals are
the INT8 operands with their scales (Q̂, K̂ and the transposed copies Q̂ᵀ, K̂ᵀ, V̂ᵀ, one byte per element each), O
and the log-sum-exp; no 16-bit copy of q, k or v is kept. ``backward="bf16"`` is the ablation: exact attention
gradients in 16-bit operands from the same dequantized INT8 residuals.

Implementations (:mod:`lowbit_jax.sage_backends`): the forward and the backward each on Mosaic GPU (Hopper, where
it covers the call), Triton, or XLA — the pure-JAX reference (:mod:`lowbit_jax.sage_reference`), which runs the
same quantizers on whole arrays, so ``jax.grad`` of it is the SageBwd gradient, not plain autodiff.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from lowbit_jax import _checks, prologue_grad
from lowbit_jax._x32 import x32
from lowbit_jax.sage_backends import (
    SageCall, SageOptions, backward_for, dequantized_operands, forward_for, natural_vt, orders_for,
)
from lowbit_jax.sage_reference import smoothing_bias
from pallas_kernels.configs import SageFwdConfig, sage_fwd_config
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels.numerics.sage_tiles import SageOperands

GRANULARITIES = ("per_block", "per_token")
BACKWARDS = ("int8", "bf16")


# ----------------------------------------------------------------------------- public API


@x32
def sage_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    qk_granularity: Literal["per_block", "per_token"] = "per_block",
    backward: Literal["int8", "bf16"] = "int8",
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: SageFwdConfig | None = None,
    prologue: QKPrologue | None = None,
) -> jax.Array:
    """INT8 attention (SageAttention forward, SageBwd backward); differentiable.

    Layout as ``jax.nn.dot_product_attention``. GQA/MQA: Hq a multiple of Hkv. Q·Kᵀ is INT8; P·V is INT8 or, with
    ``config.pv_format="e4m3"`` (the default on Hopper, where it is faster), FP8 e4m3 (docs/spec.md).

    Args:
      q: (B, Sq, Hq, D) bfloat16, float16 or float32.
      k, v: (B, Sk, Hkv, D), q's dtype. D in {32, 64, 128, 256}; any Sq, Sk ≥ 1.
      causal: causal mask, bottom-right aligned when Sq ≠ Sk (query i sees keys
        j ≤ i + Sk − Sq, as FlashAttention-2; ``jax.nn.dot_product_attention``
        is top-left aligned, so the two agree only for Sq = Sk). Rows that see
        no key give zeros (and zero gradients).
      scale: softmax scale, default D**-0.5; a finite positive Python number.
      smooth_k: subtract the token mean of K before quantizing (recommended).
      smooth_q: subtract each query block's mean too (adds q̄·Kᵀ in fp32).
      qk_granularity: "per_block" (one INT8 scale per Q/K tile) or "per_token".
      backward: "int8" (SageBwd: 6 of 7 matmuls INT8) or "bf16" (ablation).
      implementation: "pallas" (the Triton kernels; on CPU only with
        ``interpret=True``), "xla" (the pure-JAX reference, same quantization),
        or None: pallas on GPU, xla elsewhere.
      interpret: run the Pallas kernels in interpret mode (CPU testing).
      config: tile configuration and P·V format; default from :func:`sage_fwd_config` (per device). Part of
        the numerics (per-tile scales, ``pv_format``), so compare implementations with one config.
      prologue: QK-norm and/or RoPE to apply to q and k first
        (:class:`pallas_kernels.numerics.qk_prologue.QKPrologue`): q and k are then the model's pre-norm
        projections, and the norm and rotation run inside the quantization kernels (the values of
        ``qk_prologue.apply``: a Flax ``RMSNorm`` then rotate-half RoPE, roundings to q's dtype included);
        its backward is one Triton pass per side. Gradients flow to q, k and the norm scales (the RoPE tables
        get zeros). The pre-norm q and k are kept for that backward (what an unfused model keeps for its
        norm's backward); the attention's own residuals stay INT8.
    Returns:
      (B, Sq, Hq, D) in q's dtype. Gradients w.r.t. q, k, v in their dtype.
    Raises:
      ValueError / TypeError on bad shapes, dtypes or options (before compiling).
    """
    opts = resolve_options(
        q, k, v, causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        qk_granularity=qk_granularity, backward=backward, implementation=implementation, interpret=interpret,
        config=config, prologue=prologue,
    )
    return _sage_attention(q, k, v, prologue, opts)


@x32
def sage_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    qk_granularity: Literal["per_block", "per_token"] = "per_block",
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: SageFwdConfig | None = None,
) -> tuple[jax.Array, jax.Array, SageOperands]:
    """:func:`sage_attention`'s forward plus its residuals (not differentiable).

    Returns:
      ``(o, lse, operands)``: o as :func:`sage_attention`; ``lse`` float32
      (B, Hq, Sq), the base-2 log-sum-exp of the *smoothed, scaled* scores
      (``scale·log2 e·q·k'``; +inf for rows that see no key); the quantized
      :class:`SageOperands`.
    """
    opts = resolve_options(
        q, k, v, causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        qk_granularity=qk_granularity, backward="int8", implementation=implementation, interpret=interpret,
        config=config,
    )
    o, lse, ops = _forward(q, k, v, None, opts=opts, transposed=False)
    # the public residuals in their documented (natural) layout
    return o, lse, natural_vt(ops, orders_for(SageCall.of_inputs(q, k, opts)).v)


def resolve_options(q, k, v, *, causal=False, scale=None, smooth_k=True, smooth_q=False, qk_granularity="per_block",
                    implementation=None, interpret=False, config=None, backward="int8",
                    prologue=None) -> SageOptions:
    """Validate everything eagerly and resolve defaults into static options."""
    shape = _checks.check_qkv(q, k, v)
    _checks.check_prologue(prologue, shape)
    causal = _checks.check_bool("causal", causal)
    smooth_k = _checks.check_bool("smooth_k", smooth_k)
    smooth_q = _checks.check_bool("smooth_q", smooth_q)
    interpret = _checks.check_bool("interpret", interpret)
    _checks.check_choice("qk_granularity", qk_granularity, GRANULARITIES)
    _checks.check_choice("backward", backward, BACKWARDS)
    scale = _checks.check_scale(scale, shape.head_dim)
    impl = _checks.check_implementation(implementation, interpret)
    if config is None:
        config = sage_fwd_config(shape.head_dim, causal)
    elif not isinstance(config, SageFwdConfig):
        raise TypeError(f"config must be a SageFwdConfig, got {type(config).__name__}")
    _checks.check_fp8_device("config.pv_format", config.pv_format, impl, interpret)
    return SageOptions(
        causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        per_block=qk_granularity == "per_block", implementation=impl, interpret=interpret,
        config=config.fitted(shape.seq_q, shape.seq_k), backward=backward, seq_q=shape.seq_q, seq_k=shape.seq_k,
    )


# ----------------------------------------------------------------------------- forward


@functools.partial(jax.jit, static_argnames=("opts", "transposed"))
def _forward(q, k, v, prologue: QKPrologue | None = None, *, opts: SageOptions, transposed: bool):
    """o, the base-2 LSE and the INT8 operands (in the orders the call's implementations take)."""
    call = SageCall.of_inputs(q, k, opts)
    forward, orders = forward_for(call), orders_for(call)
    ops = forward.quantize(q, k, v, prologue, opts, transposed=transposed, v_order=orders.v, q_t_order=orders.q_t)
    bias = smoothing_bias(ops, scale=opts.scale) if opts.smooth_q else None
    o, lse = forward.attend(ops, bias, opts, q.dtype, orders.v)
    return o, lse, ops


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sage_attention(q, k, v, prologue, opts: SageOptions):
    return _forward(q, k, v, prologue, opts=opts, transposed=False)[0]


def _sage_attention_fwd(q, k, v, prologue, opts: SageOptions):
    call = SageCall.of_inputs(q, k, opts)
    transposed = backward_for(call).transposed(call)
    o, lse, ops = _forward(q, k, v, prologue, opts=opts, transposed=transposed)
    return o, (ops, o, lse, prologue_grad.residuals(q, k, prologue))  # the prologue's backward needs its inputs


@x32
def _sage_attention_bwd(opts: SageOptions, residuals, do):
    ops, o, lse, pre = residuals
    dq, dk, dv = _backward(ops, o, lse, do, opts=opts)
    dq, dk, dpro = prologue_grad.cotangents(pre, dq, dk, pallas=opts.implementation == "pallas",
                                            interpret=opts.interpret)
    return dq, dk, dv, dpro


_sage_attention.defvjp(_sage_attention_fwd, _sage_attention_bwd)


@functools.partial(jax.jit, static_argnames=("opts",))
def _backward(ops: SageOperands, o, lse, do, *, opts: SageOptions):
    call = SageCall.of_operands(ops, opts)
    bias = smoothing_bias(ops, scale=opts.scale) if opts.smooth_q else None
    return backward_for(call).grads(ops, bias, o, lse, do, opts, orders_for(call))


__all__ = ["SageOptions", "dequantized_operands", "resolve_options", "sage_attention", "sage_forward"]
