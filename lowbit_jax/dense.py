"""16-bit attention for the models' dense method and for decoding over a 16-bit KV cache: cuDNN's flash attention on
a GPU where it applies (bf16/fp16, head dim a multiple of 8 up to 128), XLA elsewhere."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _cudnn(q: jax.Array) -> bool:
    """cuDNN's flash attention applies: a GPU, bf16/fp16, a head dim it takes (a multiple of 8, ≤ 128)."""
    d = q.shape[-1]
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128


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
    * "cudnn": flash attention over the filled length only (``key_value_seq_lengths``), so a long cache
      costs only its filled part. Several tokens are two cuDNN calls, over the cached keys and over the new ones,
      merged by their float32 log-sum-exps (cuDNN skips the masked tiles; a causal bias tensor would not). After
      cached tokens the merge rounds each part to q's dtype first (a little less accurate than one call). Into an
      empty cache the output is exactly cuDNN's causal attention over the prompt.
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
