"""A Llama-family forward pass in float64 numpy, written from the Hugging Face model definitions (Llama, Qwen2,
Qwen3): the oracle of the pretrained loaders. It reads Hugging Face tensor names and config.json keys and shares
no code with the package."""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def inverse_frequencies(config: dict) -> np.ndarray:
    """RoPE's inverse frequencies (D/2,), with Llama-3 or linear rope scaling when config.json asks for it."""
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv = 1.0 / config.get("rope_theta", 10000.0) ** (np.arange(0, d, 2) / d)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        return inv / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        out = inv.copy()
        for i, f in enumerate(inv):
            wavelength = 2 * np.pi / f
            if wavelength > old / lo:
                out[i] = f / factor
            elif old / hi <= wavelength <= old / lo:
                s = (old / wavelength - lo) / (hi - lo)
                out[i] = (1 - s) * f / factor + s * f
        return out
    return inv


def _rope(x, inv):
    """x (S, H, D), rotate-half."""
    ang = np.arange(x.shape[0])[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def forward(weights: dict[str, np.ndarray], config: dict, tokens) -> np.ndarray:
    """Logits float64 (S, vocab) of one int sequence (S,).

    ``config``: config.json's keys (``model_type`` "llama", "qwen2" or "qwen3"), ``weights``: Hugging Face names.
    """
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    c = config
    h, hkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    d = c.get("head_dim") or c["hidden_size"] // h
    eps = c.get("rms_norm_eps", 1e-6)
    inv = inverse_frequencies(c)
    s = len(tokens)
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        y = _rms(x, w[p + "input_layernorm.weight"], eps)
        proj = {}
        for name, heads in (("q", h), ("k", hkv), ("v", hkv)):
            z = y @ w[f"{p}self_attn.{name}_proj.weight"].T
            if f"{p}self_attn.{name}_proj.bias" in w:
                z = z + w[f"{p}self_attn.{name}_proj.bias"]
            proj[name] = z.reshape(s, heads, d)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if p + "self_attn.q_norm.weight" in w:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, inv), _rope(k, inv)
        out = np.empty((s, h, d))
        for head in range(h):
            kv = head // (h // hkv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            prob = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (prob / prob.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(s, h * d) @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T
