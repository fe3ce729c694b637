"""ThriftAttention: training-free FP4/16-bit mixed-precision attention for long-context inference.

Paper: ThriftAttention (Sharratt, 2026, arXiv 2605.23081). shared/SPEC.md §3 is the contract; the exact
rules (selection, budget, block order, FP4 groups) are in :mod:`lowbit_jax.thrift_reference`.

* **Selection** (:func:`thrift_select`): block means q̄ (per query block) and k̄ (per key block) of
  ``config.block`` = 64 tokens, importance q̄_i·k̄_j, and for each query block the top k key blocks,
  k from the budget f (default 0.05; causal: the selected pairs ≈ f × the causal pairs). One fused
  Pallas kernel scores and selects (:mod:`pallas_kernels.thrift_select`).
* **Prefill** (:func:`thrift_attention`): the selected pairs in 16-bit, the rest in NVFP4 (Q̃, K̃ per token
  along D, Ṽ along tokens, FQ(P) per 16 keys by its amax), one online softmax, one output
  (:mod:`pallas_kernels.thrift_prefill`). f = 1 is 16-bit flash attention; f = 0 uniform FP4. Selection and
  prefill run ``config.prefill_chunk`` query blocks at a time, so their scratch grows as S·chunk, not S².
* **Decode** (:func:`thrift_decode` with a :class:`lowbit_jax.ThriftKVCache`): per kv head the complete
  cached blocks with the largest max-over-heads q·k̄ are read from the 16-bit cache, the rest (and the
  trailing partial block) from the 4-bit one; split-KV with a combine step (:mod:`pallas_kernels.thrift_decode`).

Differentiable: the gradient of :func:`thrift_attention` is the exact attention gradient with respect to
the 16-bit inputs (straight-through: the method is training-free, the gradient is for fine-tuning or
probing through it; it materializes the (Sq × Sk) scores, so it is meant for moderate lengths).
The H200 has no FP4 tensor cores: FP4 is emulated with 16-bit products on exactly representable values, so
prefill runs below 16-bit speed there; decode reads 3.5× fewer bytes per 4-bit block, but decoding them in
registers costs more than that saves (on the H200 the decode kernel's 16-bit path is faster than its 4-bit
one; both beat XLA's bf16 decode: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax._x32 import x32
from lowbit_jax import _checks
from lowbit_jax.formats import nvfp4
from lowbit_jax.qat_reference import mma_dtype, padded
from lowbit_jax.reference import reference_attention
from lowbit_jax.thrift_cache import ThriftKVCache
from lowbit_jax.thrift_reference import (
    block_means,
    block_order,
    check_key_blocks,
    combine_splits,
    decode_budget,
    decode_outputs,
    decode_reference,
    decode_rows,
    decode_scores,
    decode_selection,
    decode_top_blocks,
    fake_quant_operand,
    prefill_reference,
    row_positions,
    selection_reference,
    topk_count,
    valid_key_blocks,
)
from pallas_kernels import fake_quant as fake_quant_kernels
from pallas_kernels import thrift_decode as thrift_decode_kernels
from pallas_kernels import thrift_prefill as thrift_prefill_kernels
from pallas_kernels import thrift_select as thrift_select_kernels
from pallas_kernels.configs import ThriftConfig, next_pow2

#: most query rows (query heads of a kv group × new tokens) one :func:`thrift_decode` call takes
MAX_DECODE_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class ThriftOptions:
    """Resolved, hashable options (static under jit and custom_vjp)."""

    causal: bool
    scale: float
    budget: float
    topk: int
    implementation: str
    interpret: bool
    config: ThriftConfig
    seq_q: int
    seq_k: int


def check_budget(budget) -> float:
    """The budget f: a Python number in [0, 1]."""
    if isinstance(budget, jax.core.Tracer):
        raise TypeError("budget must be a static Python number, not a traced value")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise TypeError(f"budget must be a number in [0, 1], got {type(budget).__name__}")
    value = float(budget)
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"budget must be in [0, 1] (the fraction of block pairs in 16-bit), got {budget!r}")
    return value


def _check_config(config) -> ThriftConfig:
    if config is None:
        return ThriftConfig()
    if not isinstance(config, ThriftConfig):
        raise TypeError(f"config must be a ThriftConfig, got {type(config).__name__}")
    return config


def resolve_thrift_options(q, k, v, *, causal=False, scale=None, budget=0.05, implementation=None, interpret=False,
                           config=None) -> ThriftOptions:
    """Validate eagerly (shapes, dtypes, options) and resolve defaults into static options."""
    shape = _checks.check_qkv(q, k, v)
    causal = _checks.check_bool("causal", causal)
    interpret = _checks.check_bool("interpret", interpret)
    scale = _checks.check_scale(scale, shape.head_dim)
    budget = check_budget(budget)
    impl = _checks.check_implementation(implementation, interpret)
    config = _check_config(config)
    check_key_blocks(shape.seq_k, config.block, "the key length")
    counts = valid_key_blocks(shape.seq_q, shape.seq_k, config.block, causal)
    return ThriftOptions(causal=causal, scale=scale, budget=budget, topk=topk_count(budget, counts, causal),
                         implementation=impl, interpret=interpret, config=config, seq_q=shape.seq_q,
                         seq_k=shape.seq_k)


# ----------------------------------------------------------------------------- selection


def _selection(q: jax.Array, k: jax.Array, opts: ThriftOptions) -> jax.Array:
    """The 16-bit pairs: bool (B, Hq, Nqb, Nkb) (xla) or int8 (B, Hq, Nqb_pad, Nkb_pad) (pallas)."""
    cfg = opts.config
    qm, km = block_means(q, cfg.block), block_means(k, cfg.block)
    if opts.implementation != "pallas":
        counts = valid_key_blocks(opts.seq_q, opts.seq_k, cfg.block, opts.causal)
        return selection_reference(qm, km, counts, opts.topk)
    return _select_kernel(_pad_blocks(qm, padded(qm.shape[2], cfg.select_rows)), _select_keys(km, cfg), 0, opts)


def _pad_blocks(x: jax.Array, n: int) -> jax.Array:
    """(B, H, N, D) block means with zero rows appended up to ``n``."""
    return jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)))


def _select_keys(k_mean: jax.Array, cfg: ThriftConfig) -> jax.Array:
    """Key-block means padded to the selection kernel's scoring chunk."""
    return _pad_blocks(k_mean, padded(k_mean.shape[2], _select_chunk(k_mean.shape[2], cfg)))


