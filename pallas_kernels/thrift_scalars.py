"""ThriftAttention decode: the step's scalars, one int32 vector that every decode kernel reads.

:func:`lowbit_jax.thrift_backends.decode_scalars` computes it in one small launch (in XLA each scalar of its own
was a launch, each costing more than its bytes in a decode step): the position of each query row's token (R_pad
entries, −1 for padding rows; :func:`lowbit_jax.thrift_reference.row_positions`), then a header of
:data:`HEADER` entries named below. A kernel takes the header as the block ``R_pad / HEADER`` of (HEADER,) entries
(:func:`header_block`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: header entries: the 4-bit and the 16-bit key blocks per (batch, kv head), whether the cache is usable (0 gives
#: NaN everywhere), the complete (selectable) key blocks and the blocks holding any token
N_LOW, N_HIGH, USABLE, N_COMPLETE, N_BLOCKS = range(5)
#: header length: 32 bytes, a whole TMA copy, and a block that divides R_pad (a multiple of 8)
HEADER = 8


def check_scalars(scalars: jax.Array, r_pad: int) -> None:
    """ValueError unless ``scalars`` is an int32 vector of ``r_pad`` + :data:`HEADER` entries, ``r_pad`` a multiple
    of :data:`HEADER` (the header is then a whole block)."""
    if r_pad % HEADER or scalars.shape != (r_pad + HEADER,) or scalars.dtype != jnp.int32:
        raise ValueError(f"scalars must be int32 ({r_pad} + {HEADER},) for {r_pad} query rows (a multiple of "
                         f"{HEADER}), got {scalars.dtype} {scalars.shape}")


def padded_rows(scalars) -> int:
    """R_pad, the query rows whose positions lead ``scalars`` (an array or a ref of (R_pad + :data:`HEADER`,))."""
    return scalars.shape[0] - HEADER


def header_block(r_pad: int) -> int:
    """The header's block index for a BlockSpec of (:data:`HEADER`,) entries, after ``r_pad`` positions."""
    return r_pad // HEADER
