"""A Hugging Face model directory: config.json, *.safetensors (one file or sharded with an index), tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from models.pretrained.checkpoint import Checkpoint, llama3_freq_factors
from models.pretrained.errors import PretrainedError, need
from models.pretrained.tokenizer import TextTokenizer

#: config.json ``model_type`` → q/k/v biases always on (Qwen2) and QK-norm (Qwen3)
MODEL_TYPES = {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


def _config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise PretrainedError(file, "missing: a Hugging Face model directory has config.json, *.safetensors and "
                              "tokenizer.json")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PretrainedError(file, f"not JSON ({e})") from None


def _fields(cfg: dict, file: Path) -> dict:
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise PretrainedError(file, f"model_type {kind!r} is not supported (Llama family: {', '.join(MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise PretrainedError(file, f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu is)")
    bias, qk_norm = MODEL_TYPES[kind]
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or dim // heads)
        base = float(cfg.get("rope_theta", 10000.0))
        fields = dict(vocab_size=int(cfg["vocab_size"]), dim=dim, num_layers=int(cfg["num_hidden_layers"]),
                      num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                      mlp_hidden=int(cfg["intermediate_size"]), max_len=int(cfg.get("max_position_embeddings", 2048)),
                      qk_norm=qk_norm, rope_base=base, head_dim=None if head_dim * heads == dim else head_dim,
                      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                      qkv_bias=bias or bool(cfg.get("attention_bias", False)), rope_freq_factors=None)
    except KeyError as e:
        raise PretrainedError(file, f"field {e.args[0]} is missing") from None
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        fields["rope_freq_factors"] = llama3_freq_factors(head_dim, base, **{k: scaling[k] for k in keys})
    elif kind == "linear":
        fields["rope_freq_factors"] = (float(scaling["factor"]),) * (head_dim // 2)
    elif kind != "default":
        raise PretrainedError(file, f"rope_scaling type {kind!r} is not supported (llama3, linear are)")
    return fields


def _tensors(path: Path) -> dict:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (json.JSONDecodeError, KeyError) as e:
            raise PretrainedError(index, f"not a safetensors index ({e})") from None
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PretrainedError(path, "no *.safetensors file")
    safe_open = need("safetensors").safe_open
    out = {}
    for file in files:
        if not file.is_file():
            raise PretrainedError(file, "missing (named by model.safetensors.index.json)")
        try:
            with safe_open(str(file), framework="numpy") as f:
                names = list(f.keys())
        except Exception as e:  # the Rust error names no file
            raise PretrainedError(file, f"not a safetensors file ({str(e)[:200]})") from None
        for name in names:
            out[name] = (file, lambda file=file, name=name: _read(file, name))
    return out


def _read(file: Path, name: str) -> np.ndarray:
    with need("safetensors").safe_open(str(file), framework="numpy") as f:
        return np.asarray(f.get_tensor(name), np.float32)


def read_hf(path: Path, *, with_tensors: bool = True) -> Checkpoint:
    """The checkpoint in a Hugging Face directory (tensors read lazily, one at a time)."""
    cfg = _config(path)
    fields = _fields(cfg, path / "config.json")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos

    def tokenizer():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise PretrainedError(file, "missing")
        return TextTokenizer.from_file(file, eos_id=eos)

    return Checkpoint(path, fields, _tensors(path) if with_tensors else {}, tokenizer)