def _select_chunk(n_key_blocks: int, cfg: ThriftConfig) -> int:
    """Key blocks per scoring step: the whole row if it fits ``select_whole`` (scored once), else ``select_chunk``."""
    whole = max(16, next_pow2(n_key_blocks))
    return whole if whole <= cfg.select_whole else cfg.select_chunk


def _select_kernel(q_mean: jax.Array, k_mean: jax.Array, first_block, opts: ThriftOptions) -> jax.Array:
    """The selection kernel on query-block means from ``first_block`` on: int8 (B, Hq, Nq, Nkb_pad)."""
    cfg = opts.config
    return thrift_select_kernels.thrift_select(
        q_mean, k_mean, first_block, block=cfg.block, sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal,
        k=opts.topk, rows=cfg.select_rows, chunk=_select_chunk(k_mean.shape[2], cfg), num_warps=cfg.select_warps,
        interpret=opts.interpret)


@x32
def thrift_select(q: jax.Array, k: jax.Array, *, causal: bool = False, budget: float = 0.05,
                  implementation: Literal["pallas", "xla"] | None = None, interpret: bool = False,
                  config: ThriftConfig | None = None) -> jax.Array:
    """Which (query block, key block) pairs ThriftAttention runs in 16-bit.

    Args:
      q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D) (bf16/fp16/fp32; Hq a multiple of Hkv).
      causal: bottom-right aligned mask (blocks beyond the diagonal are never selected).
      budget: f in [0, 1]: non-causal ``max(1, round(f·N_kb))`` blocks per query block; causal the
        selected pairs ≈ f × the causal pairs (:func:`lowbit_jax.thrift_reference.topk_count`).
      implementation, interpret: as :func:`thrift_attention`. config: ``block`` sets the block size.
    Returns:
      bool (B, Hq, ceil(Sq/block), ceil(Sk/block)).
    """
    opts = resolve_thrift_options(q, k, k, causal=causal, budget=budget, implementation=implementation,
                                  interpret=interpret, config=config)
    sel = _selection(q, k, opts)
    nqb, nkb = -(-opts.seq_q // opts.config.block), -(-opts.seq_k // opts.config.block)
    return sel[:, :, :nqb, :nkb].astype(jnp.bool_)


# ----------------------------------------------------------------------------- prefill


@x32
def thrift_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    budget: float = 0.05,
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: ThriftConfig | None = None,
) -> jax.Array:
    """ThriftAttention: the most important block pairs in 16-bit, the rest in NVFP4, one softmax.

    Layout as ``jax.nn.dot_product_attention``; GQA/MQA: Hq a multiple of Hkv.

    Args:
      q: (B, Sq, Hq, D) bfloat16, float16 or float32.
      k, v: (B, Sk, Hkv, D), q's dtype. D in {32, 64, 128, 256}; any Sq, Sk ≥ 1.
      causal: causal mask, bottom-right aligned when Sq ≠ Sk (as :func:`lowbit_jax.sage_attention`).
        Rows that see no key give zeros.
      scale: softmax scale, default D**-0.5.
      budget: f in [0, 1], the fraction of block pairs in 16-bit (SPEC's evaluated budgets: 0.05, 0.10,
        0.25); 1 gives 16-bit attention, 0 uniform NVFP4.
      implementation: "pallas" (the Triton kernels; on CPU only with ``interpret=True``), "xla" (the
        pure-JAX twin with the same quantization and block order), or None: pallas on GPU, xla elsewhere.
      interpret: run the Pallas kernels in interpret mode.
      config: :class:`ThriftConfig` (``block`` is part of the numerics).
    Returns:
      (B, Sq, Hq, D) in q's dtype. The products run in bfloat16 (float16 for float16 inputs) with fp32
      accumulation. Its gradient is exact attention's (straight-through; see the module docstring).
    Raises:
      ValueError / TypeError on bad shapes, dtypes or options (before compiling).
    """
    opts = resolve_thrift_options(q, k, v, causal=causal, scale=scale, budget=budget, implementation=implementation,
                                  interpret=interpret, config=config)
    return _thrift_attention(q, k, v, opts)


