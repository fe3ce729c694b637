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
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import lowbit_jax as lb
from lowbit_jax.thrift import MAX_DECODE_ROWS
from pallas_kernels._triton import on_gpu

METHODS = ("dense", "sage", "qat_fp4", "thrift")
#: the methods whose attention takes QK-norm and RoPE as a prologue of its own kernels (``fuse_qk_prologue``)
FUSED_PROLOGUE_METHODS = ("sage", "qat_fp4")


def check_method(method: str) -> None:
    """Raise ``ValueError`` unless ``method`` is one of :data:`METHODS`."""
    if method not in METHODS:
        raise ValueError(f"attention method must be one of {METHODS}, got {method!r}")


def _cudnn(q: jax.Array) -> bool:
    """cuDNN's flash attention applies: a GPU, bf16/fp16, a head dim it takes (a multiple of 8, ≤ 128)."""
    return on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
    """16-bit attention: cuDNN on a GPU for bf16/fp16 and head dims it supports, XLA otherwise.

    q: (B, S, Hq, D); k, v: (B, S, Hkv, D) → (B, S, Hq, D).
    """
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn" if _cudnn(q) else None)


#: most (batch × query heads × new tokens × cache slots) scores one masked XLA attention call of
#: :func:`cached_attention` holds (float32: 256 MiB); more new tokens go through in chunks
MASKED_SCORES_PER_CHUNK = 2**26

#: :func:`cached_attention`'s ``implementation`` values
CACHED_IMPLEMENTATIONS = (None, "cudnn", "xla")


def _causal_cache_mask(t, slots, start):
    """(T, slots) bool: new token i (at ``start + i``) sees the cached keys 0 … start + i."""
    return jnp.arange(slots)[None, :] <= (start + jnp.arange(t))[:, None]


def _masked_attention(q, k_cache, v_cache, start):
    mask = _causal_cache_mask(q.shape[1], k_cache.shape[1], start)
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None])


