"""Tiny random pretrained checkpoints written the way their tools write them: Hugging Face directories (safetensors,
one file or sharded with an index; tokenizer.json) and GGUF files (llama.cpp's q/k row order, its rope_freqs, F32
or quantized tensors). Used by tests/test_pretrained.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from oracle.llama import inverse_frequencies

TEXT = ("def add(a, b):\n    return a + b  # 12 + 345 = 357\n\nclass Point:\n    x: float = 0.0\n"
        "The quick brown fox jumps over the lazy dog. ") * 8
EOS = "<|endoftext|>"

#: config.json of each variant (small enough for a CPU test, head dim 64 for every attention method)
BASE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=192, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            hidden_act="silu")
VARIANTS = {
    "llama": dict(BASE, model_type="llama", tie_word_embeddings=True),
    "llama3": dict(BASE, model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64)),
    "qwen2": dict(BASE, model_type="qwen2", tie_word_embeddings=True, num_attention_heads=2, num_key_value_heads=2),
    "qwen3": dict(BASE, model_type="qwen3", tie_word_embeddings=False, head_dim=64, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6),
}


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on :data:`TEXT` (Hugging Face ``tokenizers``), GPT-2's pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 weights of a config.json (norm scales near 1, so that every layer matters)."""
    rng = np.random.default_rng(seed)
    c = config
    dim, h = c["hidden_size"], c["num_attention_heads"]
    hkv, d = c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // h
    normal = lambda *shape, s=0.08: rng.normal(0, s, shape).astype(np.float32)  # noqa: E731
    scale = lambda n: (1 + 0.2 * rng.normal(size=n)).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": normal(c["vocab_size"], dim, s=0.5), "model.norm.weight": scale(dim)}
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(c["vocab_size"], dim)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": scale(dim), p + "post_attention_layernorm.weight": scale(dim),
                  p + "self_attn.q_proj.weight": normal(h * d, dim),
                  p + "self_attn.k_proj.weight": normal(hkv * d, dim),
                  p + "self_attn.v_proj.weight": normal(hkv * d, dim),
                  p + "self_attn.o_proj.weight": normal(dim, h * d),
                  p + "mlp.gate_proj.weight": normal(c["intermediate_size"], dim),
                  p + "mlp.up_proj.weight": normal(c["intermediate_size"], dim),
                  p + "mlp.down_proj.weight": normal(dim, c["intermediate_size"])})
        if c["model_type"] == "qwen2":
            for n, rows in (("q", h * d), ("k", hkv * d), ("v", hkv * d)):
                w[f"{p}self_attn.{n}_proj.bias"] = normal(rows, s=0.3)
        if c["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = scale(d), scale(d)
    return w


def write_hf(folder: Path, config: dict, weights: dict, tokenizer, *, shards: int = 1) -> Path:
    """config.json, model.safetensors (or ``shards`` files and model.safetensors.index.json), tokenizer.json."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config, eos_token_id=0)))
    tokenizer.save(str(folder / "tokenizer.json"))
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n] for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for s, part in enumerate(np.array_split(np.array(names), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reordering of a q or k weight's rows (its ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path: Path, config: dict, weights: dict, tokenizer, *, quant: str | None = None) -> dict:
    """A GGUF file as llama.cpp's converter writes one; ``quant`` (e.g. "Q8_0") quantizes the 2-D weights.

    Returns the Hugging Face-named weights the file holds after its quantization (the oracle's input).
    """
    import gguf

    c = config
    arch = c["model_type"]
    h, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or c["hidden_size"] // h
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(h)
    writer.add_head_count_kv(hkv)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == EOS else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab[EOS])
    held = {}
    if (c.get("rope_scaling") or {}).get("rope_type") == "llama3":
        plain = inverse_frequencies({k: v for k, v in c.items() if k != "rope_scaling"})
        writer.add_tensor("rope_freqs.weight", (plain / inverse_frequencies(c)).astype(np.float32))
    for name, w in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            out = f"blk.{i}.{GGUF_NAMES[rest]}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        stored = w
        if arch == "llama" and out.endswith(("attn_q.weight", "attn_k.weight")):
            stored = llama_cpp_rows(w, h if out.endswith("attn_q.weight") else hkv)
        if quant and w.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(out, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
            # blocks run along rows, so quantizing the reordered rows = reordering the quantized rows
            held[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)
        else:
            writer.add_tensor(out, stored)
            held[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
