"""The block-sparse baseline ThriftAttention is measured against: the block pairs :func:`thrift_select` picks, in
16-bit, and the others dropped (not computed in FP4). Pure JAX (XLA), for evaluating quality, not speed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit_jax._x32 import x32
from lowbit_jax.thrift import thrift_select
from pallas_kernels.configs import ThriftConfig


@x32
def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, budget: float = 0.05,
                           scale: float | None = None, config: ThriftConfig | None = None) -> jax.Array:
    """Attention over the selected block pairs only, at the same budget and selection as ThriftAttention.

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) (bf16/fp16/fp32; Hq a multiple of Hkv).
      causal: bottom-right aligned mask. budget: f in [0, 1], as :func:`thrift_attention` (f = 1 is exact
        attention). scale: default 1/√D. config: ``block`` sets the block size.
    Returns:
      (B, Sq, Hq, D) in q's dtype. A query row left with no selected visible key (causal at a small budget
      selects no block for some query blocks; f = 0 for all) attends to nothing: its output is 0.
    """
    selected = thrift_select(q, k, causal=causal, budget=budget, implementation="xla", config=config)
    block = (config or ThriftConfig()).block
    sq, sk = q.shape[1], k.shape[1]
    mask = jnp.repeat(jnp.repeat(selected, block, axis=2)[:, :, :sq], block, axis=3)[:, :, :, :sk]
    if causal:
        mask &= jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
    o = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
    sees = jnp.moveaxis(mask.any(axis=-1), 1, 2)[..., None]  # (B, Sq, Hq, 1); a masked row would average all keys
    return jnp.where(sees, o, 0).astype(o.dtype)
