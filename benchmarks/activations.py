"""SageAttention's error on a pretrained model's real attention inputs and gradients, INT8 and e4m3 P·V.

The accuracy gate of issue #67 on real activations: SmolLM2-135M (the registry's GGUF, 30 layers, 9/3 heads of 64)
reads a window of real text (Python's own documentation); every layer's q, k, v (after RoPE) and the gradient of
the next-token loss with respect to its attention output (dO) are captured in one jitted forward and backward. On
the layers asked for, :func:`lowbit_jax.diagnostics.attention_error_report` gives the cos-sim of O, dQ, dK, dV
against exact fp32 attention for SageAttention/SageBwd with the paper's INT8 P·V and with FP8 e4m3 P·V (the Hopper
default), causal, through the pure-JAX reference (the kernels' twin: same quantization). The paper's own figures on
real activations are set beside them. CPU work (the weights never go to the GPU machine).

    PYTHONPATH=. python benchmarks/activations.py            # 1024 tokens, every 6th layer and the last
    PYTHONPATH=. python benchmarks/activations.py --smoke    # a tiny random model, 64 tokens (runs anywhere)
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models.attention as attention_module
from benchmarks.common import environment, write_json
from lowbit_jax.diagnostics import attention_error_report
from pallas_kernels.configs import SageFwdConfig

#: the paper's SageBwd on real activations (cos-sim), docs/spec.md
PAPER = {"O": 0.9969, "dQ": 0.9664, "dK": 0.9537, "dV": 0.9985}
FORMATS = ("int8", "e4m3")
GRADS = ("O", "dQ", "dK", "dV")


def probed_loss(model, tokens: jax.Array):
    """``loss(probes) -> (mean next-token cross-entropy, [(q, k, v) of each layer])`` of ``model`` on ``tokens``
    (B, S), each layer's attention output plus ``probes[layer]`` (B, S, Hq, D): at zero probes its gradient is dO."""
    graph, state = nnx.split(model)
    attend = attention_module.dense_attention

    def loss(probes):
        seen = []

        def probed(q, k, v, *, causal):
            o = attend(q, k, v, causal=causal) + probes[len(seen)].astype(q.dtype)
            seen.append((q, k, v))
            return o

        with mock.patch.object(attention_module, "dense_attention", probed):
            logits = nnx.merge(graph, state)(tokens)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), tokens[:, 1:])
        return jnp.mean(ce), seen

    return loss


def zero_probes(model, tokens: jax.Array) -> list[jax.Array]:
    """One float32 zero (B, S, Hq, D) per layer: the probes of :func:`probed_loss`."""
    cfg = model.cfg
    shape = (tokens.shape[0], tokens.shape[1], cfg.num_heads, cfg.head_size)
    return [jnp.zeros(shape, jnp.float32) for _ in range(cfg.num_layers)]


def captured_attention(model, tokens: jax.Array) -> list[tuple[jax.Array, ...]]:
    """(q, k, v, dO) of every attention layer of ``model`` (a dense-method :class:`models.TransformerLM`) on
    ``tokens`` (B, S), in one jitted forward and backward: dO is the gradient of the mean next-token cross-entropy
    with respect to the layer's attention output (before the output projection), in q's dtype."""
    d_probes, seen = jax.jit(jax.grad(probed_loss(model, tokens), has_aux=True))(zero_probes(model, tokens))
    return [(q, k, v, do.astype(q.dtype)) for (q, k, v), do in zip(seen, d_probes)]


def layer_errors(q, k, v, do) -> dict[str, dict[str, float]]:
    """Cos-sim of O, dQ, dK, dV vs exact fp32 per P·V format (causal SageAttention, the XLA reference)."""
    out = {}
    for fmt in FORMATS:
        report = attention_error_report(q, k, v, do, method="sage", causal=True, implementation="xla",
                                        config=SageFwdConfig(pv_format=fmt), print_table=False)
        out[fmt] = {name: report[name]["cos_sim"] for name in GRADS}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="window length (default: %(default)s)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="layers to report (default: every 6th and the last)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and 64 tokens")
    args = parser.parse_args(argv)
    log = functools.partial(print, flush=True)
    if args.smoke:
        from models import ModelConfig, TransformerLM
        cfg = ModelConfig(vocab_size=97, dim=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=256,
                          max_len=64, method="dense", qk_norm=False, dtype="float32")
        model = TransformerLM(cfg, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.PRNGKey(0), (1, 64), 0, cfg.vocab_size)
        source = "tiny random model, random tokens"
    else:
        from benchmarks.paper import texts
        from models.pretrained import from_pretrained
        from models.pretrained.smollm2 import smollm2_path

        path = smollm2_path()
        model, tokenizer = from_pretrained(path, method="dense", dtype="bfloat16", max_len=args.tokens)
        ids = np.asarray(tokenizer.encode(texts()["docs"].read_text()[:200_000]))
        start = len(ids) // 3  # past the file's header, into the prose
        tokens = jnp.asarray(ids[None, start:start + args.tokens], jnp.int32)
        source = f"{path.name}, {args.tokens} tokens of Python's documentation (pydoc topics)"
    n = model.cfg.num_layers
    layers = args.layers or sorted({*range(0, n, 6), n - 1})
    log(f"capturing q, k, v, dO of {n} layers ({source})")
    captured = captured_attention(model, tokens)
    rows = []
    for i in layers:
        q, k, v, do = captured[i]
        errors = layer_errors(q, k, v, do)
        rows.append(dict(layer=i, errors=errors))
        log(f"  layer {i}: " + "; ".join(f"{fmt} " + " ".join(f"{g} {c:.5f}" for g, c in e.items())
                                         for fmt, e in errors.items()))
    worst = {fmt: {g: min(r["errors"][fmt][g] for r in rows) for g in GRADS} for fmt in FORMATS}
    mean = {fmt: {g: float(np.mean([r["errors"][fmt][g] for r in rows])) for g in GRADS} for fmt in FORMATS}
    payload = dict(env=environment(), source=source, dtype=str(captured[0][0].dtype),
                   shape=list(captured[0][0].shape), kv_shape=list(captured[0][1].shape), rows=rows, worst=worst,
                   mean=mean, paper=PAPER,
                   command="PYTHONPATH=. python benchmarks/activations.py" + (" --smoke" * args.smoke))
    write_json("activations_smoke" if args.smoke else "activations", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
