"""Quantization formats shared by the Pallas kernels and the pure-JAX references.

Imports nothing else of the project (the kernels import it while the package
initializes).
"""

from lowbit_jax.formats import int8, nvfp4, qk_prologue, sage_tiles, smoothing

__all__ = ["int8", "nvfp4", "qk_prologue", "sage_tiles", "smoothing"]
