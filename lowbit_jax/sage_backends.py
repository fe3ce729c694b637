"""SageAttention's implementations behind one seam: the forward and the backward each on Mosaic GPU (Hopper),
Triton or XLA (the reference), picked per call by :mod:`lowbit_jax._registry`.

Each implementation owns its operands' layout: the Mosaic forward takes V̂ᵀ with its keys in
:mod:`pallas_kernels.operand_order` (so P̂ is its next product's A operand as the registers hold it), the Mosaic
backward takes Q̂ᵀ and dÔᵀ so, and its fused dQ takes K̂ and Ṽ in :mod:`pallas_kernels.key_pairs` order. The
public function asks the picked implementations for their layouts before quantizing; it never decides them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowbit_jax._registry import pick, require
from lowbit_jax.reference import reference_attention
from lowbit_jax.sage_reference import quantize_reference, sage_attention_reference, sage_backward_reference
from pallas_kernels import operand_order
from pallas_kernels import quantize as quantize_kernels
from pallas_kernels import sage_bwd as sage_bwd_kernels
from pallas_kernels import sage_bwd_mosaic, sage_fwd_mosaic
from pallas_kernels import sage_fwd as sage_fwd_kernels
from pallas_kernels._mosaic import on_hopper
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.numerics import int8, qk_prologue, sage_tiles
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels.numerics.sage_tiles import SageOperands

LOG2E = math.log2(math.e)


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


class SageCall(NamedTuple):
    """What picking an implementation looks at: the options and the INT8 operands' padded lengths and head dim
    (``config.block_q``/``block_k`` multiples, as the quantize kernels pad them)."""

    opts: SageOptions
    sq_pad: int
    sk_pad: int
    head_dim: int

    @classmethod
    def of_inputs(cls, q, k, opts: SageOptions) -> "SageCall":
        """Before quantizing: q (B, Sq, Hq, D), k (B, Sk, Hkv, D) (arrays or shape structs)."""
        pad = lambda n, block: -(-n // block) * block  # noqa: E731
        return cls(opts, pad(q.shape[1], opts.config.block_q), pad(k.shape[1], opts.config.block_k), q.shape[3])

    @classmethod
    def of_operands(cls, ops: SageOperands, opts: SageOptions) -> "SageCall":
        """Of quantized operands: Q̂ (B, Hq, Sq_pad, D), K̂ (B, Hkv, Sk_pad, D)."""
        return cls(opts, ops.q.shape[2], ops.k.shape[2], ops.q.shape[3])


def _mosaic_allowed(backend: str, opts: SageOptions) -> bool:
    """A config's ``*_backend`` field allows Mosaic GPU: "mosaic", or "auto" compiled on Hopper."""
    return backend == "mosaic" or (backend == "auto" and not opts.interpret and on_hopper())


# ----------------------------------------------------------------------------- forward


class _Forward:
    """A forward implementation: the quantization of q, k, v and the attention step on its operands."""

    name = ""

    def supports(self, call: SageCall) -> None:
        raise NotImplementedError

    def v_operand_order(self, call: SageCall) -> bool:
        """Whether V̂ᵀ should hold its keys in :mod:`pallas_kernels.operand_order` for this implementation."""
        return False

    def quantize(self, q, k, v, prologue: QKPrologue | None, opts: SageOptions, *, transposed: bool,
                 v_order: bool, q_t_order: bool) -> SageOperands:
        """The INT8 operands (and, ``transposed``, the copies the backward reads), in the orders asked for."""
        return quantize_pallas(q, k, v, scale=opts.scale, smooth_k=opts.smooth_k, smooth_q=opts.smooth_q,
                               per_block=opts.per_block, config=opts.config, transposed=transposed,
                               v_order=v_order, q_t_order=q_t_order, prologue=prologue, interpret=opts.interpret)

    def attend(self, ops: SageOperands, bias, opts: SageOptions, out_dtype, v_order: bool):
        """o (B, Sq, Hq, D) ``out_dtype`` and the base-2 LSE float32 (B, Hq, Sq)."""
        raise NotImplementedError


