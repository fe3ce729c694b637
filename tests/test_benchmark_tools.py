"""benchmarks/profiling.py: interval union, grouping, and a trace (on the CPU: no GPU plane, no kernels)."""

import jax
import jax.numpy as jnp

from benchmarks.profiling import _union_ns, grouped, profile_calls


def test_union_counts_overlaps_once():
    assert _union_ns([]) == 0
    assert _union_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _union_ns([(20, 30), (0, 10), (10, 12)]) == 22  # unsorted, touching


def test_grouped_first_matching_group_wins():
    kernels = {"sage_bwd_dkdv": (2.0, 1), "nvjet_sm90_gemm": (1.5, 3), "loop_add_fusion": (0.5, 2)}
    groups = {"attention": ("sage",), "matmul": ("gemm", "nvjet")}
    assert grouped(kernels, groups) == {"attention": 2.0, "matmul": 1.5, "other": 0.5}


def test_profile_calls_traces_a_jitted_function():
    f = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jax.random.normal(jax.random.key(0), (64, 64))
    f(x).block_until_ready()
    prof = profile_calls(lambda: f(x).block_until_ready(), calls=2)
    assert prof["wall_ms"] > 0 and prof["calls"] == 2
    if jax.default_backend() == "cpu":  # host-only trace: no GPU stream events
        assert prof["kernels"] == {} and prof["busy_ms"] == 0
    else:
        assert prof["busy_ms"] > 0 and prof["kernel_ms"] >= prof["busy_ms"] * 0.99