def operands(k: jax.Array, v: jax.Array, opts: ThriftOptions) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The prefill's key and value operands, by the implementation ``opts`` names.

    Returns:
      (k, v, k̃, ṽ): k and v as given, (B, Sk_pad, Hkv, D), zero rows appended only where Sk is not a multiple
      of the padding (so no copy otherwise: the kernel reads their 16-bit blocks in place); k̃, ṽ their NVFP4
      fake quantization, (B, Hkv, Sk_pad, D) in the 16-bit operand dtype (groups of 16 channels for K, of 16
      tokens for V).
    """
    cfg = opts.config
    dt = mma_dtype(k.dtype)
    seq_pad = padded(opts.seq_k, cfg.pad)
    pad = lambda x: x if seq_pad == x.shape[1] else jnp.pad(  # noqa: E731
        x, ((0, 0), (0, seq_pad - x.shape[1]), (0, 0), (0, 0)))
    if opts.implementation != "pallas":
        fq = lambda x, along: fake_quant_operand(x, seq_pad=seq_pad, along=along, dtype=dt)  # noqa: E731
    else:
        fq = lambda x, along: fake_quant_kernels.fp4_fake_quant_heads(  # noqa: E731
            x, seq_pad=seq_pad, block=cfg.quant_block, out_dtype=dt, along=along, num_warps=cfg.quant_warps,
            interpret=opts.interpret)
    return pad(k), pad(v), fq(k, "channels"), fq(v, "tokens")


@functools.partial(jax.jit, static_argnames=("opts",))
def thrift_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, opts: ThriftOptions) -> jax.Array:
    """The forward on validated inputs (selection, operand pass, attention); (B, Sq, Hq, D) in q's dtype."""
    ops = operands(k, v, opts)
    if opts.implementation != "pallas":
        return prefill_reference(q, *ops, _selection(q, k, opts), sq_len=opts.seq_q, sk_len=opts.seq_k,
                                 causal=opts.causal, scale=opts.scale, config=opts.config, out_dtype=q.dtype)
    return _prefill_kernels(q, k, ops, opts)


