"""The one error a pretrained checkpoint can raise: a line naming the file (and the tensor or field)."""

from __future__ import annotations

from pathlib import Path


class PretrainedError(ValueError):
    """A checkpoint that cannot be loaded: missing file, unsupported architecture, a tensor of the wrong shape."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


def need(module: str):
    """Import an optional dependency of the pretrained loaders, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"loading pretrained checkpoints needs the {module.split('.')[0]!r} package: "
                          f"pip install 'lowbit-jax[train]'") from None
