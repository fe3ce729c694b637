"""NVFP4's group scale sf = e4m3(amax / 6) on every finite non-negative float32, as each backend compiles it.

Usage (repo root):
    PYTHONPATH=. python benchmarks/nvfp4_scale_check.py              # GPU: XLA, a Pallas-Triton and a Pallas
                                                                     # Mosaic GPU kernel; CPU: XLA (~40 s)
    PYTHONPATH=. python benchmarks/nvfp4_scale_check.py --chunks 1   # the first 2**24 bit patterns only

``lowbit_jax.formats.nvfp4.group_scale`` takes amax/6 without a division (``nvfp4._sixth``) because XLA turns a
division by a constant into a multiply (and a Mosaic GPU kernel's division gave the same values on the H200),
which puts 15 float32 patterns of amax on the wrong side of an e4m3 rounding point. This script is the evidence
that it does not: for every backend it compares ``group_scale(amax, assume_finite=True)`` with e4m3 of numpy's
correctly rounded quotient (``--old`` also counts what ``amax / 6`` compiled by XLA gives). It also checks the
reciprocal 1/sf of every e4m3 value, and (Mosaic GPU) the Attn-QAT kernels' bf16 FQ(P) scales by conversion and
approximate reciprocal on every bf16 amax. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl

from lowbit_jax.formats import nvfp4

CHUNK = 1 << 24  # bit patterns per call
ROWS = CHUNK // 128
LAST_FINITE = 0x7F7FFFFF


def _triton(fn):
    from pallas_kernels._triton import compiler_params

    def body(x_ref, o_ref):
        o_ref[...] = fn(x_ref[...])

    def call(x):
        rows = x.shape[0]
        return pl.pallas_call(body, grid=(rows // 64,), in_specs=[pl.BlockSpec((64, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((64, 128), lambda i: (i, 0)),
                              out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                              compiler_params=compiler_params(4, 1), name="nvfp4_scale_check")(x)
    return call


def _mosaic(fn):
    from pallas_kernels import _mosaic as mos

    def body(x_ref, o_ref, x_s, o_s, bar):
        i = jax.lax.axis_index("x")
        mos.plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * 128, 128)], x_s, bar.at[0])
        mos.plgpu.barrier_wait(bar.at[0])
        o_s[...] = fn(x_s[...])
        mos.copy_out(((o_s, o_ref.at[pl.ds(i * 128, 128)]),))

    def call(x):
        return mos.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, jnp.float32), grid=(x.shape[0] // 128,),
                                grid_names=("x",), scratch_types=[mos.plgpu.SMEM((128, 128), jnp.float32)] * 2
                                + [mos.plgpu.Barrier(num_barriers=1)], compiler_params=mos.compiler_params())(x)
    return call


def backends(names: list[str]) -> dict:
    """name → jitted f((rows, 128) float32) → float32, for group_scale and for the reciprocal."""
    scale = lambda a: nvfp4.group_scale(a, assume_finite=True)  # noqa: E731
    recip = lambda s: 1.0 / s  # noqa: E731
    wrap = {"xla": lambda f: f, "triton": _triton, "mosaic": _mosaic}
    return {n: (jax.jit(wrap[n](scale)), jax.jit(wrap[n](recip))) for n in names}


def scale_mismatches(fns: dict, chunks: int, old: bool) -> dict[str, int]:
    """Mismatches of each backend's group_scale against e4m3 of numpy's quotient, over the first ``chunks``
    chunks of finite non-negative float32 bit patterns (128 cover all of them)."""
    truth = jax.jit(lambda q: jnp.where(nvfp4.e4m3_round(q) == 0, 1.0, nvfp4.e4m3_round(q)))
    if old:
        fns = fns | {"xla_divide": (jax.jit(lambda a: truth(a / nvfp4.E2M1_MAX)), None)}
    bad = {name: 0 for name in fns}
    for c in range(chunks):
        bits = np.arange(c * CHUNK, (c + 1) * CHUNK, dtype=np.uint64)
        bits = np.where(bits <= LAST_FINITE, bits, 0).astype(np.uint32)  # past the last finite: amax 0
        amax = bits.view(np.float32)
        want = np.asarray(truth(amax / np.float32(nvfp4.E2M1_MAX))).reshape(-1)
        x = jnp.asarray(amax).reshape(ROWS, 128)
        for name, (f, _) in fns.items():
            got = np.asarray(f(x)).reshape(-1)
            miss = got != want
            if miss.any() and not bad[name]:
                print(f"{name}: first mismatches at amax {amax[miss][:4]}: {got[miss][:4]} instead of {want[miss][:4]}")
            bad[name] += int(miss.sum())
    return bad


def reciprocal_mismatches(fns: dict) -> dict[str, int]:
    """Mismatches of 1/sf against numpy's correctly rounded reciprocal, every positive e4m3 value."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (grid > 0)])
    x = np.resize(grid, (128, 128)).astype(np.float32)
    want = np.float32(1) / x
    return {name: int(np.sum(np.asarray(r(jnp.asarray(x))) != want)) for name, (_, r) in fns.items()}


