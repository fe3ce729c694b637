"""Flax NNX attention with a choice of low-bit attention method, QK-norm, RoPE, GQA, KV cache.

``method``:
* "dense" — ``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU for
  16-bit inputs (JAX's own default would be the XLA implementation), XLA elsewhere;
* "sage"  — :func:`lowbit_jax.sage_attention` (INT8 forward + SageBwd backward);
* "qat_fp4" — :func:`lowbit_jax.qat_attention` (NVFP4 fake quantization, Attn-QAT
  backward; ``attention_options={"naive_backward": True}`` for the ablation);
* "thrift" — :func:`lowbit_jax.thrift_attention` (training-free FP4/16-bit mixed precision for
  inference; ``attention_options={"budget": 0.1}`` sets the 16-bit budget). Its KV cache is a
  :class:`lowbit_jax.ThriftKVCache` (16-bit + NVFP4 + block means) and decoding runs
  :func:`lowbit_jax.thrift_decode`. Its gradient is exact attention's (straight-through); the training
  loop refuses it (train with another method, then serve with this one).
* "sparse" — :func:`lowbit_jax.block_sparse_attention`: the baseline ThriftAttention beats, the block pairs it
  would run in 16-bit and the rest dropped (``budget``, ``config`` options as thrift). An evaluation method of the
  full-sequence forward: its KV-cache paths refuse it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import lowbit_jax as lb
from lowbit_jax import cached_attention, dense_attention

METHODS = ("dense", "sage", "qat_fp4", "thrift", "sparse")
#: the methods whose attention takes QK-norm and RoPE as a prologue of its own kernels (``fuse_qk_prologue``)
FUSED_PROLOGUE_METHODS = ("sage", "qat_fp4")


def check_method(method: str) -> None:
    """Raise ``ValueError`` unless ``method`` is one of :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"attention method must be one of {METHODS}, got {method!r}")


def _check_room(length: jax.Array, t: int, max_len: int) -> None:
    """Outside ``jit`` (a concrete length): ``ValueError`` if T more tokens do not fit the cache."""
    if not isinstance(length, jax.core.Tracer) and int(length) + t > max_len:
        raise ValueError(f"{t} new token(s) after {int(length)} cached overflow the KV cache's {max_len} slots "
                         f"(the model's max_len)")


def _append_16bit(cache: dict, k: jax.Array, v: jax.Array) -> dict:
    """The 16-bit cache dict with T new tokens' k, v (B, T, Hkv, D) written at its length. If they do not fit
    (possible only under ``jit``, where the length is traced) nothing is written, the length stays and
    ``overflow`` is set, as :meth:`lowbit_jax.ThriftKVCache.append` does."""
    t, start = k.shape[1], cache["length"]
    _check_room(start, t, cache["k"].shape[1])
    fits = start + t <= cache["k"].shape[1]
    at = (0, start, 0, 0)

    def put(x, update):  # the old values written back when it does not fit: a select of the update's size
        return jax.lax.dynamic_update_slice(
            x, jnp.where(fits, update.astype(x.dtype), jax.lax.dynamic_slice(x, at, update.shape)), at)

    return {"k": put(cache["k"], k), "v": put(cache["v"], v), "length": jnp.where(fits, start + t, start),
            "overflow": cache["overflow"] | ~fits}


