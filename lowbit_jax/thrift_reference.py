"""Pure-JAX references of ThriftAttention with the kernels' exact quantization and block order.

docs/spec.md, ThriftAttention. The kernels (:mod:`pallas_kernels.thrift_select`, :mod:`pallas_kernels.thrift_prefill`,
:mod:`pallas_kernels.thrift_decode`) and these twins share the quantizers of
:mod:`pallas_kernels.numerics.nvfp4` and the selection rule below:

* **Blocks.** ``config.block`` queries and keys (64 by default). q̄ and k̄ are the float32 means of each
  block's real rows (:func:`block_means`).
* **Which blocks a query block may pick.** Non-causal: all. Causal (bottom-right aligned): the key blocks
  holding at least one key that the block's last real row sees (:func:`valid_key_blocks`).
* **How many.** :func:`topk_count`: non-causal ``k = max(1, ⌊f·N_kb + ½⌋)`` (0 for f = 0); causal, the k
  whose ``Σ_i min(k, n_i)`` is nearest to ``f · Σ_i n_i`` (rows with fewer valid blocks take them all;
  k ≥ 1 for f > 0). f = 1 selects every valid block, f = 0 none.
* **Which.** The k largest scores ``q̄_i · k̄_j`` (no softmax scale) among the valid blocks, ties to the
  lower block index. GQA: each query head scores against its kv head's k̄.
* **Attention.** One online softmax (base 2) over the valid key blocks in the order of
  :func:`block_order`: the 4-bit blocks first, then the 16-bit ones, each ascending (a kernel then runs
  two branch-free loops instead of a branch per block). 16-bit blocks: S = QKᵀ·c and O += P·V with
  16-bit operands (bf16; fp16 for fp16 inputs) and fp32 accumulation. 4-bit blocks: Q̃ = φ(Q) and
  K̃ = φ(K) (NVFP4, groups of 16 along D), Ṽ = φ(V) (groups of 16 tokens per channel, aligned to
  absolute positions), S = Q̃K̃ᵀ·c, and O += FQ(P)·Ṽ with FQ(P) NVFP4 per group of 16 keys by its own
  amax (the spec's "per-group amax" scheme), P = exp2(S − m) taken relative to the running row max. l sums
  the unquantized P of both paths. Rows that see no key give zeros.
* **Decode** (:func:`decode_reference`): the new tokens are in the cache; scores are the max over the
  group's query heads (and query tokens) of q·k̄ of each *complete* key block; ``⌊f·n_complete + ½⌋``
  of them in 16-bit, the rest and the trailing partial block from the 4-bit cache. Split-KV
  (flash-decoding): the 4-bit blocks (in :func:`block_order`) in ``config.decode_splits`` contiguous
  runs, the 16-bit ones in ``config.decode_splits_high`` more, each with its own online softmax, merged
  at the end (:func:`combine_splits`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.numerics import int8, nvfp4
from lowbit_jax.qat_reference import head_major, mma_dtype
from pallas_kernels.configs import ThriftConfig
from pallas_kernels.numerics.online_softmax import online_softmax_step
from pallas_kernels.numerics.tile_ranges import selectable_key_blocks, visible

LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------- selection


def block_means(x: jax.Array, block: int) -> jax.Array:
    """Float32 mean of each block's real rows.

    Args:
      x: (B, S, H, D).
      block: rows per block.
    Returns:
      (B, H, ceil(S / block), D) float32.
    """
    b, s, h, d = x.shape
    nb = -(-s // block)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, nb * block - s), (0, 0), (0, 0)))
    sums = jnp.sum(xf.reshape(b, nb, block, h, d), axis=2)
    counts = np.minimum(block, s - block * np.arange(nb)).astype(np.float32)
    return jnp.swapaxes(sums / counts[None, :, None, None], 1, 2)


def valid_key_blocks(sq: int, sk: int, block: int, causal: bool) -> np.ndarray:
    """Key blocks each query block may select: int (ceil(Sq/block),), a prefix count n_i.

    Non-causal every key block; causal (bottom-right) those holding a key the block's last real row sees.
    """
    starts = block * np.arange(-(-sq // block))
    return np.asarray(selectable_key_blocks(starts, block=block, sq_len=sq, sk_len=sk, causal=causal, xp=np),
                      np.int64)


def topk_count(budget: float, counts: np.ndarray, causal: bool) -> int:
    """How many key blocks each query block takes in 16-bit (docs/spec.md, ThriftAttention).

    Args:
      budget: f in [0, 1].
      counts: :func:`valid_key_blocks`.
      causal: the mask.
    Returns:
      k: non-causal ``max(1, ⌊f·N + ½⌋)`` (0 for f = 0); causal the k ≥ 1 (0 for f = 0) with
      ``Σ min(k, n_i)`` nearest ``f · Σ n_i``, ties to the smaller k.
    """
    n_max = int(counts.max()) if counts.size else 0
    if budget <= 0.0 or n_max == 0:
        return 0
    if not causal:
        return min(n_max, max(1, math.floor(budget * n_max + 0.5)))
    target = budget * float(counts.sum())
    ks = np.arange(1, n_max + 1)
    selected = np.minimum(ks[:, None], counts[None, :]).sum(axis=1)
    return int(ks[np.argmin(np.abs(selected - target))])


def selection_reference(q_mean: jax.Array, k_mean: jax.Array, counts: np.ndarray, k: int) -> jax.Array:
    """Top-k key blocks per query block, ties to the lower index (the selection kernel's twin).

    Args:
      q_mean: (B, Hq, Nqb, D) float32; k_mean: (B, Hkv, Nkb, D) float32 (:func:`block_means`).
      counts: (Nqb,) valid key blocks per query block (:func:`valid_key_blocks`); k: :func:`topk_count`.
    Returns:
      bool (B, Hq, Nqb, Nkb): True where the pair runs in 16-bit.
    """
    group = q_mean.shape[1] // k_mean.shape[1]
    km = jnp.repeat(k_mean, group, axis=1) if group > 1 else k_mean
    scores = jnp.einsum("bhqd,bhkd->bhqk", q_mean, km, precision=jax.lax.Precision.HIGHEST)
    cols = jnp.arange(km.shape[2])
    valid = cols[None, :] < jnp.asarray(counts)[:, None]  # (Nqb, Nkb)
    return _top_blocks(scores, valid, jnp.minimum(k, jnp.asarray(counts))[:, None])


def _top_blocks(scores: jax.Array, valid: jax.Array, take: jax.Array) -> jax.Array:
    """bool, scores' shape: the ``take`` highest-scoring ``valid`` blocks along the last axis, ties to the lower
    index (the rule both selections follow; ``take`` broadcasts against ``scores.shape[:-1] + (1,)``)."""
    order = jnp.argsort(jnp.where(valid, -scores, jnp.inf), axis=-1, stable=True)
    rank = _inverse_permutation(order)  # each block's position in the descending order (one sort, one scatter)
    return (rank < take) & valid


def _inverse_permutation(perm: jax.Array) -> jax.Array:
    """The inverse of permutations along the last axis, by one scatter: ``out[..., perm[..., i]] = i``."""
    i = jnp.broadcast_to(jnp.arange(perm.shape[-1], dtype=perm.dtype), perm.shape)
    return jnp.put_along_axis(jnp.zeros_like(perm), perm, i, axis=-1, inplace=False)


# ----------------------------------------------------------------------------- prefill


def fake_quant_operand(x: jax.Array, *, seq_pad: int, along: str, dtype) -> jax.Array:
    """The prefill's NVFP4 copy of K or V: (B, H, seq_pad, D) ``dtype``, the fake quantization in groups of
    16 along D (``along="channels"``) or of 16 tokens per channel (``"tokens"``), head-major, zero rows
    appended (the twin of :func:`pallas_kernels.fake_quant.fp4_fake_quant_heads`)."""
    xh = head_major(x.astype(jnp.float32), seq_pad)
    if along == "channels":
        fq = nvfp4.fake_quant_last(xh)
    else:
        fq = jnp.swapaxes(nvfp4.fake_quant_last(jnp.swapaxes(xh, 2, 3)), 2, 3)
    return fq.astype(dtype)


#: most key blocks per sequence: the block orders are int16
MAX_KEY_BLOCKS = 2**15


def check_key_blocks(seq_len: int, block: int, name: str) -> None:
    """ValueError unless ``seq_len`` tokens make at most :data:`MAX_KEY_BLOCKS` blocks of ``block``."""
    if -(-seq_len // block) > MAX_KEY_BLOCKS:
        raise ValueError(f"{name} ({seq_len}) makes more than {MAX_KEY_BLOCKS} key blocks of {block} tokens; "
                         f"ThriftAttention takes at most {MAX_KEY_BLOCKS * block} (use a larger ThriftConfig.block)")


def block_order(selected: jax.Array, counts: jax.Array) -> jax.Array:
    """The order a kernel visits key blocks in: the 4-bit blocks, then the 16-bit ones, each ascending.

    Args:
      selected: bool (..., Nkb), True for a 16-bit block; Nkb ≤ :data:`MAX_KEY_BLOCKS`.
      counts: int, broadcastable to ``selected.shape[:-1]``: the valid prefix of blocks per row.
    Returns:
      int16 (..., Nkb): block indices — first the valid unselected ones, then the selected ones (each
      ascending), then the invalid ones.
    """
    nkb = selected.shape[-1]
    j = jnp.arange(nkb, dtype=jnp.int16)
    valid = j < jnp.asarray(counts)[..., None]
    low, high = valid & ~selected, valid & selected
    rank = lambda m: jnp.cumsum(m, axis=-1, dtype=jnp.int16) - 1  # noqa: E731  (position among its kind)
    n_low = jnp.sum(low, axis=-1, keepdims=True, dtype=jnp.int16)
    # no sort: each block's position is a prefix count (the invalid ones are the suffix, already in place)
    position = jnp.where(low, rank(low), jnp.where(high, n_low + rank(high), j))
    return _inverse_permutation(position)


def _exact_dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` of 16-bit operands with exact products and float32 sums, on any backend.

    The operands go to float32 (exact) with ``precision=HIGHEST``: on a GPU, XLA rewrites these batched
    products with one-row operands into element-wise ops, which in 16-bit round every product.
    """
    f32 = jnp.float32
    return jnp.einsum(spec, a.astype(f32), b.astype(f32), precision=jax.lax.Precision.HIGHEST)


def _online_step(carry, s, update_fn):
    """One online-softmax step on base-2 scores ``s`` (−inf masked); ``update_fn(p)`` gives P's product."""
    acc, m_prev, l_prev = carry
    (p,), alpha, m_new, l_new = online_softmax_step([s], m_prev, l_prev)
    return acc * alpha[..., None] + update_fn(p), m_new, l_new


def prefill_reference(q: jax.Array, k: jax.Array, v: jax.Array, kq: jax.Array, vq: jax.Array, selected: jax.Array,
                      *, sq_len: int, sk_len: int, causal: bool, scale: float, config: ThriftConfig,
                      out_dtype) -> jax.Array:
    """Twin of :func:`pallas_kernels.thrift_prefill.thrift_prefill`: the mixed-precision online softmax.

    Args:
      q: (B, Sq, Hq, D).
      k, v: (B, Sk_pad, Hkv, D), zero rows after Sk (:func:`lowbit_jax.thrift.operands`); their 16-bit
        blocks are ``k.astype(kq.dtype)``.
      kq, vq: (B, Hkv, Sk_pad, D) from :func:`fake_quant_operand` (channels for K, tokens for V).
      selected: bool (B, Hq, Nqb, Nkb) (:func:`selection_reference` or the kernel's).
    Returns:
      (B, Sq, Hq, D) ``out_dtype``.
    """
    dt = kq.dtype
    b, hq, d = q.shape[0], q.shape[2], q.shape[3]
    group = hq // kq.shape[1]
    kk = (head_major(k, k.shape[1], dt), kq)
    vv = (head_major(v, v.shape[1], dt), vq)
    bk = config.block
    nqb, nkb = selected.shape[2], selected.shape[3]
    sq_pad = nqb * bk
    qf = head_major(q.astype(jnp.float32), sq_pad)
    # query blocks as a batch axis (B, Hq, Nqb, bk, D): a query block's rows share their key-block order, so each
    # step gathers one key block per query block and multiplies tiles, as the kernel does
    q16, qfq = (x.reshape(b, hq, nqb, bk, d) for x in (qf.astype(dt), nvfp4.fake_quant_last(qf).astype(dt)))
    kk, vv = ([jnp.repeat(x, group, axis=1) if group > 1 else x for x in pair] for pair in (kk, vv))
    c = scale * LOG2E
    rows = jnp.arange(sq_pad).reshape(nqb, bk, 1)
    counts = jnp.asarray(valid_key_blocks(sq_len, sk_len, bk, causal))
    order = block_order(selected, counts).astype(jnp.int32)  # (B, Hq, Nqb, Nkb)
    n_high = jnp.sum(selected, axis=-1)  # (B, Hq, Nqb)
    n_low = counts - n_high
    mm = lambda a, b: _exact_dot("bhnqd,bhnkd->bhnqk", a, b)  # noqa: E731
    pv = lambda p, v: _exact_dot("bhnqk,bhnkd->bhnqd", p.astype(dt), v)  # noqa: E731
    offsets = jnp.arange(bk)

    def gather(x, blocks):
        """Key block ``blocks`` (B, Hq, Nqb) of x (B, Hq, Sk_pad, D) for every query block: (B, Hq, Nqb, bk, D)."""
        idx = (blocks[..., None] * bk + offsets).reshape(b, hq, nqb * bk, 1)
        return jnp.take_along_axis(x, idx, axis=2).reshape(b, hq, nqb, bk, d)

    def step(carry, i):
        blocks = jax.lax.dynamic_index_in_dim(order, i, axis=3, keepdims=False)  # (B, Hq, Nqb)
        low = (i < n_low)[..., None, None]
        active = (i < counts)[:, None, None]
        cols = (blocks[..., None] * bk + offsets)[..., None, :]  # (B, Hq, Nqb, 1, bk)
        s = jnp.where(low, mm(qfq, gather(kk[1], blocks)), mm(q16, gather(kk[0], blocks))) * c
        s = jnp.where(visible(rows, cols, sq_len, sk_len, causal) & active, s, -jnp.inf)

        def update(p):
            return jnp.where(low, pv(nvfp4.fake_quant_last(p, nonnegative=True), gather(vv[1], blocks)),
                             pv(p, gather(vv[0], blocks)))

        return _online_step(carry, s, update), None

    init = (jnp.zeros((b, hq, nqb, bk, d), jnp.float32), jnp.full((b, hq, nqb, bk), -jnp.inf, jnp.float32),
            jnp.zeros((b, hq, nqb, bk), jnp.float32))
    (acc, _, l), _ = jax.lax.scan(step, init, jnp.arange(nkb))
    o = (acc * int8.reciprocal_or_zero(l)[..., None]).reshape(b, hq, sq_pad, d)
    return jnp.swapaxes(o, 1, 2)[:, :sq_len].astype(out_dtype)


# ----------------------------------------------------------------------------- decode


def decode_rows(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """Query tokens as the decode kernel's rows: (B, T, Hq, D) → (B, Hkv, rows, D), row ``g·T + t`` holding
    query head ``hkv·G + g`` at token t, zero rows appended up to ``rows``."""
    b, t, hq, d = q.shape
    group = hq // num_kv_heads
    x = jnp.transpose(q.reshape(b, t, num_kv_heads, group, d), (0, 2, 3, 1, 4)).reshape(b, num_kv_heads, group * t, d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, rows - group * t), (0, 0)))