def _xla_cached_attention(q, k_cache, v_cache, start):
    """XLA's masked attention over the whole cache, in consecutive chunks of new tokens (a ``lax.map``; the last
    one padded) of at most :data:`MASKED_SCORES_PER_CHUNK` scores."""
    b, t, h, d = q.shape
    chunk = max(1, MASKED_SCORES_PER_CHUNK // (b * h * k_cache.shape[1]))
    if chunk >= t:
        return _masked_attention(q, k_cache, v_cache, start)
    n = -(-t // chunk)
    pieces = jnp.pad(q, ((0, 0), (0, n * chunk - t), (0, 0), (0, 0))).reshape(b, n, chunk, h, d)
    out = jax.lax.map(lambda xs: _masked_attention(xs[0], k_cache, v_cache, start + xs[1]),
                      (jnp.moveaxis(pieces, 1, 0), jnp.arange(n, dtype=jnp.int32) * chunk))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, h, d)[:, :t]


def _cudnn_with_lse(q, k, v, *, causal, kv_lengths=None):
    """cuDNN flash attention and its float32 log-sum-exp (natural log of the scaled scores), (B, T, Hq).

    ``jax.nn.dot_product_attention(return_residual=True)`` rounds that residual to q's dtype, too coarse to
    merge two parts by (bf16: an error of ~1e-2 in the exponent), so this calls the cuDNN wrapper it wraps,
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, whose residual is cuDNN's float32
    softmax statistic (B, Hq, T). Top-left causal for ``causal``; ``kv_lengths`` (B,) pads the keys."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    b, t = q.shape[:2]
    kwargs = {}
    if kv_lengths is not None:
        kwargs = {"q_seqlen": jnp.full((b,), t, jnp.int32), "kv_seqlen": kv_lengths}
    mask_type = {(False, False): cudnn.MaskType.NO_MASK, (True, False): cudnn.MaskType.CAUSAL,
                 (False, True): cudnn.MaskType.PADDING, (True, True): cudnn.MaskType.PADDING_CAUSAL}
    o, lse = cudnn.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, return_residual=True,
                                         mask_type=mask_type[causal, kv_lengths is not None], **kwargs)
    return o, jnp.swapaxes(lse, 1, 2)


def _merge(parts):
    """One softmax over disjoint key sets: [(o (B, T, H, D), lse (B, T, H) float32), …] → o in the first's
    dtype."""
    lse = functools.reduce(jnp.logaddexp, [p[1] for p in parts])
    out = sum(o.astype(jnp.float32) * jnp.exp(l - lse)[..., None] for o, l in parts)
    return out.astype(parts[0][0].dtype)


def _cudnn_cached_attention(q, k_cache, v_cache, start):
    """cuDNN over the filled length only. One token: ``key_value_seq_lengths = start + 1``, no other mask.
    Several: two cuDNN calls merged by their float32 log-sum-exps, the T new tokens over the ``start`` cached
    ones (a key padding mask) and over themselves (top-left causal, T × T): cuDNN has no bottom-right causal
    mask, and this reads no mask tensor and skips the masked tiles. No branch on ``start`` (an XLA conditional
    waits for its predicate on the host, ~0.1 ms): with no cached tokens the first call runs over one slot and
    its weight is exactly 0, so the output is exactly the second call's, cuDNN's causal attention over the
    prompt."""
    b, t = q.shape[:2]
    if t == 1:
        lengths = jnp.full((b,), start + 1, jnp.int32)
        return jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                            implementation="cudnn")
    new_k = jax.lax.dynamic_slice_in_dim(k_cache, start, t, axis=1)
    new_v = jax.lax.dynamic_slice_in_dim(v_cache, start, t, axis=1)
    o, lse = _cudnn_with_lse(q, k_cache, v_cache, causal=False,
                             kv_lengths=jnp.full((b,), jnp.maximum(start, 1), jnp.int32))
    cached = (o, jnp.where(start > 0, lse, -jnp.inf))
    return _merge([cached, _cudnn_with_lse(q, new_k, new_v, causal=True)])


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, start: jax.Array, *,
                     implementation: str | None = None) -> jax.Array:
    """16-bit attention of T new tokens at positions ``start … start + T − 1`` over a cache that holds them.

    ``implementation=None`` picks cuDNN where it applies (:func:`dense_attention`'s rule), else XLA:
    * "cudnn": flash attention over the filled length only (``key_value_seq_lengths``; H200, the 50m
      preset's heads, B8, a 32k cache, one token: 0.11 ms against XLA's 0.43, benchmarks/NOTES.md, 27th
      session). Several tokens are two cuDNN calls, over the cached keys and over the new ones, merged by
      their float32 log-sum-exps (B1 H32/8 D128, 2048 tokens after 16384: 1.09 ms against 2.36 with the causal
      mask as cuDNN's bias, 29th session). After cached tokens the merge rounds each part to q's dtype first:
      rel-L2 vs float32 2.6–2.7e-3 against 2.0–2.2e-3 in one call. Into an empty cache the output is exactly
      cuDNN's causal attention over the prompt.
    * "xla": a causal mask over the whole cache, which holds a (B, Hq, T, S_max) float32 score tensor: a
      long prompt goes through in chunks of new tokens (a ``lax.map``) of at most
      :data:`MASKED_SCORES_PER_CHUNK` scores.

    Args:
      q: (B, T, Hq, D); k_cache, v_cache: (B, S_max, Hkv, D), the T new tokens already written at ``start``;
      start: int32 scalar, the tokens cached before these (``start + T ≤ S_max``).
      implementation: None, "cudnn" (a GPU, bf16/fp16 q, D a multiple of 8 up to 128) or "xla".
    Returns:
      (B, T, Hq, D) in q's dtype.
    """
    if implementation not in CACHED_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {CACHED_IMPLEMENTATIONS}, got {implementation!r}")
    if q.shape[1] > k_cache.shape[1]:
        raise ValueError(f"q has {q.shape[1]} new tokens, more than the cache's {k_cache.shape[1]} slots")
    k_cache, v_cache = k_cache.astype(q.dtype), v_cache.astype(q.dtype)
    if implementation == "cudnn" and not _cudnn(q):
        raise ValueError("implementation='cudnn' needs a GPU, bf16/fp16 q and a head dim that is a multiple of 8 "
                         f"up to 128; got {q.dtype} q of head dim {q.shape[-1]} on {jax.default_backend()}")
    if implementation == "cudnn" or (implementation is None and _cudnn(q)):
        return _cudnn_cached_attention(q, k_cache, v_cache, start)
    return _xla_cached_attention(q, k_cache, v_cache, start)


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


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding (rotate-half form; the tables of :func:`lowbit_jax.rope_tables`).

    Args:
      x: (B, S, H, D).
      positions: int (B, S) or (S,).
    Returns:
      x's shape and dtype.
    """
    cos, sin = lb.rope_tables(positions, x.shape[-1], base)  # (..., S, D/2)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    z1, z2 = lb.formats.qk_prologue.rotate(x1, x2, cos[:, :, None, :], sin[:, :, None, :])
    return jnp.concatenate([z1, z2], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head attention (GQA) with QK-norm and RoPE.

    Args:
      dim: model width. num_heads, num_kv_heads: query and key/value heads
        (num_heads a multiple of num_kv_heads); head dim = dim // num_heads.
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
                 rngs: nnx.Rngs):
        check_method(method)
        if num_heads % num_kv_heads or dim % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide dim ({dim}) and be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        self.method, self.causal, self.smooth_k, self.rope_base = method, causal, smooth_k, rope_base
        self.fuse_qk_prologue, self.dtype = fuse_qk_prologue, dtype
        self.attention_options = dict(attention_options or {})
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, rngs=rngs)
        self.q_proj = linear(dim, num_heads * self.head_dim)
        self.k_proj = linear(dim, num_kv_heads * self.head_dim)
        self.v_proj = linear(dim, num_kv_heads * self.head_dim)
        self.o_proj = linear(num_heads * self.head_dim, dim)
        self.q_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, rngs=rngs) if qk_norm else None
        self.k_norm = nnx.RMSNorm(self.head_dim, dtype=dtype, rngs=rngs) if qk_norm else None

    def _projections(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        return q, k, v

    def _prologue(self, s: int) -> lb.QKPrologue:
        """This module's QK-norm (scales promoted to its dtype, as ``nnx.RMSNorm`` does) and RoPE at positions
        0..s−1, for :func:`lowbit_jax.sage_attention` and :func:`lowbit_jax.qat_attention`."""
        cos, sin = lb.rope_tables(jnp.arange(s), self.head_dim, self.rope_base)
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
        return rope(q, positions, self.rope_base), rope(k, positions, self.rope_base), v

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
        if not self.causal:
            raise ValueError("the KV-cache paths (prefill, decode) attend causally: this attention has causal=False")

    def _thrift_prefill(self, q, k, v, cache):
        """A prompt into an empty cache: the prefill over the prompt alone, then the prompt cached."""
        o = lb.thrift_attention(q, k, v, causal=True, **self.attention_options)
        return o, cache.append(k, v)

    def _thrift_decode_chunks(self, q, k, v, cache):
        """New tokens after cached ones: thrift_decode in chunks of at most MAX_DECODE_ROWS query rows."""
        chunk = max(1, MAX_DECODE_ROWS // (self.num_heads // self.num_kv_heads))
        outs = []
        for a in range(0, q.shape[1], chunk):
            cache = cache.append(k[:, a:a + chunk], v[:, a:a + chunk])
            outs.append(lb.thrift_decode(q[:, a:a + chunk], cache, **self.attention_options))
        return (jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]), cache

    def prefill(self, x: jax.Array, cache: dict | lb.ThriftKVCache) -> tuple[jax.Array, dict | lb.ThriftKVCache]:
        """A prompt (B, T, dim) into ``cache``, which must be empty (:meth:`init_cache`); returns (y, the cache).

        The static form of :meth:`decode` from an empty cache: "thrift" is ThriftAttention's prefill over the
        prompt (the forward pass's attention), which decode picks at run time, compiling its other route too;
        every other method is 16-bit causal attention over the prompt (:func:`dense_attention`), the values of
        :func:`cached_attention` there without its cached part (over one slot, weight 0).
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
        call takes (:data:`lowbit_jax.thrift.MAX_DECODE_ROWS` query rows: a long chunk after cached tokens) go
        through in consecutive chunks, each appended and then attended, as that many shorter decode calls would.
        Every other method attends in 16-bit over the cache (:func:`cached_attention`).

        Tokens that do not fit the cache raise ``ValueError`` outside ``jit``; under ``jit`` nothing is written
        past ``max_len``: the cache's ``overflow`` flag is set and the output is NaN.
        """
        self._check_causal()
        b, t, _ = x.shape
        if self.method == "thrift":
            q, k, v = self._qkv(x, cache.length + jnp.arange(t))
            if t == 1:
                cache = cache.append(k, v)
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
