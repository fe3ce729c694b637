"""One method's jitted fwd+bwd called a few times: the program that Nsight Compute profiles (``ncu_profile.sh``).

Usage (GPU machine, repo root): PYTHONPATH=. python benchmarks/probes/ncu_run.py --method qat --shape 4,32,32,4096,128,0
Methods: sage, qat (the library's default configs), cudnn (``jax.nn.dot_product_attention``, cuDNN). The switches of
``benchmarks/variants.py`` (``--variant``-style ``module.ATTR=value`` lists) apply with ``--assign``.
"""

from __future__ import annotations

import argparse
import functools
import warnings

import jax

from benchmarks.attention import make_inputs
from benchmarks.attention_bwd import fwd_bwd
from benchmarks.variants import apply, parse_assignments, parse_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--method", choices=("sage", "qat", "cudnn"), required=True)
    parser.add_argument("--shape", type=parse_shape, required=True, help="B,Hq,Hkv,S,D,causal")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--assign", default="")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import lowbit_jax as lb

    interpret = jax.default_backend() != "gpu"
    b, hq, hkv, s, d, causal = args.shape
    q, k, v = make_inputs(jax.random.key(0), b, hq, s, d)
    k, v = k[:, :, :hkv], v[:, :, :hkv]
    do = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
    if args.method == "cudnn":
        fn = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    else:
        apply(parse_assignments(args.assign), method=args.method)
        attend = {"sage": lb.sage_attention, "qat": lb.qat_attention}[args.method]
        fn = functools.partial(attend, causal=causal, interpret=interpret)
    run = fwd_bwd(fn)
    for _ in range(args.calls):
        jax.block_until_ready(run(q, k, v, do))
    print(f"{args.method} {args.shape}: {args.calls} calls done")


if __name__ == "__main__":
    main()
