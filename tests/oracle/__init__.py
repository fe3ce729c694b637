"""Independent float64 numpy oracles of docs/spec.md: they share no code with ``lowbit_jax`` or
``pallas_kernels`` (numpy and ml_dtypes only), so a test that compares the library with them compares two
implementations, not one with itself."""
