"""Attention demo: INT8 SageAttention vs exact attention on inputs with K outliers.

    python -m train.attention_demo [--seq 512] [--heads 4] [--head-dim 128]

On a CPU it runs the pure-JAX implementation (same quantization as the kernels)
and the Pallas kernels in interpret mode on a short sequence; on a GPU the
compiled kernels. Prints accuracy against exact fp32 attention and the bytes
the INT8 operands take.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

import lowbit_jax as lb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="INT8 attention demo")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--outlier", type=float, default=10.0, help="K per-channel mean, in units of its std")
    args = parser.parse_args(argv)

    console = Console()
    on_gpu = jax.default_backend() == "gpu"
    kq, kk, km, kv = jax.random.split(jax.random.PRNGKey(0), 4)
    b, s, h, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(kq, (b, s, h, d), jnp.bfloat16)
    k = (jax.random.normal(kk, (b, s, hkv, d)) + args.outlier * jax.random.normal(km, (b, 1, hkv, d))).astype(
        jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)
    console.print(f"[bold]lowbit-jax INT8 attention demo[/] on {jax.devices()[0].device_kind}: "
                  f"q {q.shape}, k/v {k.shape} bf16, K channel means {args.outlier}x std")

    table = Table("variant", "causal", "cos-sim", "rel-L1", "rel-L2", "time (s)")
    for causal in (False, True):
        ref = lb.reference_attention(q, k, v, causal=causal)
        variants = {
            "sage, K-smoothing": dict(),
            "sage, no smoothing": dict(smooth_k=False),
            "sage, per-token scales": dict(qk_granularity="per_token"),
            "bf16 (jax.nn.dot_product_attention)": None,
        }
        if not on_gpu:
            variants["sage kernels, Pallas interpret (last 128 queries)"] = dict(implementation="pallas",
                                                                                 interpret=True)
        for name, opts in variants.items():
            t0 = time.perf_counter()
            if opts is None:
                out, r = jax.nn.dot_product_attention(q, k, v, is_causal=causal), ref
            elif opts.get("interpret"):
                # bottom-right causal: the last 128 queries see all keys, as in the full run
                out = lb.sage_attention(q[:, -128:], k, v, causal=causal, **opts)
                r = ref[:, -128:]
            else:
                out, r = lb.sage_attention(q, k, v, causal=causal, **opts), ref
            out = jax.block_until_ready(out)
            m = lb.error_metrics(out, r)
            table.add_row(name, str(causal), f"{m['cos_sim']:.5f}", f"{m['rel_l1']:.4f}", f"{m['rel_l2']:.4f}",
                          f"{time.perf_counter() - t0:.2f}")
    console.print(table)
    _, _, ops = lb.sage_forward(q, k, v)
    nbytes = sum(x.nbytes for x in ops if x is not None)
    console.print(f"INT8 operands (codes + scales): {nbytes / 2**20:.2f} MiB vs bf16 q, k, v "
                  f"{(q.nbytes + k.nbytes + v.nbytes) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
