"""Pallas GPU kernels lowered through Triton. Kernels only: callers validate and dispatch (lowbit_jax)."""
