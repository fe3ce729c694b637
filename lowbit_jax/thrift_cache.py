"""ThriftAttention's KV cache: the 16-bit K/V, their NVFP4 copies and the per-block key means (docs/spec.md,
ThriftAttention).

One pytree (``jax.tree_util`` dataclass), updated functionally under ``jit``:

* ``k``, ``v``: (B, S_max, Hkv, D) in the model's 16-bit dtype, the layout of the attention inputs;
* ``k4``: uint8 (B, Hkv, S_max, D/2) — each token's e2m1 codes in groups of 16 along D, packed by
  :func:`pallas_kernels.numerics.nvfp4.pack_halves` (channel i with channel i + D/2); ``k4_scale``:
  float8_e4m3fn (B, Hkv, S_max, D/16);
* ``v4``: uint8 (B, Hkv, S_max/block · D, block/2) — V block-major and, within a block, channel-major: rows
  j·D … j·D + D − 1 are block j's channels, each the block's tokens in groups of 16 (the P·V product contracts
  over tokens) packed by halves (token t with t + block/2) into block/2 bytes. A block's codes are one contiguous
  D · block/2 bytes, as the decode reads them (Ṽᵀ);
  ``v4_scale``: float8_e4m3fn (B, Hkv, S_max/16, D);
* ``k_mean``: float32 (B, Hkv, S_max/block, D) — the mean of each complete key block (the decode
  selection's k̄; blocks not yet complete hold partial values that nothing reads);
* ``length``: int32 scalar, tokens filled;
* ``overflow``: bool scalar, set once an append under ``jit`` did not fit (see :meth:`ThriftKVCache.append`).

Misuse is refused: outside ``jit`` (where ``length`` is a concrete value) an append past ``max_len`` raises
``ValueError``, and so does :func:`lowbit_jax.thrift_decode` on a cache holding fewer tokens than it is asked to
decode. Under ``jit`` the lengths are traced, so the same cases are defined instead of raised: an append that does
not fit writes nothing, leaves ``length`` as it was and sets ``overflow``; a decode on an overflowed cache, or with
fewer cached tokens than new ones, returns NaN for every output (the model's NaN guard and ``jnp.isfinite`` see it).

4-bit bytes per value: 0.5625, so the cache is 28% larger than a 16-bit one alone; a decode step reads
0.5625 bytes per K and V value of an unselected block instead of 2. Positions at and after ``length`` are
zeros (as :meth:`ThriftKVCache.create` makes them); :meth:`append` re-quantizes the 16-token V groups it
touches from the 16-bit values, so a partially filled group is always the quantization of what is there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax._checks import check_bool, check_implementation
from lowbit_jax._x32 import x32
from pallas_kernels.numerics import nvfp4
from pallas_kernels.thrift_append import thrift_append_token
from lowbit_jax.thrift_reference import check_key_blocks

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ThriftKVCache:
    """16-bit + NVFP4 KV cache with per-block key means (see the module docstring for the layout)."""

    k: jax.Array
    v: jax.Array
    k4: jax.Array
    k4_scale: jax.Array
    v4: jax.Array
    v4_scale: jax.Array
    k_mean: jax.Array
    length: jax.Array
    overflow: jax.Array
    block: int = dataclasses.field(default=64, metadata=dict(static=True))

    @classmethod
    @x32
    def create(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *, dtype=jnp.bfloat16,
               block: int = 64) -> "ThriftKVCache":
        """An empty cache (zeros, length 0).

        Args:
          batch, num_kv_heads: B, Hkv. max_len: capacity, rounded up to a multiple of ``block``.
          head_dim: D, one of 32, 64, 128, 256. dtype: the 16-bit cache dtype (bf16, fp16 or fp32).
          block: the selection block (``ThriftConfig.block``: 32, 64 or 128).
        """
        for name, value in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads)):
            _check_positive_int(name, value)
        if head_dim not in (32, 64, 128, 256):
            raise ValueError(f"head_dim must be one of (32, 64, 128, 256), got {head_dim!r}")
        if block not in (32, 64, 128):
            raise ValueError(f"block must be 32, 64 or 128, got {block!r}")
        if not any(np.dtype(dtype) == np.dtype(d) for d in _DTYPES):
            raise TypeError(f"dtype must be bfloat16, float16 or float32, got {np.dtype(dtype).name}")
        check_key_blocks(max_len, block, "max_len")
        s = -(-max_len // block) * block
        b, h, d = batch, num_kv_heads, head_dim
        e4m3 = jnp.float8_e4m3fn
        return cls(
            k=jnp.zeros((b, s, h, d), dtype), v=jnp.zeros((b, s, h, d), dtype),
            k4=jnp.zeros((b, h, s, d // 2), jnp.uint8), k4_scale=jnp.ones((b, h, s, d // nvfp4.GROUP), e4m3),
            v4=jnp.zeros((b, h, s // block * d, block // 2), jnp.uint8),
            v4_scale=jnp.ones((b, h, s // nvfp4.GROUP, d), e4m3),
            k_mean=jnp.zeros((b, h, s // block, d), jnp.float32), length=jnp.zeros((), jnp.int32),
            overflow=jnp.zeros((), jnp.bool_), block=block)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the 16-bit part, the 4-bit part (codes and scales) and the key means."""
        size = lambda *xs: int(sum(x.size * x.dtype.itemsize for x in xs))  # noqa: E731
        return {"16bit": size(self.k, self.v), "4bit": size(self.k4, self.k4_scale, self.v4, self.v4_scale),
                "k_mean": size(self.k_mean)}

    @x32
    def append(self, k_new: jax.Array, v_new: jax.Array, *, implementation: str | None = None,
               interpret: bool = False) -> "ThriftKVCache":
        """Write T new tokens at ``length`` into every part of the cache; returns the new cache.

        Args:
          k_new, v_new: (B, T, Hkv, D), 1 ≤ T ≤ max_len, in any float dtype (cast to the cache's).
          implementation: "pallas" (one token: :func:`pallas_kernels.thrift_append.thrift_append_token`, one
            launch; more tokens take the XLA route), "xla", or None: "pallas" on a GPU, else "xla".
          interpret: the kernel in Pallas interpret mode (runs anywhere).
        Returns:
          The cache with ``length + T`` tokens. Past ``max_len``: ``ValueError`` outside ``jit``; under ``jit``
          nothing is written and ``overflow`` is set (see the module docstring).
        """
        for name, x in (("k_new", k_new), ("v_new", v_new)):
            if not hasattr(x, "shape") or x.ndim != 4:
                raise ValueError(f"{name} must have rank 4 (batch, tokens, kv_heads, head_dim), got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            b, _, h, d = x.shape
            if (b, h, d) != (self.k.shape[0], self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name} has batch/kv_heads/head_dim {(b, h, d)}, the cache "
                                 f"{(self.k.shape[0], self.num_kv_heads, self.head_dim)}")
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must have one shape, got {k_new.shape} and {v_new.shape}")
        t = k_new.shape[1]
        if not 1 <= t <= self.max_len:
            raise ValueError(f"appending {t} tokens to a cache of max_len {self.max_len}")
        if not isinstance(self.length, jax.core.Tracer) and int(self.length) + t > self.max_len:
            raise ValueError(f"appending {t} tokens to a cache holding {int(self.length)} of max_len {self.max_len}: "
                             f"it would overflow (create the cache with a larger max_len)")
        impl = check_implementation(implementation, check_bool("interpret", interpret))
        if t == 1 and impl == "pallas":
            return _append_token(self, k_new, v_new, interpret=interpret)
        return _append(self, k_new, v_new)

    @property
    def overflowed(self) -> jax.Array:
        """bool scalar: an append under ``jit`` did not fit (nothing of it was written)."""
        return self.overflow

    def _append(self, k_new: jax.Array, v_new: jax.Array) -> "ThriftKVCache":
        t = k_new.shape[1]
        start = self.length
        fits = start + t <= self.max_len

        def put(x, update, index):
            """``x`` with ``update`` at ``index``, or ``x`` unchanged if the append does not fit (the old values
            written back: a select of the update's size, not of the cache's)."""
            old = jax.lax.dynamic_slice(x, index, update.shape)
            return jax.lax.dynamic_update_slice(x, jnp.where(fits, update.astype(x.dtype), old), index)

        k = put(self.k, k_new, (0, start, 0, 0))
        v = put(self.v, v_new, (0, start, 0, 0))
        # K: per token, groups of 16 along D
        k_codes, k_scale = nvfp4.encode_last(jnp.swapaxes(k_new.astype(k.dtype).astype(jnp.float32), 1, 2))
        k4 = put(self.k4, nvfp4.pack_halves(k_codes), (0, 0, start, 0))
        k4_scale = put(self.k4_scale, k_scale, (0, 0, start, 0))
        # V (groups of 16 tokens) and the block means: re-derived for the whole blocks the new tokens touch
        blk = self.block
        width = min(self.max_len, (-(-t // blk) + 1) * blk)
        w0 = jnp.clip((start // blk) * blk, 0, self.max_len - width)
        window = lambda x: jax.lax.dynamic_slice_in_dim(x, w0, width, axis=1).astype(jnp.float32)  # noqa: E731
        vw = jnp.transpose(window(v), (0, 2, 3, 1))  # (B, Hkv, D, W): tokens last
        v_codes, v_scale = nvfp4.encode_last(vw)
        b, h, d, _ = v_codes.shape
        packed = nvfp4.pack_halves(v_codes.reshape(b, h, d, width // blk, blk))  # (B, Hkv, D, W/blk, blk/2)
        packed = jnp.swapaxes(packed, 2, 3).reshape(b, h, width // blk * d, blk // 2)  # block-major
        v4 = put(self.v4, packed, (0, 0, w0 // blk * d, 0))
        v4_scale = put(self.v4_scale, jnp.swapaxes(v_scale, 2, 3), (0, 0, w0 // nvfp4.GROUP, 0))
        kw = window(k).reshape(b, width // blk, blk, h, d)
        means = jnp.swapaxes(jnp.mean(kw, axis=2), 1, 2)  # (B, Hkv, W/blk, D)
        k_mean = put(self.k_mean, means, (0, 0, w0 // blk, 0))
        return dataclasses.replace(self, k=k, v=v, k4=k4, k4_scale=k4_scale, v4=v4, v4_scale=v4_scale,
                                   k_mean=k_mean, length=jnp.where(fits, start + t, start),
                                   overflow=self.overflow | ~fits)


_append = jax.jit(ThriftKVCache._append)  # one compiled update per (cache, T) shape, also when called eagerly


@functools.partial(jax.jit, static_argnames=("interpret",))
def _append_token(cache: ThriftKVCache, k_new: jax.Array, v_new: jax.Array, *, interpret: bool) -> ThriftKVCache:
    """:meth:`ThriftKVCache._append` of one token by the append kernel (the same arrays)."""
    start = cache.length
    fits = start + 1 <= cache.max_len
    meta = jnp.stack([start, fits.astype(jnp.int32)])
    rows = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (B, 1, Hkv, D) -> (B, Hkv, 1, D), a free reshape
    k, v, k4, k4_scale, v4, v4_scale, k_mean = thrift_append_token(
        meta, rows(k_new), rows(v_new), cache.k, cache.v, cache.k4, cache.k4_scale, cache.v4, cache.v4_scale,
        cache.k_mean, block=cache.block, interpret=interpret)
    return dataclasses.replace(cache, k=k, v=v, k4=k4, k4_scale=k4_scale, v4=v4, v4_scale=v4_scale, k_mean=k_mean,
                               length=jnp.where(fits, start + 1, start), overflow=cache.overflow | ~fits)
