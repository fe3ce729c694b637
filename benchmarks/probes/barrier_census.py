"""The synchronisation each Mosaic GPU kernel of a fwd+bwd is built with, counted on any machine (no GPU).

Usage (repo root): PYTHONPATH=. python benchmarks/probes/barrier_census.py --method sage --head-dim 128
[--causal] [--assign pallas_kernels.qat_bwd_mosaic.MANUAL_BARRIERS=False]

Lowers one fwd+bwd of the method's Mosaic kernels for an abstract H200 (``benchmarks.common.lower_mosaic_fwd_bwd``,
the library's H200 config), reads back each kernel's serialized Mosaic GPU module (``mosaic.gpu.core.KNOWN_KERNELS``,
the bytes its custom call carries) and counts, per kernel, the places in its code (static, not per step: prologue,
epilogue, a causal step's masked and unmasked branches, and the memory warpgroup's copies all count) of

* ``bar.sync``: warpgroup barriers — Pallas's automatic ones (before and after every store of a register array to
  SMEM, before every TMA load a warpgroup issues), ``commit_smem``'s, the waits for TMA stores, and the kernels' own;
* ``fence.proxy``: the async-proxy fences of ``commit_smem`` (SASS ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``);
* ``wgmma.wait_group``: the waits for the tensor cores.

Why: the fifty-third session found that the Attn-QAT backward ran ten ``BAR.SYNC`` a step, half of them Pallas's
automatic ones, and dropping those (``qat_bwd_mosaic.manual_barriers``) made its kernel 4–6% faster; this finds the
kernels where the same could pay without a GPU (SASS per step: ``benchmarks/sass_census.py`` on the GPU machine).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

from benchmarks.common import lower_mosaic_fwd_bwd
from benchmarks.variants import lowering_probe_args

KERNEL_NAME = re.compile(r"\b(\w+)_mosaic_gpu\b")


class Census(NamedTuple):
    """Static counts in one kernel's Mosaic GPU module."""

    bar_sync: int
    fence_proxy: int
    wgmma_wait: int


def count(text: str) -> Census:
    """:class:`Census` of a module's text."""
    return Census(text.count("bar.sync"), text.count("fence.proxy"), text.count("wgmma.wait_group"))


def module_texts(modules: list[bytes]) -> list[str]:
    """The text of each serialized Mosaic GPU module (MLIR bytecode, as ``KNOWN_KERNELS`` holds them)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax._src.lib.mlir import ir

    texts = []
    for asm in modules:
        ctx = mlir.make_ir_context()
        mosaic_gpu_dialect.register_dialect(ctx)  # its barrier type is a memref element
        ctx.allow_unregistered_dialects = True
        with ctx, ir.Location.unknown():
            texts.append(str(ir.Module.parse(asm)))
    return texts


def barrier_census(method: str, head_dim: int, causal: bool, seq: int = 512) -> dict[str, Census]:
    """Kernel name (its ``_mosaic.launch`` name) → :class:`Census`, for one lowered fwd+bwd."""
    from jax.experimental.mosaic.gpu import core

    jax.clear_caches()  # a kernel traced under other module switches would be reused
    before = set(core.KNOWN_KERNELS)
    lower_mosaic_fwd_bwd(method, head_dim, causal, seq=seq)
    out = {}
    for text in module_texts([asm for key, asm in core.KNOWN_KERNELS.items() if key not in before]):
        names = sorted(set(KERNEL_NAME.findall(text)) - {"stable"})
        out[names[0] if names else "?"] = count(text)
    return out


def main(argv=None) -> int:
    args = lowering_probe_args(__doc__.splitlines()[0], argv, head_dim=128)
    for name, census in barrier_census(args.method, args.head_dim, args.causal).items():
        print(f"{name}: bar.sync {census.bar_sync}, fence.proxy {census.fence_proxy}, "
              f"wgmma.wait_group {census.wgmma_wait}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
