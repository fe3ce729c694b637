"""SageAttention / SageBwd: trainable INT8 attention — public API, dispatch, custom_vjp.

Papers: SageAttention (Zhang et al., 2024) for the forward, SageBwd for the INT8
backward. What is quantized where (shared/SPEC.md §1):

Forward
* K-smoothing (on by default): K' = K − mean over tokens, per (batch, kv-head,
  channel); the softmax is unchanged. Optional Q-smoothing: Q' = Q − q̄ per query
  block, q̄·K̂ᵀ added back to the scores in fp32.
* Q̂, K̂: INT8 per block (one scale per tile, SageAttention's default) or per
  token; ``softmax_scale · log2(e)`` is folded into Q's scale.
* S = int32(Q̂K̂ᵀ)·s_Q·s_K in fp32, online softmax in base 2.
* P̃ INT8 per row and key tile (scale = row max / 127, round half to even);
  V̂ INT8 per channel over all tokens, stored transposed.
* O = Σ int32(P̂V̂)·s_P·s_V / l, fp32 accumulation.

Backward (``backward="int8"``, the default): SageBwd — see
:mod:`pallas_kernels.sage_bwd`. Residuals are the INT8 operands with their
scales (Q̂, K̂ and the transposed copies Q̂ᵀ, K̂ᵀ, V̂ᵀ, one byte per element each:
5 bytes per token·channel for MHA where 16-bit attention keeps 6 in q, k, v), O
and the log-sum-exp; no 16-bit copy of q, k or v is kept. With the Triton kernels (and the separate dQ
kernel, ``SageFwdConfig.dq_kernel="separate"``) the backward allocates no fp32 workspace and its gradients are
deterministic; the fused dQ, the default on Hopper, reduce-adds each step's dŜ·K̂ into a float32 dQ (B, Sq, Hq, D)
with TMA, so dQ's summation order, and its last bits, vary run to run (dK, dV do not).

Backends: the kernels are Pallas-Triton; on Hopper the SageBwd dK/dV and dQ kernels run
on Pallas Mosaic GPU where that was measured faster (``SageFwdConfig.dkdv_backend`` /
``dq_backend``, :mod:`pallas_kernels.sage_bwd_mosaic`), and so does the forward at head dims
64 and 128 (``fwd_backend``, :mod:`pallas_kernels.sage_fwd_mosaic`). Same quantization; the Mosaic forward
applies per-block scales as one product per score, so its last bits differ from Triton's.
``backward="bf16"`` is the ablation: exact attention gradients in 16-bit operands
(fp32 math) from the same dequantized INT8 residuals.

The "xla" implementation runs the same quantizers (:mod:`lowbit_jax.formats`)
on whole arrays (:mod:`lowbit_jax.sage_reference`), so ``jax.grad`` of it is the
SageBwd gradient, not plain autodiff.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from lowbit_jax._x32 import x32
from lowbit_jax import _checks, prologue_grad
from lowbit_jax.formats import int8
from lowbit_jax.formats import qk_prologue, sage_tiles
from lowbit_jax.formats.qk_prologue import QKPrologue
from lowbit_jax.formats.sage_tiles import SageOperands
from lowbit_jax.reference import reference_attention
from lowbit_jax.sage_reference import (
    quantize_reference,
    sage_attention_reference,
    sage_backward_reference,
    smoothing_bias,
)
from pallas_kernels import operand_order
from pallas_kernels import quantize as quantize_kernels
from pallas_kernels import sage_bwd as sage_bwd_kernels
from pallas_kernels import sage_bwd_mosaic
from pallas_kernels._mosaic import on_hopper
from pallas_kernels import sage_fwd as sage_fwd_kernels
from pallas_kernels import sage_fwd_mosaic
from pallas_kernels.configs import SageFwdConfig, sage_fwd_config

LOG2E = math.log2(math.e)
GRANULARITIES = ("per_block", "per_token")
BACKWARDS = ("int8", "bf16")


@dataclasses.dataclass(frozen=True)
class SageOptions:
    """Resolved, hashable options (static under jit and custom_vjp)."""

    causal: bool
    scale: float
    smooth_k: bool
    smooth_q: bool
    per_block: bool
    implementation: str
    interpret: bool
    config: SageFwdConfig
    backward: str
    seq_q: int
    seq_k: int


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

    Layout as ``jax.nn.dot_product_attention``. GQA/MQA: Hq a multiple of Hkv.

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
      config: tile configuration; default from :func:`sage_fwd_config`. Part of
        the numerics (per-tile scales), so compare implementations with one config.
      prologue: QK-norm and/or RoPE to apply to q and k first
        (:class:`lowbit_jax.formats.qk_prologue.QKPrologue`): q and k are then the model's pre-norm
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
    if operand_orders(Padded.of_inputs(q, k, opts.config), opts).v:
        ops = ops._replace(vt=operand_order.from_operand_order(ops.vt, 3))
    return o, lse, ops


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
    return SageOptions(
        causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        per_block=qk_granularity == "per_block", implementation=impl, interpret=interpret,
        config=config.fitted(shape.seq_q, shape.seq_k), backward=backward, seq_q=shape.seq_q, seq_k=shape.seq_k,
    )


# ----------------------------------------------------------------------------- forward


class OperandOrders(NamedTuple):
    """Which INT8 residuals hold their tokens in :mod:`pallas_kernels.operand_order` (B operands of products whose
    A operand comes straight from an accumulator's registers): ``v``, V̂ᵀ's keys (the Mosaic forward's PV); ``q_t``,
    Q̂ᵀ's queries, and dÔᵀ's with them (the Mosaic dK/dV kernel's dK and dV). The rest is in natural order."""

    v: bool = False
    q_t: bool = False


class Padded(NamedTuple):
    """What picking a call's kernels reads of its INT8 operands: the padded query and key lengths the quantize
    kernels give them (``config.block_q``/``block_k`` multiples) and the head dim."""

    sq: int
    sk: int
    head_dim: int

    @classmethod
    def of_operands(cls, ops: SageOperands) -> "Padded":
        """Of quantized operands: Q̂ (B, Hq, Sq_pad, D), K̂ (B, Hkv, Sk_pad, D)."""
        return cls(ops.q.shape[2], ops.k.shape[2], ops.q.shape[3])

    @classmethod
    def of_inputs(cls, q: jax.Array, k: jax.Array, config: SageFwdConfig) -> "Padded":
        """Before quantizing: q (B, Sq, Hq, D), k (B, Sk, Hkv, D) (arrays or shape structs), padded as
        :func:`quantize_pallas` pads them."""
        pad = lambda n, block: -(-n // block) * block  # noqa: E731
        return cls(pad(q.shape[1], config.block_q), pad(k.shape[1], config.block_k), q.shape[3])


def operand_orders(padded: Padded, opts: SageOptions) -> OperandOrders:
    """The :class:`OperandOrders` of a call whose INT8 operands are ``padded`` (:meth:`Padded.of_inputs` before
    quantizing, :meth:`Padded.of_operands` after): where the Pallas kernels that take each run (the Mosaic GPU
    forward, the Mosaic dK/dV kernel of the INT8 backward) and take operand order."""
    if opts.implementation != "pallas":
        return OperandOrders()
    return OperandOrders(
        v=_mosaic_forward(padded, opts) and sage_fwd_mosaic.takes_operand_order(opts.interpret),
        q_t=(opts.backward == "int8" and _mosaic_backend("dkdv", padded, opts)
             and sage_bwd_mosaic.takes_operand_order(padded.head_dim, opts.interpret)))


def quantize_pallas(q, k, v, *, scale, smooth_k, smooth_q, per_block, config, transposed=False,
                    orders: OperandOrders = OperandOrders(), prologue: QKPrologue | None = None,
                    interpret=False) -> SageOperands:
    """Quantize with the fused Pallas kernels (see :mod:`pallas_kernels.quantize`); V̂ᵀ and Q̂ᵀ in ``orders``;
    q and k through ``prologue`` first, inside the kernels."""
    k_mean, v_scale = quantize_kernels.sage_channel_stats(k, v, prologue, smooth_k=smooth_k, interpret=interpret)
    q_warps = config.quant_warps if prologue is None else max(config.quant_warps, quantize_kernels.PROLOGUE_WARPS)
    q8, qs, q_mean, q8_t = quantize_kernels.sage_quantize_q(
        q, prologue, block=config.block_q, per_block=per_block, smooth_block=smooth_q, out_scale=scale * LOG2E,
        transposed=transposed, t_operand_order=orders.q_t, num_warps=q_warps, interpret=interpret,
    )
    k8, ks, vt8, k8_t = quantize_kernels.sage_quantize_kv(
        k, v, k_mean, v_scale, prologue, block=config.block_k, per_block=per_block, transposed=transposed,
        v_operand_order=orders.v, num_warps=config.kv_quant_warps, interpret=interpret,
    )
    return SageOperands(q8, qs, k8, ks, vt8, v_scale, q_mean, q8_t, k8_t)


@functools.partial(jax.jit, static_argnames=("opts", "transposed"))
def _forward(q, k, v, prologue: QKPrologue | None = None, *, opts: SageOptions, transposed: bool):
    kw = dict(scale=opts.scale, smooth_k=opts.smooth_k, smooth_q=opts.smooth_q, per_block=opts.per_block,
              config=opts.config, transposed=transposed, interpret=opts.interpret)
    orders = operand_orders(Padded.of_inputs(q, k, opts.config), opts)
    if opts.implementation == "pallas":
        ops = quantize_pallas(q, k, v, orders=orders, prologue=prologue, **kw)
    else:
        q, k = qk_prologue.apply_qk(q, k, prologue)
        ops = quantize_reference(q, k, v, **kw)
    bias = smoothing_bias(ops, scale=opts.scale) if opts.smooth_q else None
    o, lse = attend_quantized(ops, bias, opts=opts, out_dtype=q.dtype, v_operand_order=orders.v)
    return o, lse, ops


def attend_quantized(ops: SageOperands, bias: jax.Array | None, *, opts: SageOptions,
                     out_dtype: jnp.dtype, v_operand_order: bool = False) -> tuple[jax.Array, jax.Array]:
    """The attention step of the forward on already quantized operands: the Mosaic GPU kernel where
    :func:`_mosaic_forward` picks it, else the Triton kernel (``implementation="pallas"``) or the reference.

    Args:
      ops: the INT8 operands and scales (:func:`quantize_pallas` / ``quantize_reference``).
      bias: Q-smoothing's fp32 score bias (:func:`smoothing_bias`) or None.
      opts: resolved options (:func:`resolve_options`); ``opts.seq_q``/``seq_k`` are the real lengths.
      out_dtype: dtype of o.
      v_operand_order: ``ops.vt`` holds its keys in operand order (:func:`operand_orders` ``.v``, as
        :func:`quantize_pallas` was told): only the Mosaic forward takes that.
    Returns:
      o (B, Sq, Hq, D) ``out_dtype`` and the base-2 LSE float32 (B, Hq, Sq).
    """
    use_pallas = opts.implementation == "pallas"
    if use_pallas and _mosaic_forward(Padded.of_operands(ops), opts):
        return sage_fwd_mosaic.sage_attention_fwd_mosaic(
            ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, sq_len=opts.seq_q, sk_len=opts.seq_k,
            causal=opts.causal, out_dtype=out_dtype, config=opts.config, per_block=opts.per_block,
            v_operand_order=v_operand_order, interpret=opts.interpret)
    if v_operand_order:
        raise ValueError("v_operand_order: only the Mosaic forward takes V̂ᵀ in operand order")
    if use_pallas:
        attend = functools.partial(sage_fwd_kernels.sage_attention_fwd, interpret=opts.interpret)
    else:
        attend = sage_attention_reference
    return attend(
        ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, bias,
        sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, k_per_block=opts.per_block,
        out_dtype=out_dtype, config=opts.config,
    )


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sage_attention(q, k, v, prologue, opts: SageOptions):
    return _forward(q, k, v, prologue, opts=opts, transposed=False)[0]


def _sage_attention_fwd(q, k, v, prologue, opts: SageOptions):
    transposed = opts.backward == "int8" and opts.implementation == "pallas"
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
    sq_len, sk_len = opts.seq_q, opts.seq_k
    orders = operand_orders(Padded.of_operands(ops), opts)
    if opts.backward == "bf16":
        return _backward_16bit(_natural_vt(ops, orders.v), do, sq_len=sq_len, sk_len=sk_len, opts=opts)
    bias = smoothing_bias(ops, scale=opts.scale) if opts.smooth_q else None
    if opts.implementation == "pallas":
        return _backward_pallas(ops, bias, o, lse, do, opts=opts, orders=orders)
    return sage_backward_reference(ops, bias, o, lse, do, sq_len=sq_len, sk_len=sk_len, causal=opts.causal,
                                   per_block=opts.per_block, scale=opts.scale, config=opts.config)


def _mosaic_allowed(backend: str, opts: SageOptions) -> bool:
    """The common part of a ``*_backend`` setting: "mosaic" may run Mosaic GPU, "auto" only compiled on
    Hopper, "triton" never (each kernel then checks that it covers the call)."""
    return backend == "mosaic" or (backend == "auto" and not opts.interpret and on_hopper())


def _mosaic_forward(padded: Padded, opts: SageOptions) -> bool:
    """Run the forward on the Mosaic GPU backend for this call (``SageFwdConfig.fwd_backend``)? Not with
    Q-smoothing (``opts.smooth_q``: its score bias, which the Mosaic kernels do not add).

    "auto": on Hopper (not interpreted) from head dim ``sage_fwd_mosaic.AUTO_MIN_HEAD_DIM`` (64) up, where
    it was measured faster than Triton's (H200, forward incl. quantization: B4 H32 S4096 D128 2.30 vs 2.46 ms,
    causal 1.49 vs 1.54, B1 S16384 7.74 vs 8.54, causal 4.43 vs 4.57, fifteenth session; fwd+bwd at D64
    0–2% faster since the scalar scale product, benchmarks/NOTES.md, twentieth session).
    """
    backend = opts.config.fwd_backend
    if not _mosaic_allowed(backend, opts) or (backend == "auto"
                                              and padded.head_dim < sage_fwd_mosaic.AUTO_MIN_HEAD_DIM):
        return False
    return sage_fwd_mosaic.supports(sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=padded.sq, head_dim=padded.head_dim,
                                    causal=opts.causal, has_bias=opts.smooth_q, config=opts.config)


def _mosaic_backend(kernel: str, padded: Padded, opts: SageOptions) -> bool:
    """Run SageBwd's ``kernel`` ("dkdv" or "dq") on the Mosaic GPU backend for this call? (Arguments as
    :func:`_mosaic_forward`.)"""
    if not _mosaic_allowed(getattr(opts.config, f"{kernel}_backend"), opts):
        return False
    # "auto": Mosaic GPU wherever it applies (RESULTS.md, "SageBwd kernel backends"; NOTES.md, eleventh
    # session): since the Mosaic dK/dV kernel stopped spilling registers at D128 it beats Triton's there
    # too (H200, B4 H32 S4096 D128: 13.00 vs 13.39 ms, causal 7.16 vs 7.42); it already did at D64 and S16k.
    return sage_bwd_mosaic.supports(
        kernel, sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=padded.sq, sk_pad=padded.sk, head_dim=padded.head_dim,
        causal=opts.causal, has_bias=opts.smooth_q, config=opts.config)


def _natural_vt(ops: SageOperands, v_operand_order: bool) -> SageOperands:
    """``ops`` with V̂ᵀ in natural key order (an XLA transpose of the INT8 codes if it is in operand order)."""
    return ops._replace(vt=operand_order.from_operand_order(ops.vt, 3)) if v_operand_order else ops


def _backward_pallas(ops: SageOperands, bias, o, lse, do, *, opts: SageOptions,
                     orders: OperandOrders = OperandOrders()):
    """SageBwd with the Pallas kernels: the preprocess, then dK/dV and dQ on their backends.

    Args:
      ops: the forward's INT8 residuals (with the transposed copies Q̂ᵀ, K̂ᵀ).
      bias: Q-smoothing score bias (B, Hq, nqb, Sk_pad) or None.
      o, lse: the forward's output (B, Sq, Hq, D) and base-2 LSE (B, Hq, Sq); do: o's cotangent.
      orders: which residuals are in operand order (:func:`operand_orders`): V̂ᵀ's keys are put back in natural
        order as the Mosaic kernels' Ṽ is dequantized (16-bit rows, which XLA moves fast; the Triton kernels get
        V̂ᵀ itself transposed back), and with Q̂ᵀ's queries dÔᵀ's are made so too, for the Mosaic dK/dV kernel.
    Returns:
      dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D), in do's dtype.
    """
    cfg = opts.config
    kw = dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, per_block=opts.per_block,
              scale=opts.scale, config=cfg, interpret=opts.interpret)
    lse_pad = sage_tiles.pad_lse(lse, ops.q.shape[2])
    dkdv_mosaic, dq_mosaic = (_mosaic_backend(name, Padded.of_operands(ops), opts) for name in ("dkdv", "dq"))
    mosaic_kw = dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, per_block=opts.per_block,
                     ds_per_row=cfg.ds_scale == "row", interpret=opts.interpret)
    dkdv_kw = dict(mosaic_kw, operand_order_in=orders.q_t)
    if orders.q_t and not dkdv_mosaic:
        raise ValueError("q_t_operand_order: only the Mosaic dK/dV kernel takes Q̂ᵀ in operand order")
    fuse_dq = dkdv_mosaic and cfg.fuses_dq(ops.q.shape[3], opts.causal) and sage_bwd_mosaic.supports_fused_dq(
        head_dim=ops.q.shape[3], per_block=opts.per_block, ds_per_row=mosaic_kw["ds_per_row"])
    zero_dq = fuse_dq and sage_bwd_kernels.ZERO_DQ_HERE
    delta, do8_t, do_scale, *dq_zeros = sage_bwd_kernels.sage_bwd_preprocess(
        o, do, config=cfg, operand_order=orders.q_t, zero_dq=zero_dq, interpret=opts.interpret)
    pair_ordered = sage_bwd_mosaic.takes_pair_ordered_inputs(fused_dq=fuse_dq)
    if pair_ordered:  # the fused kernel's K̂ and Ṽ in pair order from one Triton pass
        k8, vd = sage_bwd_kernels.sage_bwd_kv_operands(ops.k, ops.vt, ops.v_scale, dtype=do.dtype,
                                                       v_operand_order=orders.v, interpret=opts.interpret)
    else:
        k8 = ops.k
        vd = (sage_bwd_mosaic.dequantized_v(ops.vt, ops.v_scale, do.dtype, keys_in_operand_order=orders.v)
              if dkdv_mosaic or dq_mosaic else None)
    ops = _natural_vt(ops, orders.v)  # for the Triton kernels (unused, and dropped by XLA, where none runs)
    if fuse_dq:  # one kernel: dQ reduce-added by the dK/dV kernel
        return sage_bwd_mosaic.sage_bwd_dkdv_mosaic(
            ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t, do_scale, k8, ops.k_scale, vd,
            k8_t=ops.k_t, scale=opts.scale, keys_in_pair_order=pair_ordered,
            dq_zeros=dq_zeros[0] if zero_dq else None, **dkdv_kw)
    if dkdv_mosaic:
        dk, dv = sage_bwd_mosaic.sage_bwd_dkdv_mosaic(
            ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t, do_scale, ops.k, ops.k_scale, vd, **dkdv_kw)
    else:
        dk, dv = sage_bwd_kernels.sage_bwd_dkdv(
            ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t, do_scale, ops.k, ops.k_scale, ops.vt,
            ops.v_scale, ops.q_mean, bias, **kw)
    if dq_mosaic:
        dq = sage_bwd_mosaic.sage_bwd_dq_mosaic(
            ops.q, ops.q_scale, lse_pad, delta, do, ops.k, ops.k_scale, ops.k_t, vd, scale=opts.scale, **mosaic_kw)
    else:
        dq = sage_bwd_kernels.sage_bwd_dq(ops.q, ops.q_scale, lse_pad, delta, do, ops.k, ops.k_scale, ops.k_t,
                                          ops.vt, ops.v_scale, bias, **kw)
    return dq, dk, dv


def dequantized_operands(ops: SageOperands, *, sq_len: int, sk_len: int, scale: float, dtype) -> tuple:
    """Q, K' (smoothed), V rebuilt from the INT8 residuals, (B, S, H, D) in ``dtype``."""
    q = int8.dequantize(ops.q, ops.q_scale[..., None]) / (scale * LOG2E)
    if ops.q_mean is not None:
        q = q + jnp.repeat(ops.q_mean, q.shape[2] // ops.q_mean.shape[2], axis=2)
    k = int8.dequantize(ops.k, ops.k_scale[..., None])
    v = int8.dequantize(jnp.swapaxes(ops.vt, 2, 3), ops.v_scale[:, :, None, :])
    to_bshd = lambda x, n: jnp.swapaxes(x, 1, 2)[:, :n].astype(dtype)  # noqa: E731
    return to_bshd(q, sq_len), to_bshd(k, sk_len), to_bshd(v, sk_len)


def _backward_16bit(ops, do, *, sq_len, sk_len, opts):
    """Ablation: exact attention gradients with 16-bit operands rebuilt from the INT8 residuals."""
    q, k, v = dequantized_operands(ops, sq_len=sq_len, sk_len=sk_len, scale=opts.scale, dtype=do.dtype)
    _, vjp = jax.vjp(functools.partial(reference_attention, causal=opts.causal, scale=opts.scale), q, k, v)
    return tuple(g.astype(do.dtype) for g in vjp(do.astype(jnp.float32)))