def kernel_scale_mismatches() -> dict[str, int]:
    """The Attn-QAT kernels' bf16 FQ(P) scales (``lane_groups.fake_quant_p(fast_scale=True)``) compiled in a Mosaic GPU
    kernel, on every finite non-negative bf16 amax: sf = ``group_scale_16bit`` with the conversion to e4m3, and
    bf16 of the approximate reciprocal, against ``group_scale`` and bf16 of numpy's 1/sf; with Mosaic GPU's pairwise
    conversion and with ``lane_groups.E4M3_LANEWISE``'s per value (keys ``…_lanewise``)."""
    from pallas_kernels import lane_groups
    from pallas_kernels._mosaic import plgpu

    def sf_of(a):
        a = plgpu.layout_cast(a, plgpu.Layout.WGMMA)
        return nvfp4.group_scale_16bit(a, to_e4m3=lambda x: lane_groups.e4m3_by_conversion(x, False))

    def inv_of(a):
        return lane_groups.approx_reciprocal(sf_of(a), False).astype(jnp.bfloat16).astype(jnp.float32)

    bits = np.arange(0x8000, dtype=np.uint16)
    bits = np.where(bits <= 0x7F7F, bits, 0).astype(np.uint16)  # past the last finite bf16: amax 0
    amax = bits.view(ml_dtypes.bfloat16).astype(np.float32).reshape(256, 128)
    want = np.asarray(nvfp4.group_scale(jnp.asarray(amax), assume_finite=True))
    want_inv = (np.float32(1) / want).astype(ml_dtypes.bfloat16).astype(np.float32)
    bad = {}
    lanewise = lane_groups.E4M3_LANEWISE
    try:
        for mode in (False, True):  # Mosaic GPU's pairwise conversion, and lane_groups' own per value
            lane_groups.E4M3_LANEWISE = mode
            tag = "_lanewise" if mode else ""
            got = np.asarray(jax.jit(_mosaic(sf_of))(jnp.asarray(amax)))
            got_inv = np.asarray(jax.jit(_mosaic(inv_of))(jnp.asarray(amax)))
            bad |= {f"sf{tag}": int(np.sum(got != want)), f"bf16_inv{tag}": int(np.sum(got_inv != want_inv))}
    finally:
        lane_groups.E4M3_LANEWISE = lanewise
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=128, help="chunks of 2**24 bit patterns (128: all)")
    parser.add_argument("--backends", nargs="+", choices=("xla", "triton", "mosaic"),
                        help="default: all three on a GPU, xla elsewhere")
    parser.add_argument("--old", action="store_true", help="also count XLA's `amax / 6`")
    args = parser.parse_args(argv)
    names = args.backends or (["xla", "triton", "mosaic"] if jax.default_backend() == "gpu" else ["xla"])
    fns = backends(names)
    start = time.time()
    scale = scale_mismatches(fns, min(args.chunks, 128), args.old)
    recip = reciprocal_mismatches(fns)
    print(f"{jax.devices()[0].device_kind}: group_scale mismatches over {min(args.chunks, 128)} chunk(s) of 2**24 "
          f"float32 bit patterns: {scale}; 1/sf mismatches over every e4m3 value: {recip} "
          f"({time.time() - start:.1f} s)")
    kernel = kernel_scale_mismatches() if "mosaic" in names else {}
    if kernel:
        print(f"Attn-QAT kernels' fast bf16 FQ(P) scales (every finite bf16 amax), mismatches: {kernel}")
    return int(any(v for k, v in scale.items() if k != "xla_divide") or any(recip.values()) or any(kernel.values()))


if __name__ == "__main__":
    raise SystemExit(main())
