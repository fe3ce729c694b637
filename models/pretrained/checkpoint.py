"""What a reader hands the loader: the architecture, the tensors by their Hugging Face names, the tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

from models.pretrained.errors import PretrainedError


@dataclasses.dataclass
class Checkpoint:
    """A pretrained checkpoint, read but not yet loaded.

    Attributes:
      path: the directory or file, for messages.
      fields: :class:`models.ModelConfig` fields of its architecture (:data:`models.transformer.ARCHITECTURE_FIELDS`)
        and ``max_len`` (its context length).
      tensors: Hugging Face name (``model.layers.0.self_attn.q_proj.weight``) → (the file it is in, a function
        returning it as float32 numpy in Hugging Face's layout: Linear weights (out, in), q/k rows in the
        rotate-half order).
      tokenizer: a function building its :class:`models.pretrained.TextTokenizer`.
    """

    path: Path
    fields: dict[str, Any]
    tensors: dict[str, tuple[Path, Callable[[], np.ndarray]]]
    tokenizer: Callable[[], Any]

    def tensor(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise PretrainedError(self.path, f"tensor {name} is missing")
        return self.tensors[name][1]()

    def file_of(self, name: str) -> Path:
        return self.tensors[name][0] if name in self.tensors else self.path


def llama3_freq_factors(head_dim: int, base: float, *, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> tuple[float, ...]:
    """Llama-3 rope scaling as D/2 divisors of RoPE's inverse frequencies: long wavelengths (beyond the original
    context / low_freq_factor) divided by ``factor``, short ones (below context / high_freq_factor) kept, the band
    between interpolated smoothly."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    ctx = original_max_position_embeddings
    smooth = (ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = np.where(wavelen > ctx / low_freq_factor, inv / factor,
                      np.where(wavelen < ctx / high_freq_factor, inv, (1 - smooth) * inv / factor + smooth * inv))
    return tuple(float(x) for x in (inv / scaled).astype(np.float32))  # float32, as a GGUF file holds them
