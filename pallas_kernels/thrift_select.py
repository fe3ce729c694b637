"""ThriftAttention block selection: one fused kernel scores q̄_i·k̄_j and keeps the top k per query block.

docs/spec.md, ThriftAttention; the rule is :func:`lowbit_jax.thrift_reference.selection_reference`'s (its twin). A
program owns ``select_rows`` query blocks of one (batch, head). Sort and top_k do not lower to Triton, so
the k-th largest score of each row is found by bisection on its bits: the float32 scores are mapped to
int32 keys in the same order (``bits ^ ((bits >> 31) & 0x7fffffff)``, with ±0 as one key), and the
threshold t is built bit by bit from the top, keeping a bit where at least k keys are still ≥ t (32 count
passes over the row). The selected blocks are those above t, then as many of those equal to t as are
still missing, lowest index first (a running cumsum): exactly "the k largest, ties to the lower index".
The scores are recomputed from q̄ and k̄ (a float32-accurate product, :data:`SCORE_PRECISION`) in each pass
when a row spans several ``select_chunk`` chunks, and computed once otherwise (rows up to
``ThriftConfig.select_whole`` key blocks are one chunk); the (Nqb × Nkb) score
matrix is never written.

:func:`thrift_decode_order` is the decode's selection: one program per (batch, kv head) takes the top blocks of
its row of scores by the same bisection and writes the block order the decode kernel walks
(:func:`lowbit_jax.thrift_reference.block_order` of that selection), in place of an XLA sort, two cumsums and
a scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._triton import compiler_params, pl
from pallas_kernels.numerics import nvfp4
from pallas_kernels.thrift_scalars import (HEADER, N_BLOCKS, N_COMPLETE, N_HIGH, check_scalars, header_block,
                                           padded_rows)
from pallas_kernels.numerics.tile_ranges import selectable_key_blocks

DOT_NT = (((1,), (1,)), ((), ()))
INT_MIN = -(2**31)
#: the score product on the GPU: three TF32 tensor-core products (float32-accurate). Triton's default for
#: float32 operands, one TF32 product (10-bit inputs), flipped near-tied selections against the twin on the
#: H200 (2 of 9024 pairs at S3000); IEEE float32 (no tensor cores) made the kernel 42x slower at S16384 (0.52 ->
#: 21.8 ms). Interpret mode (CPU, where XLA has no TF32) computes the float32 product exactly.
SCORE_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _ordered_keys(scores: jax.Array) -> jax.Array:
    """int32 keys in the order of the float32 scores (non-NaN), +0 and −0 mapped to one key."""
    bits = lax.bitcast_convert_type(scores, jnp.int32)
    keys = bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFFFFFF)
    return jnp.where(scores == 0.0, 0, keys)


def _kth_key(count_at_least, want: jax.Array) -> jax.Array:
    """The ``want``-th largest key of a row (of each row, for vectors): the largest int32 t with
    ``count_at_least(t) >= want``, built bit by bit from the top (32 count passes). ``want`` ≥ 1 gives a key
    of the row; ``want`` = 0 gives 2**31 − 1."""
    zero = jnp.zeros_like(want)  # strongly typed: a weak-typed int32 loop carry fails the Triton lowering
    t = jnp.where(count_at_least(zero) >= want, zero, zero + INT_MIN)

    def bit(b, t):
        cand = t | lax.shift_left(jnp.int32(1), 30 - b)
        return jnp.where(count_at_least(cand) >= want, cand, t)

    return lax.fori_loop(0, 31, bit, t)


def _select_kernel(first_ref, qm_ref, km_ref, out_ref, *, rows, chunk, n_chunks, block, sq_len, sk_len, causal, k,
                   n_qblocks, precision):
    i0 = first_ref[0] + pl.program_id(0) * rows
    qblk = i0 + jnp.arange(rows, dtype=jnp.int32)
    counts = selectable_key_blocks(qblk * block, block=block, sq_len=sq_len, sk_len=sk_len, causal=causal)
    counts = jnp.where(qblk < n_qblocks, counts, 0)
    want = jnp.minimum(counts, k)
    qm = qm_ref[...]

    def keys_of(c):
        km = km_ref[pl.ds(c * chunk, chunk), :]
        scores = lax.dot_general(qm, km, DOT_NT, precision=precision, preferred_element_type=jnp.float32)
        cols = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return jnp.where(cols[None, :] < counts[:, None], _ordered_keys(scores), INT_MIN)

    cached = keys_of(0) if n_chunks == 1 else None
    chunk_keys = (lambda c: cached) if n_chunks == 1 else keys_of  # noqa: E731

    def count(pred):
        """Σ over the row's chunks of pred(keys) — (rows,) int32."""
        def body(c, total):
            return total + jnp.sum(pred(chunk_keys(c)).astype(jnp.int32), axis=1)
        return lax.fori_loop(0, n_chunks, body, jnp.zeros((rows,), jnp.int32))

    t = _kth_key(lambda t: count(lambda key: key >= t[:, None]), want)
    need = want - count(lambda key: key > t[:, None])  # keys equal to t still to take, lowest index first

    def write(c, ties_before):
        key = chunk_keys(c)
        eq = key == t[:, None]
        rank = jnp.cumsum(eq.astype(jnp.int32), axis=1) + ties_before[:, None]
        take = (key > t[:, None]) | (eq & (rank <= need[:, None]))
        out_ref[:, pl.ds(c * chunk, chunk)] = take.astype(out_ref.dtype)
        return ties_before + jnp.sum(eq.astype(jnp.int32), axis=1)

    lax.fori_loop(0, n_chunks, write, jnp.zeros((rows,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("block", "sq_len", "sk_len", "causal", "k", "rows", "chunk",
                                             "num_warps", "interpret"))
def thrift_select(q_mean: jax.Array, k_mean: jax.Array, first_block: jax.Array | int = 0, *, block: int, sq_len: int,
                  sk_len: int, causal: bool, k: int, rows: int, chunk: int, num_warps: int = 4,
                  interpret: bool = False) -> jax.Array:
    """The 16-bit key blocks of ``q_mean``'s query blocks.

    Args:
      q_mean: (B, Hq, Nq, D) float32 means of the query blocks from ``first_block`` on, Nq a multiple of
        ``rows`` (rows past the real ``ceil(sq_len / block)`` blocks select nothing).
      first_block: int32 scalar, the first row's query block (may be traced: one kernel for every chunk).
      k_mean: (B, Hkv, Nkb_pad, D) float32 key-block means, Nkb_pad a multiple of ``chunk``.
      block: the selection block; sq_len, sk_len, causal: real lengths and the bottom-right mask.
      k: blocks per query block (:func:`lowbit_jax.thrift_reference.topk_count`; rows with fewer valid
        blocks take them all).
      rows, chunk: query blocks per program, key blocks per scoring step (powers of two ≥ 16).
    Returns:
      int8 (B, Hq, Nq, Nkb_pad): 1 where the pair runs in 16-bit.
    """
    b, hq, nq_pad, d = q_mean.shape
    hkv, nk_pad = k_mean.shape[1], k_mean.shape[2]
    group = hq // hkv
    kernel = functools.partial(_select_kernel, rows=rows, chunk=chunk, n_chunks=nk_pad // chunk, block=block,
                               sq_len=sq_len, sk_len=sk_len, causal=causal, k=k, n_qblocks=-(-sq_len // block),
                               precision=lax.Precision.HIGHEST if interpret else SCORE_PRECISION)
    return pl.pallas_call(
        kernel,
        grid=(nq_pad // rows, b, hq),
        in_specs=[pl.BlockSpec((1,), lambda i, bi, hi: (0,)),
                  pl.BlockSpec((None, None, rows, d), lambda i, bi, hi: (bi, hi, i, 0)),
                  pl.BlockSpec((None, None, nk_pad, d), lambda i, bi, hi: (bi, hi // group, 0, 0))],
        out_specs=pl.BlockSpec((None, None, rows, nk_pad), lambda i, bi, hi: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hq, nq_pad, nk_pad), jnp.int8),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="thrift_select",
    )(jnp.asarray(first_block, jnp.int32).reshape(1), q_mean, k_mean)


#: longest row of key blocks :func:`thrift_decode_order` takes (8 per thread at its 32 warps)
DECODE_ORDER_MAX_BLOCKS = 8192


def decode_order_warps(n_blocks: int) -> int:
    """Warps of :func:`thrift_decode_order` for a row of ``n_blocks`` (a power of two): 8 values per thread,
    4 to 32 warps."""
    return max(4, min(32, n_blocks // 256))


def _decode_order_kernel(header_ref, scores_ref, *refs, group):
    order_ref = refs[0] if group is None else refs[1]
    n = scores_ref.shape[0]
    n_complete, want, n_blocks = header_ref[N_COMPLETE], header_ref[N_HIGH], header_ref[N_BLOCKS]
    j = jnp.arange(n, dtype=jnp.int32)
    keys = jnp.where(j < n_complete, _ordered_keys(scores_ref[...]), INT_MIN)
    count = lambda pred: jnp.sum(pred.astype(jnp.int32))  # noqa: E731
    t = _kth_key(lambda t: count(keys >= t), want)
    eq = keys == t
    selected = (keys > t) | (eq & (jnp.cumsum(eq.astype(jnp.int32)) <= want - count(keys > t)))
    low = (j < n_blocks) & ~selected
    position = jnp.where(low, jnp.cumsum(low.astype(jnp.int32)) - 1,
                         jnp.where(selected, count(low) + jnp.cumsum(selected.astype(jnp.int32)) - 1, j))
    order_ref[position] = j.astype(order_ref.dtype)  # a permutation: every entry written once
    if group is not None:  # the kv head's query rows: its group's heads (the rows below R_pad stay unwritten)
        q_ref, rows_ref, fq_ref = refs[0], refs[2], refs[3]
        x = q_ref[pl.ds(pl.program_id(1) * group, group), :].astype(jnp.float32)
        rows_ref[pl.ds(0, group), :] = x.astype(rows_ref.dtype)
        fq_ref[pl.ds(0, group), :] = nvfp4.fake_quant_last(x).astype(fq_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows_dtype", "interpret"))
def thrift_decode_order(scores: jax.Array, scalars: jax.Array, q: jax.Array | None = None, *,
                        rows_dtype=jnp.bfloat16,
                        interpret: bool = False) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """The decode's key-block order from its block scores, in one kernel; given ``q``, the decode rows too.

    Args:
      scores: float32 (B, Hkv, N): each key block's :func:`lowbit_jax.thrift_reference.decode_scores`, N a power
        of two ≤ :data:`DECODE_ORDER_MAX_BLOCKS` (entries from ``n_complete`` on are ignored).
      scalars: int32 (R_pad + 8,) the decode's scalars (:mod:`pallas_kernels.thrift_scalars`); read from its
        header: ``n_complete`` (:data:`~pallas_kernels.thrift_scalars.N_COMPLETE`), the complete blocks (the
        selectable ones); ``take`` (:data:`~pallas_kernels.thrift_scalars.N_HIGH`) ≤ n_complete, the 16-bit blocks
        per row; ``n_blocks`` (:data:`~pallas_kernels.thrift_scalars.N_BLOCKS`), the blocks holding any token.
      q: optional (B, Hq, D) one new token's queries (Hq = Hkv · G, G a power of two ≤ R_pad): the kernel also
        lays out the decode rows (:func:`lowbit_jax.thrift_reference.decode_rows` of that token) and
        fake-quantizes them, two launches fewer than XLA's; ``rows_dtype`` the 16-bit rows' dtype. Rows G to R_pad
        are padding, left unwritten: the decode kernels never use them (their position is −1).
    Returns:
      int16 (B, Hkv, N): :func:`lowbit_jax.thrift_reference.block_order` of the ``take`` top-scoring complete
      blocks (ties to the lower index) with ``n_blocks`` valid — the unselected valid blocks, then the selected
      ones, each ascending, then the others. Given ``q``, also the rows (B, Hkv, R_pad, D) in ``rows_dtype`` and
      float16 φ⁻¹(φ(rows)).
    """
    b, hkv, n = scores.shape
    r_pad = padded_rows(scalars)
    check_scalars(scalars, r_pad)
    head = lambda shape: pl.BlockSpec((None, None, *shape), lambda bi, hi: (bi, hi) + (0,) * len(shape))  # noqa: E731
    in_specs = [pl.BlockSpec((HEADER,), lambda bi, hi: (header_block(r_pad),)), head((n,))]
    out_specs, out_shape, args, group = [head((n,))], [jax.ShapeDtypeStruct((b, hkv, n), jnp.int16)], [], None
    if q is not None:
        g = q.shape[1] // hkv if q.ndim == 3 else 0
        if q.ndim != 3 or q.shape[0] != b or q.shape[1] != g * hkv or g & (g - 1) or not 0 < g <= r_pad:
            raise ValueError(f"thrift_decode_order: q must be (B, Hkv·G, D), G a power of two ≤ {r_pad}, got "
                             f"{q.shape}")
        group, d = g, q.shape[2]
        in_specs.append(pl.BlockSpec((None, q.shape[1], d), lambda bi, hi: (bi, 0, 0)))
        out_specs += [head((r_pad, d))] * 2
        out_shape += [jax.ShapeDtypeStruct((b, hkv, r_pad, d), rows_dtype),
                      jax.ShapeDtypeStruct((b, hkv, r_pad, d), jnp.float16)]
        args.append(q)
    out = pl.pallas_call(
        functools.partial(_decode_order_kernel, group=group),
        grid=(b, hkv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(decode_order_warps(n), 1),
        interpret=interpret,
        name="thrift_decode_order",
    )(scalars, scores, *args)
    return out[0] if q is None else tuple(out)