class XlaForward(_Forward):
    """The pure-JAX reference (:mod:`lowbit_jax.sage_reference`), the same quantization on whole arrays."""

    name = "xla"

    def supports(self, call: SageCall) -> None:
        require(call.opts.implementation == "xla", "implementation is not 'xla'")

    def quantize(self, q, k, v, prologue, opts, *, transposed, v_order, q_t_order):
        q, k = qk_prologue.apply_qk(q, k, prologue)
        return quantize_reference(q, k, v, scale=opts.scale, smooth_k=opts.smooth_k, smooth_q=opts.smooth_q,
                                  per_block=opts.per_block, config=opts.config, transposed=transposed)

    def attend(self, ops, bias, opts, out_dtype, v_order):
        return sage_attention_reference(ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, bias,
                                        sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal,
                                        k_per_block=opts.per_block, out_dtype=out_dtype, config=opts.config)


class TritonForward(_Forward):
    """:mod:`pallas_kernels.sage_fwd`: every Pallas call (the fallback of the Mosaic forward)."""

    name = "triton"

    def supports(self, call: SageCall) -> None:
        require(call.opts.implementation == "pallas", "implementation is not 'pallas'")

    def attend(self, ops, bias, opts, out_dtype, v_order):
        if v_order:
            raise ValueError("the Triton forward takes V̂ᵀ in natural key order")
        return sage_fwd_kernels.sage_attention_fwd(
            ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, bias, sq_len=opts.seq_q, sk_len=opts.seq_k,
            causal=opts.causal, k_per_block=opts.per_block, out_dtype=out_dtype, config=opts.config,
            interpret=opts.interpret)


class MosaicForward(_Forward):
    """:mod:`pallas_kernels.sage_fwd_mosaic` on Hopper (``SageFwdConfig.fwd_backend``): no Q-smoothing bias, head
    dims 64 and 128."""

    name = "mosaic"

    def supports(self, call: SageCall) -> None:
        opts = call.opts
        require(opts.implementation == "pallas", "implementation is not 'pallas'")
        require(_mosaic_allowed(opts.config.fwd_backend, opts), "fwd_backend and device do not allow Mosaic GPU")
        require(sage_fwd_mosaic.supports(sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=call.sq_pad,
                                          head_dim=call.head_dim, causal=opts.causal, has_bias=opts.smooth_q,
                                          config=opts.config), "the Mosaic forward does not cover this call")

    def v_operand_order(self, call: SageCall) -> bool:
        return sage_fwd_mosaic.takes_operand_order(call.opts.interpret)

    def attend(self, ops, bias, opts, out_dtype, v_order):
        return sage_fwd_mosaic.sage_attention_fwd_mosaic(
            ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, sq_len=opts.seq_q, sk_len=opts.seq_k,
            causal=opts.causal, out_dtype=out_dtype, config=opts.config, per_block=opts.per_block,
            v_operand_order=v_order, interpret=opts.interpret)


FORWARDS = (MosaicForward(), TritonForward(), XlaForward())


def forward_for(call: SageCall) -> _Forward:
    """The forward implementation of a call."""
    return pick(FORWARDS, call)


