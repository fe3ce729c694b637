"""Attn-QAT's implementations behind one seam: the forward and the backward each on Mosaic GPU (Hopper), Triton or
XLA (the reference), picked per call by :mod:`lowbit_jax._registry`.

The Mosaic kernels take K̃ and Ṽ with their keys in :mod:`pallas_kernels.lane_groups` order (each thread then holds
whole FP4 groups of P); the fake-quantization pass writes them so when the Mosaic forward runs, and the other
implementations get them back in key order. The public function asks the implementations; it never decides.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from lowbit_jax._registry import pick, require
from lowbit_jax.qat_reference import (
    fake_quant_operands, mma_dtype, padded, qat_backward_reference, qat_forward_reference,
)
from pallas_kernels import fake_quant as fake_quant_kernels
from pallas_kernels import lane_groups, qat_bwd_mosaic, qat_fwd_mosaic
from pallas_kernels import qat_bwd as qat_bwd_kernels
from pallas_kernels import qat_fwd as qat_fwd_kernels
from pallas_kernels.configs import QatConfig
from pallas_kernels.numerics import qk_prologue
from pallas_kernels.numerics.qk_prologue import QKPrologue


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


class QatCall(NamedTuple):
    """What picking an implementation looks at: the options, the head dim and the inputs' dtype."""

    opts: QatOptions
    head_dim: int
    dtype: jax.typing.DTypeLike


# ----------------------------------------------------------------------------- forward


class _Forward:
    name = ""

    def supports(self, call: QatCall) -> None:
        raise NotImplementedError

    def lane_order(self, call: QatCall) -> bool:
        """Whether K̃ and Ṽ are written in lane order for this implementation."""
        return False

    def quantize(self, q, k, v, opts: QatOptions, *, lane_order: bool, prologue: QKPrologue | None = None):
        """Q̃, K̃, Ṽ: (B, H, S_pad, D) bf16/fp16, head-major and padded (K̃, Ṽ in lane order if asked); q and k
        normalized and rotated first by ``prologue`` (inside the fake-quantization kernel)."""
        cfg = opts.config
        fqk = fake_quant_kernels

        def kw(x, lanes, pro=None):
            return dict(seq_pad=padded(x.shape[1], cfg.pad),
                        block=max(cfg.quant_block, lane_groups.BLOCK) if lanes else cfg.quant_block,
                        out_dtype=mma_dtype(x.dtype), lane_order=lanes,
                        num_warps=fqk.warps_for(cfg.quant_warps, x.shape[-1], pro), interpret=opts.interpret)

        qf = fqk.fp4_fake_quant_heads(q, prologue, "q", **kw(q, False, prologue))
        # one launch for K and V (they share shape and dtype: checked)
        return qf, *fqk.fp4_fake_quant_kv(k, v, prologue, **kw(k, lane_order, prologue))

    def attend(self, qf, kf, vf, opts: QatOptions, out_dtype, *, with_aux: bool, lane_order: bool):
        """(o, o_aux or None, lse, m) as :func:`pallas_kernels.qat_fwd.qat_attention_fwd`."""
        raise NotImplementedError


class XlaForward(_Forward):
    """The pure-JAX twin (:mod:`lowbit_jax.qat_reference`), the kernels' fake quantization on whole arrays."""

    name = "xla"

    def supports(self, call: QatCall) -> None:
        require(call.opts.implementation == "xla", "implementation is not 'xla'")

    def quantize(self, q, k, v, opts, *, lane_order, prologue=None):
        return fake_quant_operands(*qk_prologue.apply_qk(q, k, prologue), v, config=opts.config)

    def attend(self, qf, kf, vf, opts, out_dtype, *, with_aux, lane_order):
        return qat_forward_reference(qf, kf, vf, **_kw(opts), out_dtype=out_dtype, with_aux=with_aux)


def _kw(opts: QatOptions) -> dict:
    return dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, scale=opts.scale, config=opts.config)


class TritonForward(_Forward):
    """:mod:`pallas_kernels.qat_fwd`: every Pallas call (the fallback of the Mosaic forward)."""

    name = "triton"

    def supports(self, call: QatCall) -> None:
        require(call.opts.implementation == "pallas", "implementation is not 'pallas'")

    def attend(self, qf, kf, vf, opts, out_dtype, *, with_aux, lane_order):
        return qat_fwd_kernels.qat_attention_fwd(qf, kf, vf, **_kw(opts), out_dtype=out_dtype, with_aux=with_aux,
                                                 interpret=opts.interpret)


