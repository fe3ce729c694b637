"""Which tiles a flash-attention program visits: the causal/ragged tile bounds, in one place.

The causal mask is bottom-right aligned (query i sees key j iff j ≤ i + Sk − Sq).
Tiles are split into the ones every row of the program sees entirely (no mask
arithmetic) and the few masked ones (causal diagonal, ragged tail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp



def visible(rows: jax.Array, cols: jax.Array, sq_len: int, sk_len: int, causal: bool) -> jax.Array:
    """bool mask: key ``cols`` exists and (if causal) query ``rows`` sees it, bottom-right aligned.

    Broadcasts: pass ``rows[:, None], cols[None, :]`` for a (queries, keys) tile or the
    transposes for (keys, queries). Used by the kernels and the pure-JAX references alike.
    """
    mask = cols < sk_len
    if causal:
        mask = mask & (cols <= rows + (sk_len - sq_len))
    return mask


def key_tile_range(q_start, *, block_q: int, block_k: int, sq_len: int, sk_len: int,
                   causal: bool) -> tuple[jax.Array | int, jax.Array | int]:
    """For a query tile starting at ``q_start``: (number of unmasked key tiles, number of visited key tiles).

    Key tiles ``[0, n_unmasked)`` need no mask; ``[n_unmasked, n_total)`` do.
    """
    n_all = -(-sk_len // block_k)
    n_unmasked_max = sk_len // block_k
    if not causal:
        return n_unmasked_max, n_all
    offset = sk_len - sq_len
    last_visible = q_start + block_q + offset  # one past the last key the tile's last row sees
    n_total = jnp.clip((last_visible + block_k - 1) // block_k, 0, n_all)
    first_row_sees = jnp.maximum(q_start + offset + 1, 0)  # keys every row of the tile sees
    n_unmasked = jnp.minimum(jnp.minimum(first_row_sees // block_k, n_unmasked_max), n_total)
    return n_unmasked, n_total


def query_tile_range(k_start, *, block_q: int, block_k: int, sq_len: int, sk_len: int, causal: bool,
                     n_qblocks: int) -> tuple[jax.Array | int, jax.Array | int]:
    """For a key tile starting at ``k_start``: (first query tile that sees any of its keys,
    first query tile that sees all of them). Query tiles before the second bound need the mask."""
    if not causal:
        return 0, 0
    offset = sk_len - sq_len
    i_first = jnp.clip((k_start - offset) // block_q, 0, n_qblocks)
    i_unmasked = jnp.clip((k_start + block_k - 1 - offset + block_q - 1) // block_q, i_first, n_qblocks)
    return i_first, i_unmasked


def selectable_key_blocks(q_start, *, block: int, sq_len: int, sk_len: int, causal: bool, xp=jnp):
    """Key blocks (of ``block`` keys) a query block starting at ``q_start`` may select in ThriftAttention: all of
    them, or if causal (bottom-right aligned) those holding a key the block's last real row sees, a prefix count.

    ``q_start`` may be a scalar or an array of block starts; ``xp`` is ``jnp`` in kernels and references, ``numpy``
    where the count must be static (the budget's k).
    """
    n_kb = -(-sk_len // block)
    if not causal:
        return xp.full(xp.shape(q_start), n_kb, xp.int32) if xp.ndim(q_start) else n_kb
    last = xp.minimum(q_start + block, sq_len) - 1 + (sk_len - sq_len)  # the last key the block's last row sees
    return xp.clip(xp.floor_divide(last, block) + 1, 0, n_kb)