def quantize_pallas(q, k, v, *, scale, smooth_k, smooth_q, per_block, config, transposed=False, v_order=False,
                    q_t_order=False, prologue: QKPrologue | None = None, interpret=False) -> SageOperands:
    """Quantize with the fused Pallas kernels (:mod:`pallas_kernels.quantize`); V̂ᵀ's keys and Q̂ᵀ's queries in
    operand order where asked; q and k through ``prologue`` first, inside the kernels."""
    k_mean, v_scale = quantize_kernels.sage_channel_stats(k, v, prologue, smooth_k=smooth_k,
                                                          v_format=config.pv_format, interpret=interpret)
    q_warps = config.quant_warps if prologue is None else max(config.quant_warps, quantize_kernels.PROLOGUE_WARPS)
    q8, qs, q_mean, q8_t = quantize_kernels.sage_quantize_q(
        q, prologue, block=config.block_q, per_block=per_block, smooth_block=smooth_q, out_scale=scale * LOG2E,
        transposed=transposed, t_operand_order=q_t_order, num_warps=q_warps, interpret=interpret,
    )
    k8, ks, vt8, k8_t = quantize_kernels.sage_quantize_kv(
        k, v, k_mean, v_scale, prologue, block=config.block_k, per_block=per_block, transposed=transposed,
        v_operand_order=v_order, v_format=config.pv_format, num_warps=config.kv_quant_warps, interpret=interpret,
    )
    return SageOperands(q8, qs, k8, ks, vt8, v_scale, q_mean, q8_t, k8_t)


# ----------------------------------------------------------------------------- backward


class _Backward:
    """A backward implementation: the gradients w.r.t. q, k, v from the forward's residuals."""

    name = ""

    def supports(self, call: SageCall) -> None:
        raise NotImplementedError

    def q_t_operand_order(self, call: SageCall) -> bool:
        """Whether Q̂ᵀ (and dÔᵀ) should hold their queries in operand order for this implementation."""
        return False

    def transposed(self, call: SageCall) -> bool:
        """Whether it reads the transposed INT8 copies Q̂ᵀ, K̂ᵀ (the forward then writes them)."""
        return True

    def grads(self, ops: SageOperands, bias, o, lse, do, opts: SageOptions, orders: "Orders"):
        """dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D) in do's dtype."""
        raise NotImplementedError


class Orders(NamedTuple):
    """Which INT8 residuals hold their tokens in operand order: V̂ᵀ's keys (``v``), Q̂ᵀ's queries (``q_t``)."""

    v: bool = False
    q_t: bool = False


def natural_vt(ops: SageOperands, v_order: bool) -> SageOperands:
    """``ops`` with V̂ᵀ in natural key order (an XLA transpose of the INT8 codes if it is in operand order)."""
    return ops._replace(vt=operand_order.from_operand_order(ops.vt, 3)) if v_order else ops