def decode_outputs(o_rows: jax.Array, t: int, num_heads: int) -> jax.Array:
    """Inverse of :func:`decode_rows`: (B, Hkv, rows, D) → (B, T, Hq, D)."""
    b, hkv, _, d = o_rows.shape
    group = num_heads // hkv
    x = o_rows[:, :, : group * t].reshape(b, hkv, group, t, d)
    return jnp.transpose(x, (0, 3, 1, 2, 4)).reshape(b, t, num_heads, d)


def row_positions(length: jax.Array, t: int, group: int, rows: int) -> jax.Array:
    """Absolute position of each decode row's query token (``length − T + t``; −1 for padding rows): int32
    (rows,). A row sees the keys at positions ≤ its own."""
    r = jnp.arange(rows)
    return jnp.where(r < group * t, length - t + r % t, -1).astype(jnp.int32)


def decode_usable(cache, tokens: int) -> jax.Array:
    """bool scalar: whether a decode of ``tokens`` new tokens may read ``cache`` (a
    :class:`lowbit_jax.ThriftKVCache`): it holds them and never overflowed. Under ``jit`` the decode returns NaN
    everywhere otherwise, not values from a bad state."""
    return (cache.length >= tokens) & ~cache.overflow


def decode_scores(q: jax.Array, k_mean: jax.Array) -> jax.Array:
    """Each cached key block's importance for the new tokens: ``max over the group's heads and tokens of q·k̄``.

    Args:
      q: (B, T, Hq, D) the new query tokens; k_mean: (B, Hkv, Nkb_max, D) float32 block means of the cache.
    Returns:
      float32 (B, Hkv, Nkb_max).
    """
    hkv = k_mean.shape[1]
    rows = decode_rows(q.astype(jnp.float32), hkv, q.shape[1] * (q.shape[2] // hkv))
    return jnp.max(jnp.einsum("bhrd,bhkd->bhrk", rows, k_mean, precision=jax.lax.Precision.HIGHEST), axis=2)


def decode_budget(length: jax.Array, *, budget: float, block: int) -> tuple[jax.Array, jax.Array]:
    """(complete blocks ``n = length // block``, 16-bit blocks ``min(⌊f·n + ½⌋, n)``), int32 scalars."""
    n_complete = length // block
    take = jnp.floor(budget * n_complete.astype(jnp.float32) + 0.5).astype(jnp.int32)
    return n_complete, jnp.minimum(take, n_complete)


def decode_selection(q: jax.Array, k_mean: jax.Array, length: jax.Array, *, budget: float, block: int) -> jax.Array:
    """Which complete key blocks run in 16-bit, per (batch, kv head); shared by both implementations.

    Args:
      q: (B, T, Hq, D) the new query tokens; k_mean: (B, Hkv, Nkb_max, D) float32 block means of the cache.
      length: int32 scalar, tokens in the cache (the T new ones included).
      budget: f in [0, 1]; block: the cache's block.
    Returns:
      bool (B, Hkv, Nkb_max): the top ``⌊f·n + ½⌋`` of the ``n = length // block`` complete blocks by
      :func:`decode_scores`, ties to the lower index.
    """
    return decode_top_blocks(decode_scores(q, k_mean), *decode_budget(length, budget=budget, block=block))


def decode_top_blocks(scores: jax.Array, n_complete: jax.Array, take: jax.Array) -> jax.Array:
    """bool, scores' shape (..., Nkb): the ``take`` highest-scoring of the first ``n_complete`` blocks, ties to the
    lower index (:func:`decode_budget`'s counts; the rule of :func:`decode_selection`)."""
    return _top_blocks(scores, jnp.arange(scores.shape[-1]) < n_complete, take)


def split_bounds(count: jax.Array, splits: int) -> jax.Array:
    """Entries per split when ``count`` entries of :func:`block_order` are cut into ``splits`` contiguous runs
    (split s takes entries ``[s·per, min((s+1)·per, count))``)."""
    return (count + splits - 1) // splits


def combine_splits(*groups: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """Merge the splits' partial softmaxes: each group acc (..., splits, R, D), m and l (..., splits, R) float32 →
    (..., R, D). Several groups (two kernels' runs) merge as their concatenation along the split axis would,
    without it."""
    m_all = functools.reduce(jnp.maximum, [jnp.max(m, axis=-2, keepdims=True) for _, m, _ in groups])
    m_ref = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    num = den = 0.0
    for acc, m, l in groups:
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_ref))
        num = num + jnp.sum(acc * w[..., None], axis=-3)
        den = den + jnp.sum(l * w, axis=-2)
    return num * int8.reciprocal_or_zero(den)[..., None]


def dequantized_cache(k4: jax.Array, k4_scale: jax.Array, v4: jax.Array, v4_scale: jax.Array, block: int):
    """K̃, Ṽ (B, Hkv, S_max, D) float32 from the 4-bit cache (:class:`lowbit_jax.ThriftKVCache` layout)."""
    k_codes = nvfp4.unpack_halves(k4)  # (B, Hkv, S, D)
    kf = nvfp4.e2m1_decode(k_codes) * jnp.repeat(k4_scale.astype(jnp.float32), nvfp4.GROUP, axis=-1)
    b, h, rows, _ = v4.shape
    d, half = k4.shape[-1] * 2, block // 2
    v_codes = nvfp4.unpack_halves(v4.reshape(b, h, rows // d, d, half))  # (B, H, nb, D, blk)
    v_codes = jnp.swapaxes(v_codes, -1, -2).reshape(b, h, rows // d * 2 * half, d)
    vf = nvfp4.e2m1_decode(v_codes) * jnp.repeat(v4_scale.astype(jnp.float32), nvfp4.GROUP, axis=-2)
    return kf, vf


def decode_reference(q: jax.Array, k16: jax.Array, v16: jax.Array, k4: jax.Array, k4_scale: jax.Array,
                     v4: jax.Array, v4_scale: jax.Array, selected: jax.Array, length: jax.Array, *, scale: float,
                     config: ThriftConfig) -> jax.Array:
    """Twin of :func:`pallas_kernels.thrift_decode.thrift_decode`.

    Args:
      q: (B, T, Hq, D); k16, v16: (B, S_max, Hkv, D) the 16-bit cache; k4 … v4_scale: the 4-bit cache;
      selected: bool (B, Hkv, Nkb_max) (:func:`decode_selection`); length: int32 scalar.
    Returns:
      (B, T, Hq, D) in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = k16.shape[2]
    group = hq // hkv
    bk = config.block
    lo_splits, hi_splits = config.split_counts()
    nkb = k16.shape[1] // bk
    dt = mma_dtype(q.dtype)
    rows = decode_rows(q.astype(jnp.float32), hkv, group * t)
    q16, qfq = rows.astype(dt), nvfp4.fake_quant_last(rows).astype(dt)
    kf, vf = dequantized_cache(k4, k4_scale, v4, v4_scale, bk)
    kh, vh = (jnp.swapaxes(x, 1, 2) for x in (k16, v16))
    pos = row_positions(length, t, group, group * t)
    n_blocks = (length + bk - 1) // bk
    n_high = jnp.sum(selected, axis=-1)  # (B, Hkv), the same everywhere
    n_low = n_blocks - n_high
    order = block_order(selected, n_blocks).astype(jnp.int32)
    per_lo, per_hi = split_bounds(n_low, lo_splits), split_bounds(n_high, hi_splits)
    c = scale * LOG2E
    mm = lambda a, b: _exact_dot("bhrd,bhkd->bhrk", a, b.astype(dt))  # noqa: E731
    pv = lambda p, v: _exact_dot("bhrk,bhkd->bhrd", p.astype(dt), v.astype(dt))  # noqa: E731
    gather = lambda x, j: jnp.take_along_axis(x, (j[:, :, None] * bk + jnp.arange(bk))[..., None], axis=2)  # noqa: E731
    splits = lo_splits + hi_splits

    def step(carry, i):
        acc, m, l = carry  # (B, Hkv, splits, R[, D])
        j = order[:, :, i]  # (B, Hkv)
        low = (i < n_low)[:, :, None, None]
        s = jnp.where(low, mm(qfq, gather(kf, j)), mm(q16, gather(kh, j))) * c
        cols = j[:, :, None, None] * bk + jnp.arange(bk)
        s = jnp.where((cols <= pos[:, None]) & (i < n_blocks), s, -jnp.inf)
        split = jnp.where(i < n_low, i // jnp.maximum(per_lo, 1),
                          lo_splits + (i - n_low) // jnp.maximum(per_hi, 1))  # (B, Hkv)
        here = (jnp.arange(splits) == split[..., None])[..., None]  # (B, Hkv, splits, 1)
        pick = lambda x: jnp.sum(jnp.where(here[..., None] if x.ndim == 5 else here, x, 0.0), axis=2)  # noqa: E731

        def update(p):
            return jnp.where(low, pv(nvfp4.fake_quant_last(p, nonnegative=True), gather(vf, j)), pv(p, gather(vh, j)))

        m_old = jnp.max(jnp.where(here, m, -jnp.inf), axis=2)
        acc_new, m_new, l_new = _online_step((pick(acc), m_old, pick(l)), s, update)
        return (jnp.where(here[..., None], acc_new[:, :, None], acc), jnp.where(here, m_new[:, :, None], m),
                jnp.where(here, l_new[:, :, None], l)), None

    r = group * t
    init = (jnp.zeros((b, hkv, splits, r, d), jnp.float32), jnp.full((b, hkv, splits, r), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, splits, r), jnp.float32))
    (acc, m, l), _ = jax.lax.scan(step, init, jnp.arange(nkb))
    return decode_outputs(combine_splits((acc, m, l)), t, hq).astype(q.dtype)


__all__ = [
    "block_means", "block_order", "combine_splits", "decode_budget", "decode_outputs", "decode_reference",
    "decode_rows", "decode_scores", "decode_selection", "decode_top_blocks", "dequantized_cache",
    "fake_quant_operand", "prefill_reference", "row_positions", "selection_reference", "split_bounds", "topk_count",
    "valid_key_blocks",
]
