"""Tile configurations: frozen dataclasses, a heuristic, tuned values per device.

A config is part of a method's numerics, not only of its speed: per-block INT8
scales and the per-row P scale are taken per tile. Both implementations
("pallas" and "xla") therefore take the same config, and tests pass one
explicitly.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from pallas_kernels.numerics.sage_tiles import PV_FORMATS


#: Pallas backends a kernel family may run on ("auto" picks per device and call).
BACKENDS = ("auto", "triton", "mosaic")
#: how a Mosaic backward computes dQ (SageFwdConfig.dq_kernel, QatConfig.dq_kernel)
DQ_KERNELS = ("auto", "separate", "fused")


def fuses_dq(dq_kernel: str) -> bool:
    """``dq_kernel`` resolved: "fused" and "auto" fuse (faster at every measured shape of both methods),
    "separate" does not."""
    return dq_kernel in ("fused", "auto")


#: the fused dQ's float32 stage column order (SageFwdConfig.dq_stage_order, QatConfig.dq_stage_order;
#: ``dq_stage.permutes``)
DQ_STAGE_ORDERS = ("auto", "natural", "permuted")
#: where SageBwd's split dQ (head dim 128) runs in the dK/dV step (SageFwdConfig.split_dq_schedule)
SPLIT_DQ_SCHEDULES = ("after_dk", "under_dk")

#: granularities of SageBwd's INT8 dS scales (SageFwdConfig.ds_scale)
DS_SCALES = ("tile", "row")


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class SageFwdConfig:
    """Tiles and backends of SageAttention (forward) and SageBwd (backward).

    Attributes:
      block_q: query rows per program (also the Q quantization block).
      block_k: keys per inner step (also the K quantization block); ≥ 32 so the INT8 P·V product has a K
        dimension the tensor cores like.
      num_warps, num_stages: Triton launch parameters of the attention kernel.
      quant_warps: warps of the memory-bound quantize kernels (Q's; the preprocess of the backward).
      kv_quant_warps: warps of the K/V quantize kernel (two tiles, three INT8 outputs, two of them
        transposed); None: ``quant_warps``.
      bwd_block_q, bwd_block_k: tiles of the SageBwd kernels (dO and dS are quantized per such tile); they must
        divide block_q / block_k so the forward's per-block Q/K scales are constant on every backward tile.
      bwd_warps, bwd_stages: launch parameters of the backward kernels.
      dq_block_k, dq_warps, dq_stages: the separate dQ kernel's key tile (dS is quantized per
        (bwd_block_q × dq_block_k) tile for dQ; must divide block_k) and launch parameters; default to the
        dK/dV kernel's.
      fwd_backend, dkdv_backend, dq_backend: the Pallas backend of the forward, the dK/dV and the dQ kernel:
        "triton", "mosaic" (Mosaic GPU, warp-specialised ``wgmma``; sm_90 only, and only for the calls it
        covers, else Triton) or "auto" (default): Mosaic on Hopper wherever it applies (faster at every measured
        shape), Triton in interpret mode and off Hopper. The numerics are the same.
      ds_scale: granularity of the INT8 dS scales. "tile" (default, the paper's): one scale per backward tile.
        "row": each kernel uses its own dS in one product only, so the scale may follow that product's output
        rows — one per key for dK = dSᵀQ̂, one per query row for dQ = dŜK̂: more accurate (dQ/dK rel-L2 vs
        exact about half the tile's) but slower (no fused dQ: one dŜ cannot serve both products).
      pv_format: the operands of the forward's P·V product. "int8" (the default; the paper's): P̂ INT8 per row
        at each key tile's own row max, V̂ INT8 per channel. "e4m3": FP8 e4m3 P̃ at the running row max and V per
        channel (SageAttention2's Hopper recipe, :mod:`pallas_kernels.numerics.e4m3`): no int32 → float conversion
        or rescale of the product per step, about 3× INT8's O error (cos-sim vs exact .9992–.9994 against
        .9998 on N(0,1) inputs, docs/spec.md); :func:`sage_fwd_config`'s choice on Hopper, where it is faster.
        Needs an sm_89+ GPU (or the interpreter). The backward reads the same V̂.
      dq_kernel: "fused": when the dK/dV kernel runs on Mosaic GPU with per-block Q/K scales, per-tile dS
        scales and ``dq_block_k == bwd_block_k`` (one dŜ serves both products), it also reduce-adds each step's
        dŜK̂ into a float32 dQ with TMA (FlashAttention-3's accumulation; the summation order then varies run
        to run); elsewhere, and with "separate", the dQ kernel recomputes S, P and dP per query tile. "auto"
        (default): fused wherever it applies (faster at every measured shape).
      dq_stage_order: the fused dQ's float32 SMEM stage: "permuted" holds its columns in ``dq_stage`` order
        (conflict-free 16-byte stores; compiled only, the interpreter stores them in order, same values), "natural"
        in order, "auto" (default) permuted at head dim 64 (measured faster), natural at 128.
      split_dq_schedule: at head dim 128, where the fused dQ (split by columns between the warpgroups) sits in a
        step: "after_dk" (default) its products after dK's; "under_dk" between dV's and dK's, its stage store and
        TMA reduce-add issued while dK's product runs.
    """

    block_q: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    quant_warps: int = 4
    kv_quant_warps: int | None = None  # default quant_warps
    bwd_block_q: int | None = None  # default min(64, block_q)
    bwd_block_k: int | None = None  # default min(64, block_k)
    bwd_warps: int = 4
    bwd_stages: int = 2
    dq_block_k: int | None = None  # default bwd_block_k
    dq_warps: int | None = None  # default bwd_warps
    dq_stages: int | None = None  # default bwd_stages
    dkdv_backend: str = "auto"
    dq_backend: str = "auto"
    fwd_backend: str = "auto"
    ds_scale: str = "tile"
    dq_kernel: str = "auto"
    pv_format: str = "int8"
    dq_stage_order: str = "auto"
    split_dq_schedule: str = "after_dk"

    def __post_init__(self) -> None:
        if self.dq_kernel not in DQ_KERNELS:
            raise ValueError(f"SageFwdConfig.dq_kernel must be one of {DQ_KERNELS}, got {self.dq_kernel!r}")
        if self.dq_stage_order not in DQ_STAGE_ORDERS:
            raise ValueError(f"SageFwdConfig.dq_stage_order must be one of {DQ_STAGE_ORDERS}, "
                             f"got {self.dq_stage_order!r}")
        if self.split_dq_schedule not in SPLIT_DQ_SCHEDULES:
            raise ValueError(f"SageFwdConfig.split_dq_schedule must be one of {SPLIT_DQ_SCHEDULES}, "
                             f"got {self.split_dq_schedule!r}")
        for name in ("dkdv_backend", "dq_backend", "fwd_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"SageFwdConfig.{name} must be one of {BACKENDS}, got {getattr(self, name)!r}")
        if self.pv_format not in PV_FORMATS:
            raise ValueError(f"SageFwdConfig.pv_format must be one of {PV_FORMATS}, got {self.pv_format!r}")
        if self.ds_scale not in DS_SCALES:
            raise ValueError(f"SageFwdConfig.ds_scale must be one of {DS_SCALES}, got {self.ds_scale!r}")
        if self.bwd_block_q is None:
            object.__setattr__(self, "bwd_block_q", min(64, self.block_q))
        if self.bwd_block_k is None:
            object.__setattr__(self, "bwd_block_k", min(64, self.block_k))
        for name, default in (("dq_block_k", self.bwd_block_k), ("dq_warps", self.bwd_warps),
                              ("dq_stages", self.bwd_stages), ("kv_quant_warps", self.quant_warps)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("block_q", "block_k", "num_warps", "quant_warps", "kv_quant_warps", "bwd_block_q", "bwd_block_k",
                     "bwd_warps", "dq_block_k", "dq_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_pow2(value):
                raise ValueError(f"SageFwdConfig.{name} must be a power of two, got {value!r}")
        if self.block_q < 16:
            raise ValueError(f"SageFwdConfig.block_q must be >= 16, got {self.block_q}")
        if self.block_k < 32:
            raise ValueError(f"SageFwdConfig.block_k must be >= 32, got {self.block_k}")
        if self.num_stages < 1 or self.bwd_stages < 1 or self.dq_stages < 1:
            raise ValueError(f"SageFwdConfig stages must be >= 1, got {self.num_stages}, {self.bwd_stages}, "
                             f"{self.dq_stages}")
        if self.dq_block_k < 32 or self.block_k % self.dq_block_k:
            raise ValueError(f"SageFwdConfig.dq_block_k must be >= 32 and divide block_k, got {self.dq_block_k} "
                             f"and block_k {self.block_k}")
        if self.bwd_block_q < 16 or self.bwd_block_k < 32:
            raise ValueError(f"SageFwdConfig.bwd_block_q must be >= 16 and bwd_block_k >= 32, got "
                             f"{self.bwd_block_q}, {self.bwd_block_k}")
        if self.block_q % self.bwd_block_q or self.block_k % self.bwd_block_k:
            raise ValueError("SageFwdConfig.bwd_block_q/bwd_block_k must divide block_q/block_k, got "
                             f"{self.bwd_block_q}/{self.block_q} and {self.bwd_block_k}/{self.block_k}")

    def fuses_dq(self, head_dim: int, causal: bool) -> bool:
        """Whether a Mosaic dK/dV kernel should also compute dQ (``dq_kernel``; where it can:
        ``sage_bwd_mosaic.supports_fused_dq``). "auto" fuses at every head dim, causal or not. Never with
        ``dq_block_k != bwd_block_k``: the fused dQ takes dK's dŜ, which is dQ's only if both products quantize
        dS on the same tiles."""
        del head_dim, causal
        return self.dq_block_k == self.bwd_block_k and fuses_dq(self.dq_kernel)

    def fitted(self, seq_q: int, seq_k: int) -> "SageFwdConfig":
        """Shrink tiles for short sequences (never below 16 rows / 32 keys)."""
        bq = max(16, min(self.block_q, next_pow2(seq_q)))
        bk = max(32, min(self.block_k, next_pow2(seq_k)))
        if (bq, bk) == (self.block_q, self.block_k):
            return self
        return dataclasses.replace(self, block_q=bq, block_k=bk, bwd_block_q=min(self.bwd_block_q, bq),
                                   bwd_block_k=min(self.bwd_block_k, bk), dq_block_k=min(self.dq_block_k, bk))


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(0, (n - 1).bit_length())


def hopper(device_kind: str) -> bool:
    """Whether ``device_kind`` names a Hopper GPU (H100, H200, H800, H20, GH200): FP8 tensor cores and the Mosaic
    GPU kernels."""
    return re.search(r"\bG?H(100|200|800|20)\b", device_kind) is not None


def _measured_sage_fwd(head_dim: int, device_kind: str) -> SageFwdConfig:
    """The forward config up to head dim 128: the tiles measured best on the H200 (benchmarks/attention.py,
    attention_bwd.py), 64 × 128 forward tiles with 4 warps and 3 stages, 64 × 64 backward tiles, the dQ kernel with 3
    stages; the K/V quantize kernel with 8 warps above head dim 64, 4 at 64, on the H200 and the H100 (its 128 × 128
    tiles per program: with 4 warps, on the H100, it took 1.5× as long, 2.9× with the backward's K̂ᵀ). On Hopper P·V
    in e4m3 (``pv_format``; the Mosaic forward kernel measured 8–22% faster than with INT8 at head dims 64 and 128,
    within the accuracy gates), elsewhere INT8."""
    return SageFwdConfig(block_q=64, block_k=128, num_warps=4, num_stages=3, dq_stages=3,
                         kv_quant_warps=8 if head_dim > 64 else 4,
                         pv_format="e4m3" if hopper(device_kind) else "int8")


#: Per-device exceptions to the measured default, key (device_kind, head_dim, causal): none today, the H200 and the
#: H100 measured best with the same values (:func:`_measured_sage_fwd`).
TUNED_SAGE_FWD: dict[tuple[str, int, bool], SageFwdConfig] = {}


def sage_fwd_config(head_dim: int, causal: bool, device_kind: str | None = None) -> SageFwdConfig:
    """The forward config for a head dim and masking, tuned where measured.

    Args:
      head_dim: D.
      causal: whether the causal mask is on.
      device_kind: ``jax.devices()[0].device_kind`` to look up tuned values;
        None uses the default device.
    Returns:
      A :class:`SageFwdConfig`; apply :meth:`SageFwdConfig.fitted` for short inputs.
    """
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    tuned = TUNED_SAGE_FWD.get((device_kind, head_dim, causal))
    if tuned is not None:
        return tuned
    if head_dim <= 128:
        return _measured_sage_fwd(head_dim, device_kind)
    return SageFwdConfig(block_q=64, block_k=64, num_warps=8, num_stages=2)


@dataclasses.dataclass(frozen=True)
class QatConfig:
    """Tiles and backends of the Attn-QAT (NVFP4 fake-quant) kernels.

    ``block_k`` is part of the forward's numerics: P̃ is fake-quantized per key tile, normalized by the running row
    max at that tile (as the kernel does). The backward's FQ(P) uses the final log-sum-exp and does not depend on
    tiles.

    Attributes:
      block_q, block_k: forward tiles (block_k a multiple of 16, the FP4 group).
      num_warps, num_stages: forward launch parameters.
      bwd_block_q, bwd_block_k, bwd_warps, bwd_stages: backward tiles/launch.
      quant_block, quant_warps: rows per program of the fused Q/K/V fake-quant kernel.
      fwd_backend: the forward kernel's backend: "triton", "mosaic" (Pallas Mosaic GPU, Hopper:
        ``pallas_kernels.qat_fwd_mosaic``; calls it does not cover run on Triton) or "auto" (default): Mosaic on
        an sm_90 GPU unless interpreting, else Triton.
      bwd_backend: the same choice for the two backward kernels (``pallas_kernels.qat_bwd_mosaic``).
      pingpong: the Mosaic forward's two compute warpgroups take turns on the tensor cores (FlashAttention-3's
        ping-pong, ``_mosaic.PingPong``): one's softmax/FQ(P) overlaps the other's products. Scheduling only;
        the values are the same. The backward kernels do not take it (it made them slower); the forward that
        returns O only runs three warpgroups without it at head dim 64, non-causal.
      dq_kernel: how the Mosaic backward computes dQ: "separate" (a second kernel recomputing S, P and dP per
        query tile; deterministic), "fused" (the dK/dV kernel also reduce-adds each step's dS·K̃ into a float32
        dQ with TMA, as FlashAttention-3 does — at head dim 128 split by columns between its two warpgroups;
        dQ's summation order varies run to run, and it takes a float32 (B, Sq, Hq, D) buffer) or "auto"
        (default): fused everywhere (faster at every measured shape).
      dq_stage_order: the fused dQ's float32 stage column order, as ``SageFwdConfig.dq_stage_order``.
    """

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 2
    quant_block: int = 64
    quant_warps: int = 4
    fwd_backend: str = "auto"
    bwd_backend: str = "auto"
    pingpong: bool = True
    dq_kernel: str = "auto"
    dq_stage_order: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.pingpong, bool):
            raise TypeError(f"QatConfig.pingpong must be a bool, got {self.pingpong!r}")
        if self.dq_kernel not in DQ_KERNELS:
            raise ValueError(f"QatConfig.dq_kernel must be one of {DQ_KERNELS}, got {self.dq_kernel!r}")
        if self.dq_stage_order not in DQ_STAGE_ORDERS:
            raise ValueError(f"QatConfig.dq_stage_order must be one of {DQ_STAGE_ORDERS}, "
                             f"got {self.dq_stage_order!r}")
        for name in ("fwd_backend", "bwd_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"QatConfig.{name} must be one of {BACKENDS}, got {getattr(self, name)!r}")
        for name in ("block_q", "block_k", "num_warps", "bwd_block_q", "bwd_block_k", "bwd_warps", "quant_block",
                     "quant_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not _is_pow2(value):
                raise ValueError(f"QatConfig.{name} must be a power of two, got {value!r}")
        for name in ("block_q", "bwd_block_q", "quant_block"):
            if getattr(self, name) < 16:
                raise ValueError(f"QatConfig.{name} must be >= 16, got {getattr(self, name)}")
        for name in ("block_k", "bwd_block_k"):
            if getattr(self, name) < 32:
                raise ValueError(f"QatConfig.{name} must be >= 32 (two FP4 groups), got {getattr(self, name)}")
        if self.num_stages < 1 or self.bwd_stages < 1:
            raise ValueError(f"QatConfig stages must be >= 1, got {self.num_stages}, {self.bwd_stages}")

    def with_backends(self, hopper: bool) -> "QatConfig":
        """"auto" backends resolved: Mosaic if ``hopper`` (an sm_90 GPU, compiled), else Triton."""
        pick = lambda b: ("mosaic" if hopper else "triton") if b == "auto" else b  # noqa: E731
        return dataclasses.replace(self, fwd_backend=pick(self.fwd_backend), bwd_backend=pick(self.bwd_backend))

    def fuses_dq(self, head_dim: int, causal: bool) -> bool:
        """Whether the Mosaic backward computes dQ inside the dK/dV kernel (``dq_kernel``; "auto": at every head
        dim, causal or not)."""
        del head_dim, causal
        return fuses_dq(self.dq_kernel)

    @property
    def pad(self) -> int:
        """Sequence padding of the fake-quantized operands: a multiple of every tile (resolve "auto"
        backends with :meth:`with_backends` first; "auto" pads as "mosaic" would)."""
        mosaic_rows = 128 if {"mosaic", "auto"} & {self.fwd_backend, self.bwd_backend} else 0  # two 64-row WGs
        return max(self.block_q, self.block_k, self.bwd_block_q, self.bwd_block_k, self.quant_block, mosaic_rows)

    def fitted(self, seq_q: int, seq_k: int) -> "QatConfig":
        """Shrink tiles for short sequences (never below 16 rows / 32 keys)."""
        fq = lambda b: max(16, min(b, next_pow2(seq_q)))  # noqa: E731
        fk = lambda b: max(32, min(b, next_pow2(seq_k)))  # noqa: E731
        fs = lambda b: max(16, min(b, next_pow2(max(seq_q, seq_k))))  # noqa: E731
        return dataclasses.replace(self, block_q=fq(self.block_q), block_k=fk(self.block_k),
                                   bwd_block_q=fq(self.bwd_block_q), bwd_block_k=fk(self.bwd_block_k),
                                   quant_block=fs(self.quant_block))


# Attn-QAT on the tuned devices: 128-key forward steps (the Mosaic forward about 12% faster than with 64 on the H200,
# 5-13% on the H100). The Triton forward is slower with 128 keys, so QatConfig's default stays 64 (other devices);
# there the few calls the Mosaic kernels do not cover run the Triton forward with these tiles. block_k is part of the
# numerics (P̃ relative to the running max of each key tile), so both implementations ("pallas", "xla") resolve the
# same tuned config; accuracy against exact attention is the same for 64 and 128.
TUNED_QAT: dict[tuple[str, int, bool], QatConfig] = {
    (kind, d, c): QatConfig(block_k=128)
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3") for d in (64, 128) for c in (False, True)
}


def qat_config(head_dim: int, causal: bool, device_kind: str | None = None) -> QatConfig:
    """The Attn-QAT config for a head dim and masking: :data:`TUNED_QAT`'s where measured (128-key forward
    tiles), else :class:`QatConfig`'s defaults. ``lb.qat_attention`` without ``config`` takes it for the
    default device, for every implementation, so "pallas" and "xla" quantize P̃ alike there.

    Args:
      head_dim: D.
      causal: whether the causal mask is on.
      device_kind: ``jax.devices()[0].device_kind`` to look up tuned values; None uses the default device.
    Returns:
      A :class:`QatConfig`; apply :meth:`QatConfig.fitted` for short inputs.
    """
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    return TUNED_QAT.get((device_kind, head_dim, causal), QatConfig())


#: the decode's split-KV grid: about this many programs (a few per SM of an H100/H200), at least this many key blocks
#: a run, and a 16-bit key block's bytes over a 4-bit one's (2 bytes a value against 0.5 + 1/16)
DECODE_PROGRAMS = 1024
DECODE_MIN_BLOCKS = 4
DECODE_BYTES_RATIO = 2 / (0.5 + 1 / 16)
#: ThriftConfig fields whose None is resolved per call
_BY_CALL = ("decode_warps", "decode_splits", "decode_splits_high")


def _floor_pow2(n: int) -> int:
    """The largest power of two ≤ n (n ≥ 1)."""
    return 1 << (n.bit_length() - 1)


def _round_pow2(x: float) -> int:
    """The power of two nearest x on a log scale (1 for x ≤ 1)."""
    return 1 << max(0, round(math.log2(x))) if x > 1 else 1


@dataclasses.dataclass(frozen=True)
class ThriftConfig:
    """Blocks and launch parameters of the ThriftAttention kernels (docs/spec.md, ThriftAttention).

    ``block`` and ``decode_splits`` are part of the numerics: the selection scores blocks of ``block``
    queries and keys, FQ(P) is taken relative to the running row max at each key block, and the decode
    kernel's online softmax restarts in each of its ``decode_splits`` runs of 4-bit blocks. Both
    implementations ("pallas" and "xla") therefore take the same config, with the decode's ``None`` fields
    resolved by :meth:`for_decode` from the call's shape.

    Attributes:
      block: queries and keys per selection block, also the prefill kernel's query and key tile (32, 64 or
        128; the paper's 64). The decode cache's blocks (and its 4-bit V packing, two halves of whole FP4
        groups) use it too.
      num_warps, num_stages: the prefill kernel's Triton launch parameters.
      quant_block, quant_warps: rows per program and warps of the operand pass (NVFP4-fake-quantized K, V,
        head-major).
      select_rows: query blocks per program of the selection kernel (≥ 16: a tensor-core product).
      select_chunk: key blocks scored per step of the selection kernel (a power of two ≥ 16) for rows longer
        than ``select_whole``: their scores are recomputed in each of the 33 bisection passes.
      select_whole: rows of up to this many key blocks (rounded up to a power of two) are scored in one piece,
        once, and kept in registers (a quarter faster on long rows; wider pieces recomputed per pass spill).
      select_warps: warps of the selection kernel.
      prefill_chunk: query blocks per selection + prefill call of a long prefill (a power of two, a multiple of
        ``select_rows``): the selection and the block order live one chunk at a time, (chunk × key blocks)
        instead of (query blocks × key blocks). Not numerics: every chunking gives the same output.
      decode_splits: runs of 4-bit key blocks of the split-KV decode kernel (flash-decoding), combined at the
        end with the ``decode_splits_high`` runs of 16-bit blocks (which change only the summation order).
        ``None`` (default): enough runs to fill a GPU at the call's batch, heads and cache size
        (:meth:`for_decode`), so the outputs depend on the batch size and cache capacity at FP4-rounding level;
        set both for outputs that do not.
      decode_warps, decode_stages: the decode kernel's launch parameters; ``None`` (default) picks them by its
        query rows per program (:meth:`decode_launch`).
      decode_backend: the kernel of the decode's 4-bit runs: "mosaic" (Pallas Mosaic GPU, Hopper:
        ``pallas_kernels.thrift_decode_mosaic``; the Triton kernel keeps the 16-bit runs), "triton" (one Triton
        kernel for both), or "auto" (Mosaic where it runs compiled on an sm_90 GPU and covers the call). Not
        numerics: both give the same partial softmaxes up to float rounding.
      decode_compute_wgs: compute warpgroups a CTA of the Mosaic decode kernel: 1 (default), each CTA one
        warpgroup that streams its own run of 4-bit blocks; 2 or 4, as many consecutive runs a CTA, one a compute
        warpgroup, fed by a producer warpgroup that issues every copy (warp specialisation; where
        ``decode_splits`` is not a multiple, 1). Not numerics.
    """

    block: int = 64
    num_warps: int = 4
    num_stages: int = 2
    quant_block: int = 64
    quant_warps: int = 4
    select_rows: int = 16
    select_chunk: int = 128
    select_whole: int = 1024
    select_warps: int = 4
    prefill_chunk: int = 256
    decode_splits: int | None = None
    decode_splits_high: int | None = None
    decode_warps: int | None = None
    decode_stages: int | None = None
    decode_backend: str = "auto"
    decode_compute_wgs: int = 1

    def __post_init__(self) -> None:
        if self.decode_compute_wgs not in (1, 2, 4) or isinstance(self.decode_compute_wgs, bool):
            raise ValueError(f"ThriftConfig.decode_compute_wgs must be 1, 2 or 4, got {self.decode_compute_wgs!r}")
        for name in ("block", "num_warps", "quant_block", "quant_warps", "select_rows", "select_chunk",
                     "select_whole", "select_warps", "prefill_chunk", "decode_splits", "decode_splits_high",
                     "decode_warps"):
            value = getattr(self, name)
            if value is None and name in _BY_CALL:  # None: picked per call (decode_launch, for_decode)
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not _is_pow2(value):
                raise ValueError(f"ThriftConfig.{name} must be a power of two, got {value!r}")
        if not 32 <= self.block <= 128:
            raise ValueError(f"ThriftConfig.block must be 32, 64 or 128 (two halves of whole FP4 groups), got "
                             f"{self.block}")
        if self.quant_block < 16 or self.quant_block % 16:
            raise ValueError(f"ThriftConfig.quant_block must be >= 16, got {self.quant_block}")
        if self.select_rows < 16 or self.select_chunk < 16:
            raise ValueError(f"ThriftConfig.select_rows and select_chunk must be >= 16, got {self.select_rows}, "
                             f"{self.select_chunk}")
        if self.prefill_chunk < self.select_rows:
            raise ValueError(f"ThriftConfig.prefill_chunk ({self.prefill_chunk}) must be a multiple of select_rows "
                             f"({self.select_rows})")
        if self.decode_backend not in BACKENDS:
            raise ValueError(f"ThriftConfig.decode_backend must be one of {BACKENDS}, got {self.decode_backend!r}")
        stages = 1 if self.decode_stages is None else self.decode_stages  # None: by the rows per program
        for name, value in (("num_stages", self.num_stages), ("decode_stages", stages)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ThriftConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")

    def decode_launch(self, row_tile: int) -> tuple[int, int]:
        """(warps, stages) of the decode kernel for ``row_tile`` query rows per program: the fields where set, else
        the measured best by rows: 2 warps and 2 stages for 16 rows (one to four tokens of a group of 4), 4 and 3
        for more (16 rows with 4 warps were about 25% slower, 64 rows with 2 more than twice as slow). Launch
        parameters are not numerics."""
        warps, stages = (2, 2) if row_tile <= 16 else (4, 3)
        return (warps if self.decode_warps is None else self.decode_warps,
                stages if self.decode_stages is None else self.decode_stages)

    def for_decode(self, *, batch: int, kv_heads: int, head_rows: int, max_blocks: int, budget: float,
                   high_launch: bool = False) -> "ThriftConfig":
        """This config with ``decode_splits`` and ``decode_splits_high`` set for one decode call.

        Fields already set are kept. Unset, as powers of two: about :data:`DECODE_PROGRAMS` programs in all, at
        least :data:`DECODE_MIN_BLOCKS` key blocks of the cache's ``max_blocks`` each, shared between the 4-bit and
        the 16-bit runs by the bytes the ``budget`` makes them read (a 16-bit block has 3.56× a 4-bit block's
        bytes). ``high_launch``: the 16-bit runs have a launch of their own (the Mosaic kernel takes the 4-bit ones),
        so they fill the GPU alone: up to :data:`DECODE_PROGRAMS` programs of one or two 16-bit blocks at the cache's
        capacity. ``head_rows``: the query rows per kv head (tokens × group).
        """
        if self.decode_splits is not None and self.decode_splits_high is not None:
            return self
        per_split = batch * kv_heads * -(-head_rows // 64)  # programs per split: one per 64-row tile
        fill = max(DECODE_PROGRAMS // per_split, 1)
        total = _floor_pow2(min(max(fill, 2), max(max_blocks // DECODE_MIN_BLOCKS, 2)))
        high_share = budget * DECODE_BYTES_RATIO / (budget * DECODE_BYTES_RATIO + (1.0 - budget))
        shared = min(_round_pow2(total * high_share), total)
        low = self.decode_splits or _round_pow2(total - (self.decode_splits_high or shared))
        own = _floor_pow2(min(max(round(budget * max_blocks), 1), fill))
        high = self.decode_splits_high or (own if high_launch else shared)
        return dataclasses.replace(self, decode_splits=low, decode_splits_high=high)

    def split_counts(self) -> tuple[int, int]:
        """(``decode_splits``, ``decode_splits_high``) of a config :meth:`for_decode` has resolved; ValueError if
        either is still None (the decode kernel and its reference need the numbers)."""
        if self.decode_splits is None or self.decode_splits_high is None:
            raise ValueError("the decode takes a config with decode_splits and decode_splits_high set "
                             "(ThriftConfig.for_decode)")
        return self.decode_splits, self.decode_splits_high

    @property
    def pad(self) -> int:
        """Sequence padding of the head-major operands: a multiple of the block and of the quantize pass."""
        return max(self.block, self.quant_block)
