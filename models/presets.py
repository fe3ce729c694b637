"""Named model sizes (byte vocabulary)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.transformer import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # CPU demo: seconds per step on 2 cores
    "tiny": ModelConfig(dim=128, num_layers=2, num_heads=2, num_kv_heads=1, mlp_hidden=384, max_len=256),
    "small": ModelConfig(dim=256, num_layers=4, num_heads=4, num_kv_heads=2, mlp_hidden=704, max_len=512),
    # ~50M parameters, the GPU benchmark model (issue: tokens/s and MFU at sequence 2048)
    "50m": ModelConfig(dim=640, num_layers=11, num_heads=10, num_kv_heads=5, mlp_hidden=1728, max_len=2048),
    # ~300M parameters at head dim 128 and sequence 8k: a model in whose training step attention weighs more
    "300m": ModelConfig(dim=1024, num_layers=24, num_heads=8, num_kv_heads=4, mlp_hidden=2816, max_len=8192),
}


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """A preset with field overrides, e.g. ``model_config("tiny", method="dense")``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
