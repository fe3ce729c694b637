"""``from_pretrained``: a checkpoint's tensors into a :class:`models.TransformerLM` of its architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from models.pretrained.checkpoint import Checkpoint
from models.pretrained.errors import PretrainedError
from models.pretrained.gguf_file import read_gguf
from models.pretrained.hf import read_hf
from models.pretrained.tokenizer import TextTokenizer
from models.transformer import ARCHITECTURE_FIELDS, ModelConfig, TransformerLM


def read_checkpoint(path: str | Path, *, with_tensors: bool = True) -> Checkpoint:
    """A Hugging Face directory or a GGUF file, told apart by what ``path`` is."""
    p = Path(path)
    if p.is_dir():
        return read_hf(p, with_tensors=with_tensors)
    if not p.exists():
        raise PretrainedError(p, "does not exist (a Hugging Face model directory or a .gguf file)")
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise PretrainedError(p, "is neither a directory nor a GGUF file (no GGUF magic)")
    return read_gguf(p, with_tensors=with_tensors)


def pretrained_config(path: str | Path | Checkpoint, *, method: str = "dense", dtype: str = "bfloat16",
                      **overrides: Any) -> ModelConfig:
    """The :class:`models.ModelConfig` of a checkpoint (metadata only, no tensor read; ``path`` may be a checkpoint
    :func:`read_checkpoint` has read already).

    ``overrides`` set run options (``max_len``, ``remat``, ``smooth_k``, ``fuse_qk_prologue``); architecture fields
    cannot be overridden (the weights fix them).
    """
    ckpt = path if isinstance(path, Checkpoint) else read_checkpoint(path, with_tensors=False)
    return _config(ckpt, method=method, dtype=dtype, **overrides)


def _config(ckpt: Checkpoint, *, method: str, dtype: str, **overrides: Any) -> ModelConfig:
    fixed = sorted(set(overrides) & set(ARCHITECTURE_FIELDS))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} cannot be overridden: the checkpoint's weights fix them")
    return ModelConfig(**dict(ckpt.fields, method=method, dtype=dtype, **overrides))


class _Layout(NamedTuple):
    """How one parameter is made: from ``names`` (Hugging Face tensors) by ``build``; ``shapes(parameter shape)``
    gives the shape each tensor must have."""

    names: tuple[str, ...]
    build: Callable[..., np.ndarray]
    shapes: Callable[[tuple], list[tuple]]


def _same(*names):
    return _Layout(names, lambda w: w, lambda s: [s])


def _linear(*names):  # Linear weights (out, in) → kernels (in, out)
    return _Layout(names, lambda w: w.T, lambda s: [s[::-1]])


def _layouts(cfg: ModelConfig) -> dict[tuple, _Layout]:
    """Our parameter path → its :class:`_Layout`; gate and up become one kernel [gate | up]."""
    out = {("embed", "embedding"): _same("model.embed_tokens.weight"), ("norm", "scale"): _same("model.norm.weight")}
    if not cfg.tie_embeddings:
        out[("lm_head", "kernel")] = _linear("lm_head.weight")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", ("blocks", i)
        out[(*ours, "attn_norm", "scale")] = _same(hf + "input_layernorm.weight")
        out[(*ours, "mlp_norm", "scale")] = _same(hf + "post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[(*ours, "attn", proj, "kernel")] = _linear(f"{hf}self_attn.{proj}.weight")
        if cfg.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                out[(*ours, "attn", proj, "bias")] = _same(f"{hf}self_attn.{proj}.bias")
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[(*ours, "attn", norm, "scale")] = _same(f"{hf}self_attn.{norm}.weight")
        out[(*ours, "gate_up", "kernel")] = _Layout(
            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            lambda g, u: np.concatenate([g.T, u.T], axis=1), lambda s: [(s[1] // 2, s[0])] * 2)
        out[(*ours, "down", "kernel")] = _linear(hf + "mlp.down_proj.weight")
    return out


#: tensors a checkpoint may carry that the model recomputes
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _params(ckpt: Checkpoint, cfg: ModelConfig, abstract: dict) -> dict:
    layouts = _layouts(cfg)
    used = set()
    out = {}
    for path, leaf in abstract.items():
        if path not in layouts:
            raise PretrainedError(ckpt.path, f"the model has parameter {'.'.join(map(str, path))} that no tensor "
                                  "fills (an architecture this loader does not know)")
        names, build, shapes = layouts[path]
        tensors = [ckpt.tensor(n) for n in names]
        for name, tensor, want in zip(names, tensors, shapes(tuple(leaf.shape))):
            if tensor.shape != want:
                raise PretrainedError(ckpt.file_of(name), f"tensor {name} has shape {tensor.shape}, but the "
                                      f"architecture its config gives needs {want}")
            if not np.isfinite(tensor).all():
                raise PretrainedError(ckpt.file_of(name), f"tensor {name} holds NaN or inf")
        value = build(*tensors)
        used.update(names)
        out[path] = jnp.asarray(value, leaf.dtype)
    extra = sorted(n for n in set(ckpt.tensors) - used if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise PretrainedError(ckpt.file_of(extra[0]), f"tensor {extra[0]} has no place in the architecture its config "
                              f"gives ({len(extra)} such tensors)")
    return out


def from_pretrained(path: str | Path | Checkpoint, *, method: str = "dense", dtype: str = "bfloat16",
                    attention_options: dict | None = None,
                    **overrides: Any) -> tuple[TransformerLM, TextTokenizer]:
    """A pretrained Llama-family model (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3) and its tokenizer.

    Args:
      path: a Hugging Face directory (config.json, *.safetensors with or without an index, tokenizer.json) or a
        GGUF file (quantized tensors are dequantized; llama.cpp's q/k row order is undone), or such a checkpoint as
        :func:`read_checkpoint` returns it (read once by a caller that also wants its config).
      method: the attention method ("dense", "sage", "qat_fp4", "thrift"); any works on the loaded weights.
      dtype: compute dtype ("bfloat16", "float16", "float32"); parameters are float32.
      attention_options: keyword options of the attention function (e.g. ``{"budget": 0.1}`` for thrift).
      overrides: run options of :class:`models.ModelConfig` (``max_len``: the KV caches' length, default the
        checkpoint's context; ``remat``, ``smooth_k``, ``fuse_qk_prologue``).
    Returns:
      (model, tokenizer): ``model(tokens int (B, S))`` → float32 logits (B, S, vocab).
    Raises:
      PretrainedError: one line naming the file (and tensor): missing file, unsupported architecture, a tensor of
        the wrong shape, NaN weights.
    """
    ckpt = path if isinstance(path, Checkpoint) else read_checkpoint(path)
    cfg = _config(ckpt, method=method, dtype=dtype, **overrides)
    abstract_model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0), attention_options=attention_options))
    graphdef, state = nnx.split(abstract_model)
    params = _params(ckpt, cfg, flatten_dict(nnx.to_pure_dict(state)))
    nnx.replace_by_pure_dict(state, unflatten_dict(params))
    return nnx.merge(graphdef, state), ckpt.tokenizer()