def _prefill_kernels(q: jax.Array, k: jax.Array, ops: tuple, opts: ThriftOptions) -> jax.Array:
    """Selection, block order and prefill kernel, ``config.prefill_chunk`` query blocks at a time.

    The selection and order of a chunk are (chunk × Nkb), so a long prefill's scratch grows as S·chunk,
    not S². Each chunk's result is what one call over all blocks gives (a query block's selection, order
    and output depend on that block alone); the chunks run in a ``fori_loop`` (one compiled kernel for
    all, the traced first block passed in) plus one call for the remainder.
    """
    cfg = opts.config
    bk, chunk = cfg.block, cfg.prefill_chunk
    nqb = -(-opts.seq_q // bk)
    n_full, rest = divmod(nqb, chunk)
    rows = lambda n: padded(n, cfg.select_rows)  # noqa: E731  (the selection kernel's rows per program)
    qm = block_means(q, bk)
    qm = _pad_blocks(qm, n_full * chunk + rows(rest))
    km = _select_keys(block_means(k, bk), cfg)
    q_rows = q if opts.seq_q == nqb * bk else jnp.pad(q, ((0, 0), (0, nqb * bk - opts.seq_q), (0, 0), (0, 0)))
    kw = dict(sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, scale=opts.scale, k=opts.topk,
              config=cfg, interpret=opts.interpret)

    def part(first, n, out):
        """Query blocks [first, first + n): select, order, attend (into ``out`` where given)."""
        sel = _select_kernel(jax.lax.dynamic_slice_in_dim(qm, first, rows(n), axis=2), km, first, opts)
        order = prefill_order(sel, opts, first)
        return thrift_prefill_kernels.thrift_prefill(q_rows, *ops, order, first, out, n_blocks=n, **kw)

    if n_full + (rest > 0) == 1:
        o = part(0, nqb, None)
    else:
        o = jax.lax.fori_loop(0, n_full, lambda c, o: part(c * chunk, chunk, o), jnp.zeros_like(q_rows))
        o = part(n_full * chunk, rest, o) if rest else o
    return o if o.shape[1] == opts.seq_q else o[:, :opts.seq_q]


def prefill_order(selected: jax.Array, opts: ThriftOptions, first_block: jax.Array | int = 0) -> jax.Array:
    """The prefill kernel's key-block order (:func:`lowbit_jax.thrift_reference.block_order`) from the selection
    kernel's int8 (B, Hq, Nq, Nkb_pad) for the query blocks from ``first_block`` on (may be traced): int16
    (B, Hq, Nq, next power of two ≥ Nkb)."""
    nq = selected.shape[2]
    counts = valid_key_blocks(opts.seq_q, opts.seq_k, opts.config.block, opts.causal)
    counts = jnp.asarray(np.pad(counts, (0, nq)))  # query blocks past the last: none (any first ≤ Nqb slices)
    counts = jax.lax.dynamic_slice_in_dim(counts, first_block, nq)
    nkb = -(-opts.seq_k // opts.config.block)
    width = next_pow2(nkb)  # the kernel loads a row of the order whole (a power of two)
    high = jnp.pad(selected[..., :nkb] != 0, ((0, 0), (0, 0), (0, 0), (0, width - nkb)))
    return block_order(high, counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _thrift_attention(q, k, v, opts: ThriftOptions):
    return thrift_forward(q, k, v, opts=opts)


def _thrift_fwd(q, k, v, opts: ThriftOptions):
    return thrift_forward(q, k, v, opts=opts), (q, k, v)


@x32
def _thrift_bwd(opts: ThriftOptions, residuals, do):
    q, k, v = residuals
    exact = functools.partial(reference_attention, causal=opts.causal, scale=opts.scale)
    _, vjp = jax.vjp(exact, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    return tuple(g.astype(x.dtype) for g, x in zip(vjp(do.astype(jnp.float32)), residuals))


_thrift_attention.defvjp(_thrift_fwd, _thrift_bwd)


# ----------------------------------------------------------------------------- decode


def _decode_layout(rows: int) -> tuple[int, int]:
    """(padded rows, rows per program) of a decode call with ``rows`` = group × tokens."""
    if rows <= 64:
        r = max(16, next_pow2(rows))
        return r, r
    return padded(rows, 64), 64


@x32
def thrift_decode(q: jax.Array, cache: ThriftKVCache, *, budget: float = 0.05, scale: float | None = None,
                  implementation: Literal["pallas", "xla"] | None = None, interpret: bool = False,
                  config: ThriftConfig | None = None) -> jax.Array:
    """Attend the newest T tokens to a :class:`ThriftKVCache` that already holds them (append first).

    Args:
      q: (B, T, Hq, D) the new tokens' queries (bf16/fp16/fp32), Hq a multiple of the cache's kv heads;
        token t sits at position ``cache.length − T + t`` and sees the keys up to it.
      cache: the cache after :meth:`ThriftKVCache.append` of the same T tokens.
      budget: f in [0, 1]: per kv head the ``round(f · n)`` of the n complete key blocks with the largest
        max-over-heads q·k̄ come from the 16-bit cache, the rest and the trailing partial block from the
        4-bit one (SPEC §3.4).
      scale: softmax scale, default D**-0.5. implementation, interpret: as :func:`thrift_attention`.
      config: ``block`` must equal ``cache.block``; ``decode_splits`` (key ranges) is part of the numerics.
    Returns:
      (B, T, Hq, D) in q's dtype.
    Raises:
      ValueError / TypeError on bad shapes or options, and, outside ``jit``, when the cache holds fewer than T
      tokens (an empty cache included: append the new tokens first). Under ``jit``, where the length is traced,
      such a call and one on an overflowed cache (:attr:`ThriftKVCache.overflowed`) return NaN everywhere.
    """
    if not isinstance(cache, ThriftKVCache):
        raise TypeError(f"cache must be a ThriftKVCache, got {type(cache).__name__}")
    _checks.check_array("q", q)
    b, t, hq, d = q.shape
    if t < 1:
        raise ValueError(f"q must hold at least one new token, got shape {tuple(q.shape)}")
    if (b, d) != (cache.k.shape[0], cache.head_dim):
        raise ValueError(f"q's batch and head_dim {(b, d)} must match the cache's {(cache.k.shape[0], cache.head_dim)}")
    if hq % cache.num_kv_heads:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of the cache's kv heads "
                         f"({cache.num_kv_heads})")
    rows = t * (hq // cache.num_kv_heads)
    if rows > MAX_DECODE_ROWS:
        raise ValueError(f"thrift_decode takes at most {MAX_DECODE_ROWS} query rows per kv head (tokens × group), "
                         f"got {rows}; prefill longer chunks with thrift_attention")
    scale = _checks.check_scale(scale, d)
    budget = check_budget(budget)
    impl = _checks.check_implementation(implementation, _checks.check_bool("interpret", interpret))
    config = _check_config(config)
    if config.block != cache.block:
        raise ValueError(f"config.block ({config.block}) must equal the cache's block ({cache.block})")
    if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) < t:
        raise ValueError(f"thrift_decode of {t} new token(s) on a cache holding {int(cache.length)}: append the new "
                         f"tokens' k and v to the cache first (ThriftKVCache.append)")
    return _decode(q, cache, budget=budget, scale=scale, implementation=impl, interpret=interpret, config=config)


@functools.partial(jax.jit, static_argnames=("budget", "scale", "implementation", "interpret", "config"))
def _decode(q, cache: ThriftKVCache, *, budget: float, scale: float, implementation: str, interpret: bool,
            config: ThriftConfig):
    o = _decode_values(q, cache, budget=budget, scale=scale, implementation=implementation, interpret=interpret,
                       config=config)
    usable = (cache.length >= q.shape[1]) & ~cache.overflow  # traced: NaN instead of values from a bad state
    return jnp.where(usable, o, jnp.nan).astype(o.dtype)


def _decode_values(q, cache: ThriftKVCache, *, budget: float, scale: float, implementation: str, interpret: bool,
                   config: ThriftConfig):
    if implementation != "pallas":
        sel = decode_selection(q, cache.k_mean, cache.length, budget=budget, block=config.block)
        return decode_reference(q, cache.k, cache.v, cache.k4, cache.k4_scale, cache.v4, cache.v4_scale, sel,
                                cache.length, scale=scale, config=config)
    t, hq = q.shape[1], q.shape[2]
    rows = t * (hq // cache.num_kv_heads)  # the kernel leaves the padding rows below r_pad unwritten
    r_pad, row_tile = _decode_layout(rows)
    order, n_high = decode_order(q, cache, budget=budget, block=config.block, interpret=interpret)
    acc, m, l = thrift_decode_kernels.thrift_decode(*decode_kernel_args(q, cache, order, n_high, r_pad), scale=scale,
                                                    config=config, row_tile=row_tile, rows=rows, interpret=interpret)
    return decode_outputs(combine_splits(acc[..., :rows, :], m[..., :rows], l[..., :rows]), t, hq).astype(q.dtype)


def decode_order(q: jax.Array, cache: ThriftKVCache, *, budget: float, block: int,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The decode kernel's key-block order and its 16-bit block count for the new tokens ``q`` (B, T, Hq, D).

    The selection (:func:`lowbit_jax.thrift_reference.decode_selection`) and its
    :func:`lowbit_jax.thrift_reference.block_order`, in the selection kernel
    :func:`pallas_kernels.thrift_select.thrift_decode_order` up to its
    :data:`~pallas_kernels.thrift_select.DECODE_ORDER_MAX_BLOCKS` key blocks, by XLA beyond (the same values).

    Returns:
      int16 (B, Hkv, Nkb_pad) the order (Nkb_pad: the cache's blocks up to a power of two), int32 (1,) the
      16-bit blocks per (batch, kv head).
    """
    scores = decode_scores(q, cache.k_mean)
    n_complete, take = decode_budget(cache.length, budget=budget, block=block)
    n_blocks = (cache.length + block - 1) // block
    nkb = scores.shape[-1]
    pad = ((0, 0), (0, 0), (0, next_pow2(nkb) - nkb))
    if next_pow2(nkb) <= thrift_select_kernels.DECODE_ORDER_MAX_BLOCKS:
        order = thrift_select_kernels.thrift_decode_order(jnp.pad(scores, pad), n_complete, take, n_blocks,
                                                          interpret=interpret)
    else:
        order = block_order(jnp.pad(decode_top_blocks(scores, n_complete, take), pad), n_blocks)
    return order, take[None]


def decode_kernel_args(q: jax.Array, cache: ThriftKVCache, order: jax.Array, n_high: jax.Array, r_pad: int) -> tuple:
    """The arguments of :func:`pallas_kernels.thrift_decode.thrift_decode` before its options: the query rows
    (16-bit and fake-quantized), their positions, the 16-bit block count and the order (:func:`decode_order`),
    the cache's arrays."""
    t, hq = q.shape[1], q.shape[2]
    group = hq // cache.num_kv_heads
    rows = decode_rows(q.astype(jnp.float32), cache.num_kv_heads, r_pad)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731
    return (rows.astype(mma_dtype(q.dtype)), nvfp4.fake_quant_last(rows).astype(jnp.float16),
            row_positions(cache.length, t, group, r_pad), n_high,
            cache.k, cache.v, cache.k4, bits(cache.k4_scale), cache.v4, bits(cache.v4_scale), order)


__all__ = ["MAX_DECODE_ROWS", "ThriftConfig", "ThriftKVCache", "ThriftOptions", "thrift_attention", "thrift_decode",
           "thrift_forward", "thrift_select"]

