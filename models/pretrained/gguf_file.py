"""A GGUF file (llama.cpp): metadata, tensors dequantized to float32 and renamed to Hugging Face's names, with
llama.cpp's reordering of the q/k rows undone, and the vocabulary as a tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from models.pretrained.checkpoint import Checkpoint
from models.pretrained.errors import PretrainedError, need
from models.pretrained.tokenizer import TextTokenizer

#: general.architecture values read, and whether llama.cpp's converter interleaved their q/k rows
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
BLOCK = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
         "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
         "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
         "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None: not a weight of these architectures)."""
    if name in TOP:
        return TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK:
        return f"model.layers.{parts[1]}.{BLOCK[parts[2]]}"
    return None


def rotate_half_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it stores each head's rows as interleaved pairs (x0, x_{D/2}, x1, ...) for
    its RoPE; Hugging Face and our kernels rotate halves (x0..x_{D/2−1} | x_{D/2}..x_{D−1}), and the low-bit
    methods quantize along the head dimension in that order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _field(reader, path: Path, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise PretrainedError(path, f"metadata {key} is missing")
        return default
    return f.contents()


def read_gguf(path: Path, *, with_tensors: bool = True) -> Checkpoint:
    """The checkpoint in a GGUF file (memory-mapped; tensors dequantized when asked for)."""
    gguf = need("gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: numpy/struct errors naming no file
        raise PretrainedError(path, f"not a readable GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    arch = _field(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise PretrainedError(path, f"general.architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    by_name = {t.name: t for t in reader.tensors}
    meta = lambda key, default=None: _field(reader, path, f"{arch}.{key}", default)  # noqa: E731
    dim, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", dim // heads))
    tokens = _field(reader, path, "tokenizer.ggml.tokens", [])
    fields = dict(vocab_size=int(meta("vocab_size", len(tokens) or 0)) or int(by_name["token_embd.weight"].shape[1]),
                  dim=dim, num_layers=int(meta("block_count")), num_heads=heads, num_kv_heads=kv_heads,
                  mlp_hidden=int(meta("feed_forward_length")), max_len=int(meta("context_length", 2048)),
                  qk_norm="blk.0.attn_q_norm.weight" in by_name, rope_base=_f32(meta("rope.freq_base", 10000.0)),
                  head_dim=None if head_dim * heads == dim else head_dim,
                  norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
                  tie_embeddings="output.weight" not in by_name, qkv_bias="blk.0.attn_q.bias" in by_name,
                  rope_freq_factors=None)
    scaling = meta("rope.scaling.type", "none")
    if "rope_freqs.weight" in by_name:  # Llama-3 rope scaling, as llama.cpp stores it: the divisors themselves
        fields["rope_freq_factors"] = tuple(float(x) for x in _dequantize(gguf, by_name["rope_freqs.weight"]))
    elif scaling == "linear":
        fields["rope_freq_factors"] = (float(meta("rope.scaling.factor")),) * (head_dim // 2)
    elif scaling != "none":
        raise PretrainedError(path, f"{arch}.rope.scaling.type {scaling!r} is not supported (linear, llama3 are)")

    def load(t, heads_of_rows):
        w = _dequantize(gguf, t)
        return rotate_half_rows(w, heads_of_rows) if heads_of_rows else w

    tensors = {}
    for name, t in by_name.items() if with_tensors else ():
        hf = hf_name(name)
        if hf is None:
            if name != "rope_freqs.weight":
                raise PretrainedError(path, f"tensor {name} is not a weight of a {arch} model this loader knows")
            continue
        permuted = ARCHITECTURES[arch] and name.endswith(("attn_q.weight", "attn_k.weight"))
        rows_heads = (heads if name.endswith("attn_q.weight") else kv_heads) if permuted else 0
        tensors[hf] = (path, lambda t=t, h=rows_heads: load(t, h))
    eos = _field(reader, path, "tokenizer.ggml.eos_token_id", -1)

    def tokenizer():
        if not tokens:
            raise PretrainedError(path, "has no tokenizer.ggml.tokens: no vocabulary to tokenize with")
        return TextTokenizer.from_gguf_vocab(
            path, model=_field(reader, path, "tokenizer.ggml.model"), pre=_field(reader, path, "tokenizer.ggml.pre",
                                                                                 "default"),
            tokens=tokens, token_types=_field(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens)),
            merges=_field(reader, path, "tokenizer.ggml.merges", []), eos_id=None if eos < 0 else int(eos))

    return Checkpoint(path, fields, tensors, tokenizer)


def _dequantize(gguf, t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (GGUF lists dimensions fastest first)."""
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
