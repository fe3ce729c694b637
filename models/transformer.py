"""Decoder-only transformer LM of the Llama family (pre-norm RMSNorm, RoPE, GQA, SwiGLU) in Flax NNX: our byte-level
presets, and pretrained checkpoints (:func:`models.from_pretrained`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from models.attention import Attention, check_method


#: ``ModelConfig.remat``: what each block keeps for the backward pass (``jax.checkpoint`` policies through
#: ``nnx.remat``). "none": every residual (the attention kernels' INT8 operands, O and the LSE included);
#: "block": only the block's input, the block's forward is recomputed in the backward (quantization and
#: attention forward too); "dots": the outputs of the projection and MLP matmuls, the rest recomputed.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and attention choices of a :class:`TransformerLM`.

    ``remat`` trades compute for memory per block (:data:`REMAT_POLICIES`): "none" (default), "block"
    or "dots". It changes no value, only what the backward pass recomputes.

    The last five fields describe pretrained architectures (their defaults are our presets'): ``head_dim`` when it
    is not ``dim // num_heads`` (Qwen3), ``norm_eps`` of every RMSNorm, ``tie_embeddings`` (False: an output
    projection of its own), ``qkv_bias`` (Qwen2's q/k/v biases) and ``rope_freq_factors``, the D/2 divisors of
    RoPE's inverse frequencies (Llama-3 rope scaling; None: all 1).
    """

    vocab_size: int = 256
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    mlp_hidden: int = 704
    max_len: int = 512
    method: str = "sage"
    qk_norm: bool = True
    smooth_k: bool = True
    rope_base: float = 10000.0
    dtype: str = "bfloat16"
    remat: str = "none"
    fuse_qk_prologue: bool = True  # sage, qat_fp4: QK-norm and RoPE inside their quantize kernels (same values)
    head_dim: int | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_method(self.method)
        if self.rope_freq_factors is not None:  # a list from a JSON checkpoint config: hashable again
            object.__setattr__(self, "rope_freq_factors", tuple(float(x) for x in self.rope_freq_factors))
            if len(self.rope_freq_factors) != self.head_size // 2:
                raise ValueError(f"rope_freq_factors must hold head_dim/2 = {self.head_size // 2} values, got "
                                 f"{len(self.rope_freq_factors)}")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise ValueError(f"max_len must be a positive integer, got {self.max_len!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
        if (self.head_dim is None and self.dim % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide dim ({self.dim}) unless head_dim is given, "
                             f"and be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_size not in (32, 64, 128, 256):
            raise ValueError(f"head dim must be 32, 64, 128 or 256 (the kernels' tiles), got {self.head_size}")

    @property
    def head_size(self) -> int:
        """The head dimension: ``head_dim``, or ``dim // num_heads`` when that is None."""
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    def num_params(self) -> int:
        d, h = self.dim, self.head_size
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + (2 * h if self.qk_norm else 0)
        attn += h * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        mlp = 3 * d * self.mlp_hidden
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + self.num_layers * (attn + mlp + 2 * d) + d


#: the :class:`ModelConfig` fields that are the architecture (a checkpoint's weights fix them; the others are run
#: options)
ARCHITECTURE_FIELDS = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden", "qk_norm",
                       "rope_base", "head_dim", "norm_eps", "tie_embeddings", "qkv_bias", "rope_freq_factors")


#: vocabularies up to this size are embedded by a one-hot product (:func:`embed_tokens`)
ONE_HOT_MAX_VOCAB = 4096


def embed_tokens(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """``embed(tokens)`` with a gradient that is a matrix product, not a scatter-add.

    For a small vocabulary (a byte-level model has 256 rows) the gather's gradient is a scatter-add
    in which every row index repeats thousands of times per batch; on the H200 that one scatter took
    50 ms of an 82 ms training step of the 50m preset (B16 S2048, ``benchmarks/breakdown.py``). As
    ``one_hot(tokens) @ table`` the forward is exact (one nonzero term per output, float32
    accumulation) and the gradient is a (vocab × tokens) · (tokens × dim) product. Vocabularies
    above :data:`ONE_HOT_MAX_VOCAB` use the gather.

    Args:
      embed: the model's ``nnx.Embed`` (its ``dtype`` is the compute dtype).
      tokens: int (..., S).
    Returns:
      (..., S, dim) in ``embed.dtype``.
    """
    vocab = embed.num_embeddings
    if vocab > ONE_HOT_MAX_VOCAB:
        return embed(tokens)
    dtype = embed.dtype or embed.embedding[...].dtype
    onehot = jax.nn.one_hot(tokens, vocab, dtype=dtype)
    table = embed.embedding[...].astype(dtype)
    return jnp.einsum("...v,vd->...d", onehot, table, preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def swiglu(gate_up: jax.Array) -> jax.Array:
    """silu(gate) · up for ``gate_up`` = [gate, up] along the last axis: (..., 2H) → (..., H).

    The gradient is one elementwise expression over a (..., 2, H) view of ``gate_up`` (float32
    arithmetic, cast once), with no concatenation for XLA to leave as a kernel of its own: autodiff
    of ``split`` + ``silu(gate) * up`` wrote the gate and up gradients separately and joined them
    with a stand-alone concatenate.
    """
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate_up):
    return swiglu(gate_up), gate_up


def _swiglu_bwd(gate_up, dy):
    x = gate_up.astype(jnp.float32).reshape(*gate_up.shape[:-1], 2, gate_up.shape[-1] // 2)
    gate, up = x[..., :1, :], x[..., 1:, :]  # (..., 1, H) each, broadcast over the pair axis below
    dy = dy.astype(jnp.float32)[..., None, :]
    sig = jax.nn.sigmoid(gate)
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
    d_up = dy * gate * sig
    first = lax.broadcasted_iota(jnp.int32, (2, 1), 0) == 0
    return (jnp.where(first, d_gate, d_up).reshape(gate_up.shape).astype(gate_up.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, attention_options: dict | None, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg.dim, cfg.num_heads, cfg.num_kv_heads, method=cfg.method, qk_norm=cfg.qk_norm,
                              smooth_k=cfg.smooth_k, rope_base=cfg.rope_base, dtype=dtype,
                              fuse_qk_prologue=cfg.fuse_qk_prologue, head_dim=cfg.head_size,
                              qkv_bias=cfg.qkv_bias, norm_eps=cfg.norm_eps, rope_freq_factors=cfg.rope_freq_factors,
                              attention_options=attention_options, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.norm_eps, dtype=dtype, rngs=rngs)
        self.gate_up = nnx.Linear(cfg.dim, 2 * cfg.mlp_hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_hidden, cfg.dim, use_bias=False, dtype=dtype, rngs=rngs)

    def mlp(self, x):
        return self.down(swiglu(self.gate_up(self.mlp_norm(x))))

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(x)

    def decode(self, x, cache):
        return self._with_cache(x, cache, self.attn.decode)

    def prefill(self, x, cache):
        return self._with_cache(x, cache, self.attn.prefill)

    def _with_cache(self, x, cache, attend):
        y, cache = attend(self.attn_norm(x), cache)
        x = x + y
        return x + self.mlp(x), cache


class TransformerLM(nnx.Module):
    """Decoder LM: byte-level from a preset, or a pretrained Llama-family model (:func:`models.from_pretrained`).

    ``model(tokens)`` maps int tokens (B, S) to float32 logits (B, S, vocab).
    ``attention_options`` go to every attention call (e.g. ``implementation``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention_options: dict | None = None):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, attention_options, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        nnx.Linear(cfg.dim, cfg.vocab_size, use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs))

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        return (self.embed.attend(x) if self.lm_head is None else self.lm_head(x)).astype(jnp.float32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.shape[-1] > self.cfg.max_len:
            raise ValueError(f"sequence length {tokens.shape[-1]} exceeds the model's max_len {self.cfg.max_len}")
        x = embed_tokens(self.embed, tokens)
        apply = (Block.__call__ if self.cfg.remat == "none"
                 else nnx.remat(Block.__call__, policy=REMAT_POLICIES[self.cfg.remat]))
        for block in self.blocks:
            x = apply(block, x)
        return self._logits(x)

    def init_cache(self, batch: int) -> list[dict]:
        return [b.attn.init_cache(batch, self.cfg.max_len, jnp.dtype(self.cfg.dtype)) for b in self.blocks]

    def decode(self, tokens: jax.Array, cache: list[dict]) -> tuple[jax.Array, list[dict]]:
        """Next-token logits (B, T, vocab) float32 for T new int tokens (B, T) after the cached ones; the new
        caches."""
        return self._through_blocks(tokens, cache, Block.decode)

    def prefill(self, tokens: jax.Array) -> tuple[jax.Array, list[dict]]:
        """A prompt (B, T) int into fresh caches: its logits (B, T, vocab) float32 and the caches.

        The same values as :meth:`decode` from :meth:`init_cache`'s caches, by the empty-cache route alone
        (the thrift method's prefill kernel, so that only that route is compiled; 16-bit causal attention for
        the others, without :func:`models.attention.cached_attention`'s one-slot cached part).
        """
        if tokens.shape[-1] > self.cfg.max_len:
            raise ValueError(f"prompt length {tokens.shape[-1]} exceeds the model's max_len {self.cfg.max_len}")
        return self._through_blocks(tokens, self.init_cache(tokens.shape[0]), Block.prefill)

    def _through_blocks(self, tokens, cache, step):
        x = embed_tokens(self.embed, tokens)
        new = []
        for block, c in zip(self.blocks, cache):
            x, c = step(block, x, c)
            new.append(c)
        return self._logits(x), new