def rope(x: jax.Array, positions: jax.Array, base: float,
         freq_factors: tuple[float, ...] | None = None) -> jax.Array:
    """Rotary embedding (rotate-half form; the tables of :func:`lowbit_jax.rope_tables`).

    Args:
      x: (B, S, H, D).
      positions: int (B, S) or (S,).
      freq_factors: None or D/2 divisors of the inverse frequencies (Llama-3 rope scaling).
    Returns:
      x's shape and dtype.
    """
    cos, sin = lb.rope_tables(positions, x.shape[-1], base, freq_factors)  # (..., S, D/2)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    z1, z2 = lb.formats.qk_prologue.rotate(x1, x2, cos[:, :, None, :], sin[:, :, None, :])
    return jnp.concatenate([z1, z2], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head attention (GQA) with QK-norm and RoPE.

    Args:
      dim: model width. num_heads, num_kv_heads: query and key/value heads
        (num_heads a multiple of num_kv_heads); head dim ``head_dim`` (default dim // num_heads).
      qkv_bias: biases on the q, k and v projections (Qwen2). norm_eps: QK-norm's epsilon.
      rope_freq_factors: None or D/2 divisors of RoPE's inverse frequencies (Llama-3 rope scaling).
      method: see the module docstring.
      qk_norm: per-head RMSNorm of q and k with a learnable scale (on by default;
        it keeps the INT8 backward's dS error bounded at large tokens-per-step).
      smooth_k: K-smoothing in the sage kernels.
      fuse_qk_prologue: with method "sage" or "qat_fp4", hand q and k to :func:`lowbit_jax.sage_attention` /
        :func:`lowbit_jax.qat_attention` before their QK-norm and RoPE, with a :class:`lowbit_jax.QKPrologue`: the
        norm and rotation then run inside its quantize (or fake-quantize) kernels and their backward in one Triton
        pass (the same values as this module's own norm and rope; saves XLA's passes over q and k).
      causal: causal mask.
      attention_options: extra keyword options for the attention function
        (e.g. ``implementation``, ``interpret``, ``config``; ``naive_backward``
        for qat_fp4).
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, *, method: str = "sage", qk_norm: bool = True,
                 smooth_k: bool = True, causal: bool = True, rope_base: float = 10000.0,
                 dtype: Any = jnp.bfloat16, attention_options: dict | None = None, fuse_qk_prologue: bool = True,
                 head_dim: int | None = None, qkv_bias: bool = False, norm_eps: float = 1e-6,
                 rope_freq_factors: tuple[float, ...] | None = None, rngs: nnx.Rngs):
        check_method(method)
        if num_heads % num_kv_heads or (head_dim is None and dim % num_heads):
            raise ValueError(f"num_heads ({num_heads}) must divide dim ({dim}) unless head_dim is given, and be a "
                             f"multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim if head_dim is not None else dim // num_heads
        self.method, self.causal, self.smooth_k, self.rope_base = method, causal, smooth_k, rope_base
        self.rope_freq_factors = None if rope_freq_factors is None else tuple(rope_freq_factors)
        self.fuse_qk_prologue, self.dtype = fuse_qk_prologue, dtype
        self.attention_options = dict(attention_options or {})
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        biased = functools.partial(nnx.Linear, use_bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.q_proj = biased(dim, num_heads * self.head_dim)
        self.k_proj = biased(dim, num_kv_heads * self.head_dim)
        self.v_proj = biased(dim, num_kv_heads * self.head_dim)
        self.o_proj = linear(num_heads * self.head_dim, dim)
        norm = functools.partial(nnx.RMSNorm, self.head_dim, epsilon=norm_eps, dtype=dtype, rngs=rngs)
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None

    def _projections(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        return q, k, v

    def _prologue(self, s: int) -> lb.QKPrologue:
        """This module's QK-norm (scales promoted to its dtype, as ``nnx.RMSNorm`` does) and RoPE at positions
        0..s−1, for :func:`lowbit_jax.sage_attention` and :func:`lowbit_jax.qat_attention`."""
        cos, sin = lb.rope_tables(jnp.arange(s), self.head_dim, self.rope_base, self.rope_freq_factors)
        gq = gk = None
        eps = 1e-6
        if self.q_norm is not None:
            gq, gk = (n.scale[...].astype(self.dtype) for n in (self.q_norm, self.k_norm))
            eps = self.q_norm.epsilon
        return lb.QKPrologue(gq, gk, cos, sin, cos, sin, eps=eps)

    def _qkv(self, x, positions):
        q, k, v = self._projections(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (rope(q, positions, self.rope_base, self.rope_freq_factors),
                rope(k, positions, self.rope_base, self.rope_freq_factors), v)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: (B, S, dim) → (B, S, dim), full-sequence (training / prefill)."""
        b, s, _ = x.shape
        if self.method in FUSED_PROLOGUE_METHODS and self.fuse_qk_prologue:
            q, k, v = self._projections(x)
            if self.method == "sage":
                o = lb.sage_attention(q, k, v, causal=self.causal, smooth_k=self.smooth_k,
                                      prologue=self._prologue(s), **self.attention_options)
            else:
                o = lb.qat_attention(q, k, v, causal=self.causal, prologue=self._prologue(s),
                                     **self.attention_options)
            return self.o_proj(o.reshape(b, s, -1))
        q, k, v = self._qkv(x, jnp.arange(s))
        if self.method == "dense":
            o = dense_attention(q, k, v, causal=self.causal)
        elif self.method == "qat_fp4":
            o = lb.qat_attention(q, k, v, causal=self.causal, **self.attention_options)
        elif self.method == "thrift":
            o = lb.thrift_attention(q, k, v, causal=self.causal, **self.attention_options)
        elif self.method == "sparse":
            options = self.attention_options
            o = lb.block_sparse_attention(q, k, v, causal=self.causal, budget=options.get("budget", 0.05),
                                          config=options.get("config"))
        else:
            o = lb.sage_attention(q, k, v, causal=self.causal, smooth_k=self.smooth_k, **self.attention_options)
        return self.o_proj(o.reshape(b, s, -1))

    def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.bfloat16) -> dict | lb.ThriftKVCache:
        """Empty KV cache: for "thrift" a :class:`lowbit_jax.ThriftKVCache` (its block from the options'
        ``config``), else a dict of k, v (B, max_len, Hkv, D) and the filled length."""
        if self.method == "thrift":
            config = self.attention_options.get("config") or lb.ThriftConfig()
            return lb.ThriftKVCache.create(batch, max_len, self.num_kv_heads, self.head_dim, dtype=dtype,
                                           block=config.block)
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "length": jnp.zeros((), jnp.int32),
                "overflow": jnp.zeros((), jnp.bool_)}

    def _check_causal(self):
        if self.method == "sparse":
            raise ValueError("method 'sparse' is an evaluation baseline of the full-sequence forward: it has no "
                             "KV-cache path (serve with thrift)")
        if not self.causal:
            raise ValueError("the KV-cache paths (prefill, decode) attend causally: this attention has causal=False")

    def _append_options(self) -> dict:
        """The attention options that pick ThriftKVCache.append's implementation (its one-token kernel)."""
        return {key: self.attention_options[key] for key in ("implementation", "interpret")
                if key in self.attention_options}

    def _thrift_prefill(self, q, k, v, cache):
        """A prompt into an empty cache: the prefill over the prompt alone, then the prompt cached."""
        o = lb.thrift_attention(q, k, v, causal=True, **self.attention_options)
        return o, cache.append(k, v)

    def _thrift_decode_chunks(self, q, k, v, cache):
        """New tokens after cached ones: thrift_decode in chunks of at most MAX_DECODE_ROWS query rows."""
        chunk = max(1, lb.THRIFT_DECODE_MAX_ROWS // (self.num_heads // self.num_kv_heads))
        outs = []
        for a in range(0, q.shape[1], chunk):
            cache = cache.append(k[:, a:a + chunk], v[:, a:a + chunk])
            outs.append(lb.thrift_decode(q[:, a:a + chunk], cache, **self.attention_options))
        return (jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]), cache

    def prefill(self, x: jax.Array, cache: dict | lb.ThriftKVCache) -> tuple[jax.Array, dict | lb.ThriftKVCache]:
        """A prompt (B, T, dim) into ``cache``, which must be empty (:meth:`init_cache`); returns (y, the cache).

        The static form of :meth:`decode` from an empty cache: "thrift" is ThriftAttention's prefill over the
        prompt (the forward pass's attention), which decode picks at run time, compiling its other route too;
        every other method is 16-bit causal attention over the prompt (:func:`lowbit_jax.dense_attention`), the values
        of
        :func:`lowbit_jax.cached_attention` there without its cached part (over one slot, weight 0).
        """
        self._check_causal()
        t = x.shape[1]
        q, k, v = self._qkv(x, jnp.arange(t))
        if self.method == "thrift":
            o, cache = self._thrift_prefill(q, k, v, cache)
        else:
            o = dense_attention(q, k, v, causal=True)
            cache = _append_16bit(cache, k, v)
        return self.o_proj(o.reshape(x.shape[0], t, -1)), cache

    def decode(self, x: jax.Array, cache: dict | lb.ThriftKVCache) -> tuple[jax.Array, dict | lb.ThriftKVCache]:
        """Attend T new tokens (B, T, dim) to the cache plus themselves; returns (y, new cache).

        "thrift": the tokens are appended to its 16-bit and 4-bit caches. A prompt into an empty cache (T > 1,
        ``cache.length == 0``, decided at run time) is ThriftAttention's prefill (:func:`lowbit_jax.thrift_attention`,
        causal, over the prompt alone: the forward pass's attention); otherwise :func:`lowbit_jax.thrift_decode`
        reads the selected blocks from the 16-bit cache and the rest from the 4-bit one, and more tokens than one
        call takes (:data:`lowbit_jax.THRIFT_DECODE_MAX_ROWS` query rows: a long chunk after cached tokens) go
        through in consecutive chunks, each appended and then attended, as that many shorter decode calls would.
        Every other method attends in 16-bit over the cache (:func:`lowbit_jax.cached_attention`).

        Tokens that do not fit the cache raise ``ValueError`` outside ``jit``; under ``jit`` nothing is written
        past ``max_len``: the cache's ``overflow`` flag is set and the output is NaN.
        """
        self._check_causal()
        b, t, _ = x.shape
        if self.method == "thrift":
            q, k, v = self._qkv(x, cache.length + jnp.arange(t))
            if t == 1:
                cache = cache.append(k, v, **self._append_options())
                o = lb.thrift_decode(q, cache, **self.attention_options)
            else:
                o, cache = jax.lax.cond(cache.length == 0, self._thrift_prefill, self._thrift_decode_chunks,
                                        q, k, v, cache)
            return self.o_proj(o.reshape(b, t, -1)), cache
        start = cache["length"]
        q, k, v = self._qkv(x, start + jnp.arange(t))
        cache = _append_16bit(cache, k, v)
        o = cached_attention(q, cache["k"], cache["v"], start)
        o = jnp.where(cache["overflow"], jnp.nan, o).astype(o.dtype)  # traced overflow: NaN, not stale values
        return self.o_proj(o.reshape(b, t, -1)), cache