def dequantized_operands(ops: SageOperands, *, sq_len: int, sk_len: int, scale: float, dtype) -> tuple:
    """Q, K' (smoothed), V rebuilt from the INT8 residuals, (B, S, H, D) in ``dtype``."""
    q = int8.dequantize(ops.q, ops.q_scale[..., None]) / (scale * LOG2E)
    if ops.q_mean is not None:
        q = q + jnp.repeat(ops.q_mean, q.shape[2] // ops.q_mean.shape[2], axis=2)
    k = int8.dequantize(ops.k, ops.k_scale[..., None])
    v = int8.dequantize(jnp.swapaxes(ops.vt, 2, 3), ops.v_scale[:, :, None, :])  # INT8 or e4m3 codes
    to_bshd = lambda x, n: jnp.swapaxes(x, 1, 2)[:, :n].astype(dtype)  # noqa: E731
    return to_bshd(q, sq_len), to_bshd(k, sk_len), to_bshd(v, sk_len)


class Bf16Backward(_Backward):
    """``backward="bf16"``, the ablation: exact attention gradients with 16-bit operands rebuilt from the INT8
    residuals (the same for every implementation)."""

    name = "bf16"

    def supports(self, call: SageCall) -> None:
        require(call.opts.backward == "bf16", "backward is not 'bf16'")

    def transposed(self, call: SageCall) -> bool:
        return False

    def grads(self, ops, bias, o, lse, do, opts, orders):
        q, k, v = dequantized_operands(natural_vt(ops, orders.v), sq_len=opts.seq_q, sk_len=opts.seq_k,
                                       scale=opts.scale, dtype=do.dtype)
        _, vjp = jax.vjp(functools.partial(reference_attention, causal=opts.causal, scale=opts.scale), q, k, v)
        return tuple(g.astype(do.dtype) for g in vjp(do.astype(jnp.float32)))


class XlaBackward(_Backward):
    """SageBwd in pure JAX (:func:`lowbit_jax.sage_reference.sage_backward_reference`)."""

    name = "xla"

    def supports(self, call: SageCall) -> None:
        require(call.opts.implementation == "xla", "implementation is not 'xla'")

    def transposed(self, call: SageCall) -> bool:
        return False

    def grads(self, ops, bias, o, lse, do, opts, orders):
        return sage_backward_reference(ops, bias, o, lse, do, sq_len=opts.seq_q, sk_len=opts.seq_k,
                                       causal=opts.causal, per_block=opts.per_block, scale=opts.scale,
                                       config=opts.config)


def _mosaic_kernel(kernel: str, call: SageCall) -> bool:
    """Whether SageBwd's ``kernel`` ("dkdv" or "dq") runs on Mosaic GPU for this call (its config field allows it
    and the kernel covers the call)."""
    opts = call.opts
    return _mosaic_allowed(getattr(opts.config, f"{kernel}_backend"), opts) and sage_bwd_mosaic.supports(
        kernel, sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=call.sq_pad, sk_pad=call.sk_pad,
        head_dim=call.head_dim, causal=opts.causal, has_bias=opts.smooth_q, config=opts.config)


class TritonBackward(_Backward):
    """SageBwd's Triton dK/dV kernel (:mod:`pallas_kernels.sage_bwd`), with the dQ kernel on Mosaic GPU where
    ``dq_backend`` allows it and it covers the call, else Triton's."""

    name = "triton"

    def supports(self, call: SageCall) -> None:
        require(call.opts.implementation == "pallas", "implementation is not 'pallas'")

    def grads(self, ops, bias, o, lse, do, opts, orders):
        call = SageCall.of_operands(ops, opts)
        delta, do8_t, do_scale = sage_bwd_kernels.sage_bwd_preprocess(o, do, config=opts.config,
                                                                      interpret=opts.interpret)
        lse_pad = sage_tiles.pad_lse(lse, ops.q.shape[2])
        natural = natural_vt(ops, orders.v)
        dk, dv = sage_bwd_kernels.sage_bwd_dkdv(
            ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t, do_scale, ops.k, ops.k_scale, natural.vt,
            ops.v_scale, ops.q_mean, bias, **_triton_kw(opts))
        return _dq(call, natural, ops, bias, lse_pad, delta, do, opts, orders), dk, dv


def _triton_kw(opts: SageOptions) -> dict:
    return dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, per_block=opts.per_block,
                scale=opts.scale, config=opts.config, interpret=opts.interpret)


def _mosaic_kw(opts: SageOptions) -> dict:
    return dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, per_block=opts.per_block,
                ds_per_row=opts.config.ds_scale == "row", interpret=opts.interpret)


def _dq(call: SageCall, natural: SageOperands, ops: SageOperands, bias, lse_pad, delta, do, opts: SageOptions,
        orders: Orders):
    """dQ by its own kernel: Mosaic GPU's where allowed and covered (Ṽ dequantized by XLA, its keys back in
    natural order), else Triton's."""
    if _mosaic_kernel("dq", call):
        vd = sage_bwd_mosaic.dequantized_v(ops.vt, ops.v_scale, do.dtype, keys_in_operand_order=orders.v)
        return sage_bwd_mosaic.sage_bwd_dq_mosaic(ops.q, ops.q_scale, lse_pad, delta, do, ops.k, ops.k_scale, ops.k_t,
                                                  vd, scale=opts.scale, **_mosaic_kw(opts))
    return sage_bwd_kernels.sage_bwd_dq(ops.q, ops.q_scale, lse_pad, delta, do, ops.k, ops.k_scale, ops.k_t,
                                        natural.vt, ops.v_scale, bias, **_triton_kw(opts))


