"""Flax NNX models using lowbit_jax attention: byte-level presets and pretrained Llama-family checkpoints."""

from models.attention import METHODS, Attention
from models.presets import PRESETS, model_config
from models.pretrained import PretrainedError, TextTokenizer, from_pretrained, pretrained_config, smollm2_path
from models.transformer import ModelConfig, TransformerLM

__all__ = ["METHODS", "PRESETS", "Attention", "ModelConfig", "PretrainedError", "TextTokenizer", "TransformerLM",
           "from_pretrained", "model_config", "pretrained_config", "smollm2_path"]
