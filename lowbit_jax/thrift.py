"""ThriftAttention: training-free FP4/16-bit mixed-precision attention for long-context inference.

Paper: ThriftAttention (Sharratt, 2026, arXiv 2605.23081). docs/spec.md, ThriftAttention is the contract; the exact
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
registers costs about what it saves (benchmarks/RESULTS.md has the decode against cuDNN's 16-bit one).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax import _checks
from lowbit_jax._x32 import x32
from lowbit_jax.qat_reference import mma_dtype, padded
from lowbit_jax.reference import reference_attention
from lowbit_jax.thrift_backends import ThriftOptions, implementation_for, mosaic_row_tile, takes_mosaic_decode
from lowbit_jax.thrift_cache import ThriftKVCache
from lowbit_jax.thrift_reference import check_key_blocks, topk_count, valid_key_blocks
from pallas_kernels.configs import ThriftConfig

#: most query rows (query heads of a kv group × new tokens) one :func:`thrift_decode` call takes
MAX_DECODE_ROWS = 1024


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
    return implementation_for(opts.implementation, opts.interpret).selection(q, k, opts)


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
      budget: f in [0, 1], the fraction of block pairs in 16-bit (the spec's evaluated budgets: 0.05, 0.10,
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
    impl = implementation_for(opts.implementation, opts.interpret)
    fq = lambda x, along: impl.fake_quant(x, seq_pad=seq_pad, along=along, dtype=dt, opts=opts)  # noqa: E731
    return pad(k), pad(v), fq(k, "channels"), fq(v, "tokens")


@functools.partial(jax.jit, static_argnames=("opts",))
def thrift_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, opts: ThriftOptions) -> jax.Array:
    """The forward on validated inputs (selection, operand pass, attention); (B, Sq, Hq, D) in q's dtype."""
    return implementation_for(opts.implementation, opts.interpret).prefill(q, k, operands(k, v, opts), opts)


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
        4-bit one (docs/spec.md, ThriftAttention).
      scale: softmax scale, default D**-0.5. implementation, interpret: as :func:`thrift_attention`.
      config: ``block`` must equal ``cache.block``; ``decode_splits`` (key ranges) is part of the numerics, and
        left ``None`` it is picked from the batch, the heads and the cache's capacity
        (:meth:`ThriftConfig.for_decode`).
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


def decode_config(q: jax.Array, cache: ThriftKVCache, *, budget: float, config: ThriftConfig,
                  interpret: bool = False) -> ThriftConfig:
    """``config`` with the decode's split counts resolved for new tokens ``q`` (B, T, Hq, D) over ``cache``
    (:meth:`ThriftConfig.for_decode`: by batch, kv heads, rows per kv head, the cache's capacity, and whether the
    16-bit runs get a launch of their own, :func:`lowbit_jax.thrift_backends.takes_mosaic_decode`; the XLA twin
    resolves the same counts as the kernels on the same machine)."""
    b, t, hq, d = q.shape
    rows = t * (hq // cache.num_kv_heads)
    high_launch = takes_mosaic_decode(config, head_dim=d, row_tile=mosaic_row_tile(rows), interpret=interpret)
    return config.for_decode(batch=b, kv_heads=cache.num_kv_heads, head_rows=rows,
                             max_blocks=cache.k.shape[1] // cache.block, budget=budget, high_launch=high_launch)


@functools.partial(jax.jit, static_argnames=("budget", "scale", "implementation", "interpret", "config"))
def _decode(q, cache: ThriftKVCache, *, budget: float, scale: float, implementation: str, interpret: bool,
            config: ThriftConfig):
    config = decode_config(q, cache, budget=budget, config=config, interpret=interpret)
    return implementation_for(implementation, interpret).decode(q, cache, budget=budget, scale=scale, config=config,
                                                                interpret=interpret)


__all__ = ["MAX_DECODE_ROWS", "ThriftConfig", "ThriftKVCache", "ThriftOptions", "decode_config", "thrift_attention",
           "thrift_decode", "thrift_forward", "thrift_select"]