class MosaicForward(_Forward):
    """:mod:`pallas_kernels.qat_fwd_mosaic` (``QatConfig.fwd_backend`` "mosaic", resolved from "auto" on Hopper):
    head dims 64 and 128, 16-bit outputs."""

    name = "mosaic"

    def supports(self, call: QatCall) -> None:
        opts = call.opts
        require(opts.implementation == "pallas", "implementation is not 'pallas'")
        require(opts.config.fwd_backend == "mosaic", "fwd_backend does not ask for Mosaic GPU")
        require(qat_fwd_mosaic.supports(sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=padded(opts.seq_q,
                                                                                            opts.config.pad),
                                         head_dim=call.head_dim, causal=opts.causal, out_dtype=call.dtype,
                                         config=opts.config), "the Mosaic forward does not cover this call")

    def lane_order(self, call: QatCall) -> bool:
        return True

    def attend(self, qf, kf, vf, opts, out_dtype, *, with_aux, lane_order):
        return qat_fwd_mosaic.qat_attention_fwd_mosaic(qf, kf, vf, **_kw(opts), out_dtype=out_dtype,
                                                       with_aux=with_aux, lane_ordered=lane_order,
                                                       interpret=opts.interpret)


FORWARDS = (MosaicForward(), TritonForward(), XlaForward())


def forward_for(call: QatCall) -> _Forward:
    """The forward implementation of a call."""
    return pick(FORWARDS, call)


def kv_in_key_order(kf: jax.Array, vf: jax.Array, lane_order: bool) -> tuple[jax.Array, jax.Array]:
    """The forward's K̃, Ṽ residuals (B, Hkv, Sk_pad, D) in key order (undoing the lane order if they are in it)."""
    if lane_order:
        return lane_groups.from_lane_order(kf, 2), lane_groups.from_lane_order(vf, 2)
    return kf, vf


# ----------------------------------------------------------------------------- backward


class _Backward:
    name = ""

    def supports(self, call: QatCall) -> None:
        raise NotImplementedError

    def grads(self, qf, kf, vf, o_aux, lse, m, do, opts: QatOptions, *, lane_order: bool):
        """The gradients w.r.t. Q̃, K̃, Ṽ (= w.r.t. the fake-quantizers' inputs by the STE)."""
        raise NotImplementedError


class XlaBackward(_Backward):
    name = "xla"

    def supports(self, call: QatCall) -> None:
        require(call.opts.implementation == "xla", "implementation is not 'xla'")

    def grads(self, qf, kf, vf, o_aux, lse, m, do, opts, *, lane_order):
        kf, vf = kv_in_key_order(kf, vf, lane_order)
        return qat_backward_reference(qf, kf, vf, o_aux, lse, m, do, **_kw(opts), naive=opts.naive_backward)


class TritonBackward(_Backward):
    """:mod:`pallas_kernels.qat_bwd`: every Pallas call (the fallback of the Mosaic backward)."""

    name = "triton"

    def supports(self, call: QatCall) -> None:
        require(call.opts.implementation == "pallas", "implementation is not 'pallas'")

    def grads(self, qf, kf, vf, o_aux, lse, m, do, opts, *, lane_order):
        kf, vf = kv_in_key_order(kf, vf, lane_order)  # the Triton kernels take keys in order
        return qat_bwd_kernels.qat_attention_bwd(qf, kf, vf, o_aux, lse, m, do, **_kw(opts),
                                                 naive=opts.naive_backward, interpret=opts.interpret)


class MosaicBackward(_Backward):
    """:mod:`pallas_kernels.qat_bwd_mosaic` (``QatConfig.bwd_backend`` "mosaic", resolved from "auto" on Hopper),
    dQ fused into the dK/dV kernel where ``QatConfig.fuses_dq``: head dims 64 and 128, 16-bit operands."""

    name = "mosaic"

    def supports(self, call: QatCall) -> None:
        opts = call.opts
        require(opts.implementation == "pallas", "implementation is not 'pallas'")
        require(opts.config.bwd_backend == "mosaic", "bwd_backend does not ask for Mosaic GPU")
        pad = opts.config.pad
        dt = mma_dtype(call.dtype)
        require(qat_bwd_mosaic.supports(sq_len=opts.seq_q, sk_len=opts.seq_k, sq_pad=padded(opts.seq_q, pad),
                                         sk_pad=padded(opts.seq_k, pad), head_dim=call.head_dim,
                                         causal=opts.causal, dtype=dt, do_dtype=call.dtype),
                 "the Mosaic backward does not cover this call")

    def grads(self, qf, kf, vf, o_aux, lse, m, do, opts, *, lane_order):
        return qat_bwd_mosaic.qat_attention_bwd_mosaic(
            qf, kf, vf, o_aux, lse, m, do, sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal,
            scale=opts.scale, naive=opts.naive_backward, fused_dq=opts.config.fuses_dq(qf.shape[3], opts.causal),
            lane_ordered=lane_order, dq_stage_order=opts.config.dq_stage_order, interpret=opts.interpret)


BACKWARDS = (MosaicBackward(), TritonBackward(), XlaBackward())


def backward_for(call: QatCall) -> _Backward:
    """The backward implementation of a call."""
    return pick(BACKWARDS, call)


__all__ = ["BACKWARDS", "FORWARDS", "QatCall", "QatOptions", "backward_for", "forward_for", "kv_in_key_order"]
