"""Shared memory of every Mosaic GPU kernel, as lowered for an H200 — on the CPU, no GPU needed.

Usage (repo root, any machine):
    PYTHONPATH=. python benchmarks/smem_report.py [--extra-smem BYTES] [--reduction-scratch BYTES] \\
        [--head-dim 128] [--method sage]

Each SageBwd / Attn-QAT configuration (head dim 64 and 128, causal and not, dQ fused and separate, every kernel
on Mosaic GPU) is lowered for an abstract H200, and the SMEM Pallas reserves for each kernel launch is read off
its resource estimate (``jax._src.pallas.mosaic_gpu.lowering._estimate_resources``, a private function: the
report says so if it moves). Beside it: the smallest shared-memory carveout of an sm_90 SM that holds one CTA
(0, 8, 16, 32, 64, 100, 132, 164, 196 or 228 KiB, plus the 1 KiB the driver reserves per CTA) and the L1 cache
that then leaves of the SM's 256 KiB — what the kernels' register spills are cached in. On the H200 this
matters where ptxas's stack frame (``variants.py --ptxas``) times the CTA's 256 compute threads does not fit
in that L1: the same Attn-QAT kernel code ran 6% faster at carveout 196 than at 228, and SageBwd 4% slower
when padded from 196 to 228 (benchmarks/NOTES.md, seventeenth and eighteenth sessions; the
``EXTRA_SMEM_BYTES`` probe). ``--extra-smem`` and ``--reduction-scratch`` set the probe switches
``EXTRA_SMEM_BYTES`` and ``REDUCTION_SCRATCH_BYTES``. The estimate leaves out the kernel's mbarriers (8 bytes each), so a kernel within a
few hundred bytes of a step may need the next one. Writes benchmarks/results/smem_report.json (and
$OUT/smem_report.json; not rendered into RESULTS.md: nothing here is measured on the GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys

import jax

from benchmarks.common import lower_mosaic_fwd_bwd, write_json
#: shared-memory capacities an sm_90 SM can be configured to (KiB; CUDA C programming guide, compute capability 9.0)
CARVEOUTS_KIB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
UNIFIED_KIB = 256  # L1 + shared memory per SM
RESERVED_KIB = 1  # shared memory the driver reserves per CTA


def carveout_kib(smem_bytes: int) -> int | None:
    """The smallest sm_90 carveout that holds one CTA using ``smem_bytes`` (None: none does)."""
    need = smem_bytes / 1024 + RESERVED_KIB
    return next((c for c in CARVEOUTS_KIB if c >= need), None)


@contextlib.contextmanager
def recording_smem():
    """Within the block, every Mosaic GPU kernel lowered appends (kernel function name, SMEM bytes) to the
    yielded list (the largest resource estimate made while lowering it: the whole kernel's)."""
    from jax._src.pallas.mosaic_gpu import lowering

    if not hasattr(lowering, "_estimate_resources") or not hasattr(lowering, "lower_jaxpr_to_module"):
        raise RuntimeError("this jax moved Pallas Mosaic GPU's _estimate_resources: the report needs updating")
    estimates, kernels = [], []
    estimate, lower = lowering._estimate_resources, lowering.lower_jaxpr_to_module

    def estimate_recorded(*args, **kwargs):
        resources = estimate(*args, **kwargs)
        estimates.append(resources.smem_scratch_bytes)
        return resources

    def lower_recorded(*args, **kwargs):
        start = len(estimates)
        out = lower(*args, **kwargs)
        jaxpr = kwargs.get("jaxpr", args[7] if len(args) > 7 else None)
        name = getattr(getattr(jaxpr, "debug_info", None), "func_name", "?")
        kernels.append((name, max(estimates[start:], default=0)))
        return out

    lowering._estimate_resources, lowering.lower_jaxpr_to_module = estimate_recorded, lower_recorded
    try:
        yield kernels
    finally:
        lowering._estimate_resources, lowering.lower_jaxpr_to_module = estimate, lower


def lowered_kernels(method: str, head_dim: int, causal: bool, dq_kernel: str, seq: int = 512) -> list[tuple]:
    """(kernel, SMEM bytes) of one fwd+bwd of ``method`` with every kernel on Mosaic GPU, lowered for an H200
    (``benchmarks.common.lower_mosaic_fwd_bwd``)."""
    with recording_smem() as kernels:
        lower_mosaic_fwd_bwd(method, head_dim, causal, dq_kernel=dq_kernel, seq=seq)
    return kernels


def report(methods=("sage", "qat"), head_dims=(64, 128), log=print) -> list[dict]:
    rows = []
    for method, d, causal, dq_kernel in itertools.product(methods, head_dims, (False, True), ("fused", "separate")):
        for kernel, smem in lowered_kernels(method, d, causal, dq_kernel):
            carve = carveout_kib(smem)
            row = dict(method=method, head_dim=d, causal=causal, dq_kernel=dq_kernel, kernel=kernel,
                       smem_kib=smem / 1024, carveout_kib=carve,
                       l1_kib=None if carve is None else UNIFIED_KIB - carve)
            rows.append(row)
            log(f"{method:4s} D{d:<3d} causal={causal!s:5s} dq={dq_kernel:8s} {kernel:28s} "
                f"SMEM {row['smem_kib']:6.1f} KiB  carveout {carve} KiB  L1 left {row['l1_kib']} KiB")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra-smem", type=int, default=0, help="pallas_kernels._mosaic.EXTRA_SMEM_BYTES")
    parser.add_argument("--reduction-scratch", type=int, default=None,
                        help="pallas_kernels._mosaic.REDUCTION_SCRATCH_BYTES (default: Pallas's 2 KiB)")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), action="append")
    parser.add_argument("--method", choices=("sage", "qat"), action="append")
    args = parser.parse_args(argv)
    from pallas_kernels import _mosaic

    _mosaic.EXTRA_SMEM_BYTES = args.extra_smem
    _mosaic.REDUCTION_SCRATCH_BYTES = args.reduction_scratch
    rows = report(tuple(args.method or ("sage", "qat")), tuple(args.head_dim or (64, 128)))
    command = " ".join(["PYTHONPATH=. python benchmarks/smem_report.py", *(argv if argv is not None else sys.argv[1:])])
    for path in write_json("smem_report", dict(command=command, jax=jax.__version__, rows=rows)):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
