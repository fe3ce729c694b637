"""lowbit-jax: trainable low-bit attention for JAX (INT8 SageAttention/SageBwd, NVFP4 Attn-QAT, ThriftAttention).

Public names only; see README.md.
"""

from lowbit_jax import formats
from pallas_kernels.numerics import int8, nvfp4
from pallas_kernels.numerics.qk_prologue import QKPrologue, rope_tables
from lowbit_jax.reference import cos_sim, error_metrics, reference_attention, rel_l1, rel_l2, rmse
from lowbit_jax.sage import SageOptions, sage_attention, sage_forward
from lowbit_jax.qat import qat_attention
from lowbit_jax.thrift import MAX_DECODE_ROWS as THRIFT_DECODE_MAX_ROWS
from lowbit_jax.thrift import thrift_attention, thrift_decode, thrift_select
from lowbit_jax.dense import cached_attention, dense_attention
from lowbit_jax.block_sparse import block_sparse_attention
from lowbit_jax.thrift_cache import ThriftKVCache
from lowbit_jax import diagnostics
from pallas_kernels.configs import QatConfig, SageFwdConfig, ThriftConfig, qat_config, sage_fwd_config

__version__ = "0.1.0"

__all__ = [
    "THRIFT_DECODE_MAX_ROWS",
    "block_sparse_attention",
    "cached_attention",
    "dense_attention",
    "QatConfig",
    "qat_attention",
    "qat_config",
    "SageFwdConfig",
    "SageOptions",
    "diagnostics",
    "cos_sim",
    "error_metrics",
    "formats",
    "int8",
    "nvfp4",
    "reference_attention",
    "rel_l1",
    "rel_l2",
    "rmse",
    "sage_attention",
    "QKPrologue",
    "rope_tables",
    "sage_forward",
    "sage_fwd_config",
    "ThriftConfig",
    "ThriftKVCache",
    "thrift_attention",
    "thrift_decode",
    "thrift_select",
]
