"""Which register ↔ SMEM transfers of the Mosaic GPU kernels Mosaic GPU staggers, found on any machine (no GPU).

Usage (repo root): PYTHONPATH=. python benchmarks/probes/transfer_plans.py --method sage --head-dim 64 --causal
[--assign pallas_kernels.dq_stage.STAGE_SWIZZLE=32]

Mosaic GPU lays out each transfer between a register array and a tiled, swizzled SMEM ref in Python, while the
kernel lowers (``fragmented_array.plan_tiled_transfer``): a plain plan, or, where a warp's plain accesses would hit
the same SMEM banks twice, a ``StaggeredTransferPlan`` (lanes in two groups that take the tiles in different orders:
a select per register and address). This lowers one fwd+bwd of the method's Mosaic kernels for an abstract H200
(``benchmarks.common.lower_mosaic_fwd_bwd``, the library's H200 config) with a spy on that function and prints each plan with its count: nested ref
shape, element bits, swizzle bytes, the plan, its stagger. The forty-third session found this way that the only
staggered transfers in the fused backwards are their float32 dQ stages (``dq_stage.STAGE_SWIZZLE``).
"""

from __future__ import annotations

import collections

import jax
import jax.experimental.mosaic.gpu.fragmented_array as fragmented_array

from benchmarks.common import lower_mosaic_fwd_bwd
from benchmarks.variants import lowering_probe_args


def transfer_plans(method: str, head_dim: int, causal: bool, seq: int = 512) -> collections.Counter:
    """(nested ref shape, element bits, swizzle, plan, stagger) → how many transfers of the lowered fwd+bwd."""
    seen: collections.Counter = collections.Counter()
    plan = fragmented_array.plan_tiled_transfer

    def spy(shape, strides, layout, bits, swizzle):
        result = plan(shape, strides, layout, bits, swizzle)
        seen[(tuple(map(tuple, shape)), bits, int(swizzle), type(result).__name__,
              getattr(result, "stagger", None))] += 1
        return result

    jax.clear_caches()  # the kernels' jitted wrappers would reuse a trace made under other module switches
    fragmented_array.plan_tiled_transfer = spy
    try:
        lower_mosaic_fwd_bwd(method, head_dim, causal, seq=seq)
    finally:
        fragmented_array.plan_tiled_transfer = plan
    return seen


def main(argv=None) -> int:
    args = lowering_probe_args(__doc__.splitlines()[0], argv)
    for (shape, bits, swizzle, name, stagger), n in sorted(transfer_plans(args.method, args.head_dim,
                                                                          args.causal).items()):
        print(f"{n:3d} × ref {shape} {bits}-bit swizzle {swizzle}: {name}"
              + (f" (stagger {stagger})" if stagger else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
