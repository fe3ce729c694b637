"""The quantization formats (re-exported from :mod:`pallas_kernels.numerics`, the layer both the kernels and the
references build on)."""

from pallas_kernels.numerics import int8, nvfp4, qk_prologue, sage_tiles, smoothing

__all__ = ["int8", "nvfp4", "qk_prologue", "sage_tiles", "smoothing"]