class MosaicBackward(_Backward):
    """SageBwd's dK/dV kernel on Mosaic GPU (:mod:`pallas_kernels.sage_bwd_mosaic`, ``dkdv_backend``), with dQ
    fused into it where ``SageFwdConfig.fuses_dq`` and the scales allow (one dŜ per tile), else by its own
    kernel (Mosaic GPU's or Triton's). It takes Q̂ᵀ and dÔᵀ in operand order, and the fused kernel K̂ and Ṽ in
    key-pair order from one Triton pass."""

    name = "mosaic"

    def supports(self, call: SageCall) -> None:
        require(call.opts.implementation == "pallas", "implementation is not 'pallas'")
        require(call.opts.backward == "int8", "backward is not 'int8'")
        require(_mosaic_kernel("dkdv", call), "dkdv_backend, device or shapes rule out the Mosaic dK/dV kernel")

    def q_t_operand_order(self, call: SageCall) -> bool:
        return sage_bwd_mosaic.takes_operand_order(call.opts.interpret)

    @staticmethod
    def fuses_dq(call: SageCall) -> bool:
        opts = call.opts
        return opts.config.fuses_dq(call.head_dim, opts.causal) and sage_bwd_mosaic.supports_fused_dq(
            head_dim=call.head_dim, per_block=opts.per_block, ds_per_row=opts.config.ds_scale == "row")

    def grads(self, ops, bias, o, lse, do, opts, orders):
        call = SageCall.of_operands(ops, opts)
        fused = self.fuses_dq(call)
        lse_pad = sage_tiles.pad_lse(lse, ops.q.shape[2])
        # the fused kernel's float32 dQ accumulator is zeroed by the preprocess, which reads dO anyway
        delta, do8_t, do_scale, *dq_zeros = sage_bwd_kernels.sage_bwd_preprocess(
            o, do, config=opts.config, operand_order=orders.q_t, zero_dq=fused, interpret=opts.interpret)
        natural = natural_vt(ops, orders.v)
        kw = dict(_mosaic_kw(opts), operand_order_in=orders.q_t)
        if fused:  # K̂ and Ṽ in pair order from one Triton pass; dQ reduce-added by the dK/dV kernel
            k8, vd = sage_bwd_kernels.sage_bwd_kv_operands(ops.k, ops.vt, ops.v_scale, dtype=do.dtype,
                                                           v_operand_order=orders.v, interpret=opts.interpret)
            return sage_bwd_mosaic.sage_bwd_dkdv_mosaic(
                ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t, do_scale, k8, ops.k_scale, vd,
                k8_t=ops.k_t, scale=opts.scale, keys_in_pair_order=True, dq_zeros=dq_zeros[0],
                dq_stage_order=opts.config.dq_stage_order, split_dq_schedule=opts.config.split_dq_schedule, **kw)
        vd = sage_bwd_mosaic.dequantized_v(ops.vt, ops.v_scale, do.dtype, keys_in_operand_order=orders.v)
        dk, dv = sage_bwd_mosaic.sage_bwd_dkdv_mosaic(ops.q, ops.q_scale, ops.q_t, lse_pad, delta, do, do8_t,
                                                      do_scale, ops.k, ops.k_scale, vd, **kw)
        return _dq(call, natural, ops, bias, lse_pad, delta, do, opts, orders), dk, dv


BACKWARDS = (Bf16Backward(), MosaicBackward(), TritonBackward(), XlaBackward())


def backward_for(call: SageCall) -> _Backward:
    """The backward implementation of a call."""
    return pick(BACKWARDS, call)


def orders_for(call: SageCall) -> Orders:
    """The operand orders the call's forward and backward implementations take."""
    return Orders(v=forward_for(call).v_operand_order(call), q_t=backward_for(call).q_t_operand_order(call))


__all__ = ["BACKWARDS", "FORWARDS", "Orders", "SageCall", "SageOptions", "backward_for",
           "dequantized_operands", "forward_for", "natural_vt", "orders_for", "quantize_pallas"]
