"""ThriftAttention's implementations behind one seam: Triton kernels or XLA (the reference), picked per call by
:mod:`lowbit_jax._registry`.

Each implementation does the four steps of the method its own way: the selection of the 16-bit block pairs, the
NVFP4 operands of the prefill, the prefill itself and the decode over a :class:`lowbit_jax.ThriftKVCache`. The
Triton one also owns its layouts: the selection kernel's padded rows and scoring chunks, the prefill's key-block
order, the decode kernel's query rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax._registry import pick, require
from lowbit_jax.qat_reference import mma_dtype, padded
from lowbit_jax.thrift_cache import ThriftKVCache
from lowbit_jax.thrift_reference import (
    block_means,
    block_order,
    decode_budget,
    decode_reference,
    decode_rows,
    decode_scores,
    decode_selection,
    decode_top_blocks,
    decode_usable,
    fake_quant_operand,
    prefill_reference,
    row_positions,
    selection_reference,
    valid_key_blocks,
)
from pallas_kernels import fake_quant as fake_quant_kernels
from pallas_kernels import thrift_combine
from pallas_kernels import thrift_decode as thrift_decode_kernels
from pallas_kernels import thrift_decode_mosaic
from pallas_kernels._mosaic import on_hopper
from pallas_kernels import thrift_prefill as thrift_prefill_kernels
from pallas_kernels import thrift_scalars
from pallas_kernels import thrift_select as thrift_select_kernels
from pallas_kernels.configs import ThriftConfig, next_pow2
from pallas_kernels.numerics import nvfp4


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


class ThriftCall(NamedTuple):
    """What picking an implementation looks at."""

    implementation: str
    interpret: bool


class XlaThrift:
    """The pure-JAX reference (:mod:`lowbit_jax.thrift_reference`): the same quantization, selection and block
    order on whole arrays."""

    name = "xla"

    def supports(self, call: ThriftCall) -> None:
        require(call.implementation == "xla", "implementation is not 'xla'")

    def selection(self, q, k, opts: ThriftOptions) -> jax.Array:
        """bool (B, Hq, Nqb, Nkb): the 16-bit block pairs."""
        cfg = opts.config
        counts = valid_key_blocks(opts.seq_q, opts.seq_k, cfg.block, opts.causal)
        return selection_reference(block_means(q, cfg.block), block_means(k, cfg.block), counts, opts.topk)

    def fake_quant(self, x, *, seq_pad: int, along: str, dtype, opts: ThriftOptions) -> jax.Array:
        return fake_quant_operand(x, seq_pad=seq_pad, along=along, dtype=dtype)

    def prefill(self, q, k, ops: tuple, opts: ThriftOptions) -> jax.Array:
        return prefill_reference(q, *ops, self.selection(q, k, opts), sq_len=opts.seq_q, sk_len=opts.seq_k,
                                 causal=opts.causal, scale=opts.scale, config=opts.config, out_dtype=q.dtype)

    def decode(self, q, cache: ThriftKVCache, *, budget: float, scale: float, config: ThriftConfig,
               interpret: bool) -> jax.Array:
        sel = decode_selection(q, cache.k_mean, cache.length, budget=budget, block=config.block)
        o = decode_reference(q, cache.k, cache.v, cache.k4, cache.k4_scale, cache.v4, cache.v4_scale, sel,
                             cache.length, scale=scale, config=config)
        return jnp.where(decode_usable(cache, q.shape[1]), o, jnp.nan).astype(q.dtype)


class TritonThrift:
    """:mod:`pallas_kernels.thrift_select`, ``fake_quant``, ``thrift_prefill`` and ``thrift_decode``."""

    name = "triton"

    def supports(self, call: ThriftCall) -> None:
        require(call.implementation == "pallas", "implementation is not 'pallas'")

    def selection(self, q, k, opts: ThriftOptions) -> jax.Array:
        """int8 (B, Hq, Nqb_pad, Nkb_pad): the 16-bit block pairs, padded as the selection kernel writes them."""
        cfg = opts.config
        qm = block_means(q, cfg.block)
        return _select_kernel(_pad_blocks(qm, padded(qm.shape[2], cfg.select_rows)),
                              _select_keys(block_means(k, cfg.block), cfg), 0, opts)

    def fake_quant(self, x, *, seq_pad: int, along: str, dtype, opts: ThriftOptions) -> jax.Array:
        cfg = opts.config
        return fake_quant_kernels.fp4_fake_quant_heads(x, seq_pad=seq_pad, block=cfg.quant_block, out_dtype=dtype,
                                                       along=along, num_warps=cfg.quant_warps,
                                                       interpret=opts.interpret)

    def prefill(self, q, k, ops: tuple, opts: ThriftOptions) -> jax.Array:
        return prefill_kernels(q, k, ops, opts)

    def decode(self, q, cache: ThriftKVCache, *, budget: float, scale: float, config: ThriftConfig,
               interpret: bool) -> jax.Array:
        t, hq = q.shape[1], q.shape[2]
        rows = t * (hq // cache.num_kv_heads)  # the kernels leave the padding rows below r_pad unwritten
        r_pad, row_tile = decode_layout(rows)
        scalars = decode_scalars(q, cache, budget=budget, block=config.block, r_pad=r_pad)
        args = decode_kernel_args(q, cache, scalars, interpret=interpret)
        groups = decode_partials(args, scale=scale, config=config, row_tile=row_tile, rows=rows, interpret=interpret)
        return thrift_combine.combine_decode(groups, scalars, rows=rows, tokens=t, num_heads=hq, out_dtype=q.dtype,
                                             interpret=interpret)


IMPLEMENTATIONS = (TritonThrift(), XlaThrift())


def implementation_for(implementation: str, interpret: bool):
    """The first of :data:`IMPLEMENTATIONS` that covers the call."""
    return pick(IMPLEMENTATIONS, ThriftCall(implementation, interpret))


# ----------------------------------------------------------------------------- the Triton implementation's layouts


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


def prefill_kernels(q: jax.Array, k: jax.Array, ops: tuple, opts: ThriftOptions) -> jax.Array:
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


def decode_partials(args: tuple, *, scale: float, config: ThriftConfig, row_tile: int, rows: int,
                    interpret: bool) -> tuple[thrift_combine.Partials, ...]:
    """The split-KV kernels on :func:`decode_kernel_args`'s ``args``: one
    :class:`pallas_kernels.thrift_combine.Partials` a kernel, each of R_pad rows of which the first ``rows`` are
    written. One from :func:`pallas_kernels.thrift_decode.thrift_decode`; with :func:`takes_mosaic_decode`, the
    4-bit runs from the Mosaic GPU kernel (transposed; its own row tile, :func:`mosaic_row_tile`) and then the
    16-bit ones from the Triton kernel."""
    triton = functools.partial(thrift_decode_kernels.thrift_decode, *args, scale=scale, config=config,
                               row_tile=row_tile, rows=rows, interpret=interpret)
    tile = mosaic_row_tile(rows)
    if not takes_mosaic_decode(config, head_dim=args[0].shape[-1], row_tile=tile, interpret=interpret):
        return (thrift_combine.Partials(*triton()),)
    _, qf_rows, scalars, _, _, k4, k4_scale, v4, v4_scale, order = args
    low = thrift_decode_mosaic.thrift_decode_low(qf_rows, scalars, order, k4, k4_scale, v4, v4_scale,
                                                 scale=scale, config=config, row_tile=tile, rows=rows,
                                                 interpret=interpret)
    return thrift_combine.Partials(*low, transposed=True), thrift_combine.Partials(*triton(only_high=True))


def decode_scalars(q: jax.Array, cache: ThriftKVCache, *, budget: float, block: int, r_pad: int) -> jax.Array:
    """The decode kernels' scalars in one int32 (R_pad + 8,) vector, one small launch for all of them
    (:mod:`pallas_kernels.thrift_scalars`): each query row's token position
    (:func:`lowbit_jax.thrift_reference.row_positions`), then the header: the complete and the valid key blocks,
    the 16-bit ones (:func:`lowbit_jax.thrift_reference.decode_budget`) and the 4-bit ones per (batch, kv head),
    and whether the cache is usable (:func:`decode_usable`); its other entries are 0.

    Args:
      q: (B, T, Hq, D) the new query tokens; cache: the :class:`ThriftKVCache` they attend to;
      budget, block: the decode's; r_pad: the padded query rows (:func:`decode_layout`).
    """
    n_complete, n_high = decode_budget(cache.length, budget=budget, block=block)
    n_blocks = (cache.length + block - 1) // block
    header = [jnp.int32(0)] * thrift_scalars.HEADER
    for entry, value in ((thrift_scalars.N_LOW, n_blocks - n_high), (thrift_scalars.N_HIGH, n_high),
                         (thrift_scalars.USABLE, decode_usable(cache, q.shape[1])),
                         (thrift_scalars.N_COMPLETE, n_complete), (thrift_scalars.N_BLOCKS, n_blocks)):
        header[entry] = jnp.asarray(value, jnp.int32)
    positions = row_positions(cache.length, q.shape[1], q.shape[2] // cache.num_kv_heads, r_pad)
    return jnp.concatenate([positions, jnp.stack(header)])


def mosaic_row_tile(rows: int) -> int:
    """Query rows a CTA of the Mosaic decode kernel: the ``wgmma`` N, the rows up to a power of two from 8 (a GQA
    group of 4 and one token fill half of 8 columns, not a quarter of the Triton kernel's 16), 64 beyond."""
    return 64 if rows > 64 else max(8, next_pow2(rows))


def takes_mosaic_decode(config: ThriftConfig, *, head_dim: int, row_tile: int, interpret: bool) -> bool:
    """Whether a decode call runs its 4-bit runs in the Mosaic GPU kernel (``config.decode_backend``: "mosaic" where
    the kernel covers the call, "auto" where it also runs compiled on an sm_90 GPU)."""
    if config.decode_backend == "triton" or (config.decode_backend == "auto" and (interpret or not on_hopper())):
        return False
    return thrift_decode_mosaic.supports(head_dim=head_dim, block=config.block, row_tile=row_tile)


def decode_layout(rows: int) -> tuple[int, int]:
    """(padded rows, rows per program) of a decode call with ``rows`` = group × tokens."""
    if rows <= 64:
        r = max(16, next_pow2(rows))
        return r, r
    return padded(rows, 64), 64


def decode_order(q: jax.Array, cache: ThriftKVCache, scalars: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The decode kernels' key-block order for the new tokens ``q`` (B, T, Hq, D), given the step's
    :func:`decode_scalars` (the block counts are read from them).

    The selection (:func:`lowbit_jax.thrift_reference.decode_selection`) and its
    :func:`lowbit_jax.thrift_reference.block_order`, in the selection kernel
    :func:`pallas_kernels.thrift_select.thrift_decode_order` up to its
    :data:`~pallas_kernels.thrift_select.DECODE_ORDER_MAX_BLOCKS` key blocks, by XLA beyond (the same values).

    Returns:
      int16 (B, Hkv, Nkb_pad) the order (Nkb_pad: the cache's blocks up to a power of two).
    """
    scores = _padded_scores(q, cache)
    if _order_in_kernel(cache):
        return thrift_select_kernels.thrift_decode_order(scores, scalars, interpret=interpret)
    header = scalars[thrift_scalars.padded_rows(scalars):]
    top = decode_top_blocks(scores, header[thrift_scalars.N_COMPLETE], header[thrift_scalars.N_HIGH])
    return block_order(top, header[thrift_scalars.N_BLOCKS])


def _order_in_kernel(cache: ThriftKVCache) -> bool:
    """Whether the order kernel takes the cache's key blocks (up to a power of two)."""
    return next_pow2(cache.k_mean.shape[2]) <= thrift_select_kernels.DECODE_ORDER_MAX_BLOCKS


def _padded_scores(q: jax.Array, cache: ThriftKVCache) -> jax.Array:
    """:func:`lowbit_jax.thrift_reference.decode_scores` padded to a power of two of key blocks."""
    scores = decode_scores(q, cache.k_mean)
    return jnp.pad(scores, ((0, 0), (0, 0), (0, next_pow2(scores.shape[-1]) - scores.shape[-1])))


def decode_kernel_args(q: jax.Array, cache: ThriftKVCache, scalars: jax.Array, *, interpret: bool = False) -> tuple:
    """The arguments of :func:`pallas_kernels.thrift_decode.thrift_decode` before its options: the query rows
    (16-bit and fake-quantized, R_pad = ``scalars``' positions), the step's :func:`decode_scalars`, the cache's
    arrays and the order (:func:`decode_order`). For one new token and a power-of-two group the order kernel lays
    out the rows too (their padding rows unwritten); else XLA does (:func:`lowbit_jax.thrift_reference.decode_rows`,
    zero padding rows)."""
    r_pad = thrift_scalars.padded_rows(scalars)
    group = q.shape[2] // cache.num_kv_heads
    if q.shape[1] == 1 and group == next_pow2(group) and _order_in_kernel(cache):
        order, q_rows, qf_rows = thrift_select_kernels.thrift_decode_order(
            _padded_scores(q, cache), scalars, q[:, 0], rows_dtype=mma_dtype(q.dtype), interpret=interpret)
    else:
        order = decode_order(q, cache, scalars, interpret=interpret)
        rows = decode_rows(q.astype(jnp.float32), cache.num_kv_heads, r_pad)
        q_rows, qf_rows = rows.astype(mma_dtype(q.dtype)), nvfp4.fake_quant_last(rows).astype(jnp.float16)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731
    return (q_rows, qf_rows, scalars,
            cache.k, cache.v, cache.k4, bits(cache.k4_scale), cache.v4, bits(cache.v4_scale), order)
