"""Flax NNX models using lowbit_jax attention."""

from models.attention import METHODS, Attention
from models.presets import PRESETS, model_config
from models.transformer import ModelConfig, TransformerLM

__all__ = ["METHODS", "PRESETS", "Attention", "ModelConfig", "TransformerLM", "model_config"]
