"""The model's decode step over a long KV cache: 16-bit attention (dense) against ThriftAttention.

Usage (repo root):
    PYTHONPATH=. python benchmarks/serving.py                          # GPU: preset 50m, B8, caches of 8k and 32k
    PYTHONPATH=. python benchmarks/serving.py --batch 2 --lengths 131072
    PYTHONPATH=. python benchmarks/serving.py --smoke                  # tiny, any backend
    PYTHONPATH=. python benchmarks/serving.py --prefill                # GPU: a prompt through the KV cache

What a server pays per generated token: ``TransformerLM.decode`` of one new token per sequence (embedding,
every block's projections, attention over its cache, MLP, logits, the greedy pick of the next token), jitted
with the caches donated so they are updated in place, as a serving loop would. Every method gets the same
parameters (random: the speed does not depend on them) and caches holding the same random K/V of ``length``
tokens. ``dense`` is the model's 16-bit decode (:func:`lowbit_jax.cached_attention`: cuDNN over the
filled length on a GPU);
``thrift f=…`` reads the selected blocks from the 16-bit cache and the rest from the 4-bit one
(:func:`lowbit_jax.thrift_decode`). Each round times every method for ``--steps`` steps in turn; a method's
figure is its median over ``--rounds`` rounds.

``--prefill`` times what comes before: a prompt through the cache. The op
(:func:`lowbit_jax.cached_attention`, cuDNN against XLA's masked attention, outputs against float32 and
each other, XLA temporaries) for a prompt into an empty cache and for a chunk after cached tokens; and the model's
prompt by ``prefill``, by ``decode`` from empty caches and by the routes before (dense: XLA's; thrift:
thrift_decode calls), beside its forward pass (:func:`prefill_model`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lowbit_jax.dense
import models.attention
from benchmarks.common import environment, temp_mib, time_fn, write_json
from models import TransformerLM, model_config
from train.generate import with_method

BUDGETS = (0.05, 1.0)


def filled_caches(model: TransformerLM, batch: int, length: int, seed: int = 0) -> list:
    """The model's empty caches (one per layer) holding ``length`` tokens of N(0,1) keys and values."""
    caches = model.init_cache(batch)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(caches))
    filled = []
    for i, cache in enumerate(caches):
        dense = isinstance(cache, dict)  # else a ThriftKVCache
        b, _, h, d = (cache["k"] if dense else cache.k).shape
        shape, dt = (b, length, h, d), jnp.dtype(model.cfg.dtype)
        k = jax.random.normal(keys[2 * i], shape, dt)
        v = jax.random.normal(keys[2 * i + 1], shape, dt)
        filled.append(dict(cache, k=cache["k"].at[:, :length].set(k), v=cache["v"].at[:, :length].set(v),
                           length=jnp.asarray(length, jnp.int32)) if dense else cache.append(k, v))
    return filled


def decode_step(model: TransformerLM):
    """``(params, tokens (B, 1), caches) -> (next tokens (B, 1), caches)``, jitted, the caches donated."""
    graphdef, _ = nnx.split(model)

    def step(params, tokens, caches):
        logits, caches = nnx.merge(graphdef, params).decode(tokens, caches)
        return jnp.argmax(logits[:, -1], axis=-1).astype(tokens.dtype)[:, None], caches

    return jax.jit(step, donate_argnums=(2,))


def time_steps(step, params, tokens, caches, steps: int) -> tuple[float, jax.Array, list]:
    """ms per step over ``steps`` steps (each feeds the last one's token and caches); the last state."""
    jax.block_until_ready(caches)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens, caches = step(params, tokens, caches)
    jax.block_until_ready((tokens, caches))
    return (time.perf_counter() - t0) * 1e3 / steps, tokens, caches


def run(preset: str, batch: int, length: int, *, steps: int, rounds: int, budgets=BUDGETS, impl: dict | None = None,
        log=print) -> dict:
    """One cache length: every method's ms per step and tokens/s, and its first greedy tokens."""
    cfg = model_config(preset, method="dense", max_len=length + (rounds + 1) * steps + 8)
    dense = TransformerLM(cfg, rngs=nnx.Rngs(0))
    models = {"dense": dense}
    for f in budgets:
        models[f"thrift f={f:g}"] = with_method(dense, "thrift", dict(budget=f, **(impl or {})))
    params = nnx.state(dense)
    state, steps_fn, first = {}, {}, {}
    tok0 = jnp.full((batch, 1), ord("a"), jnp.int32)
    for name, model in models.items():
        steps_fn[name] = decode_step(model)
        caches = filled_caches(model, batch, length)
        tokens, caches = steps_fn[name](params, tok0, caches)  # compile; the first greedy token
        first[name] = np.asarray(tokens[:, 0]).tolist()
        _, tokens, caches = time_steps(steps_fn[name], params, tokens, caches, 2)  # warm
        state[name] = (tokens, caches)
    per_round = {name: [] for name in models}
    for _ in range(rounds):
        for name in models:
            ms, *state[name] = time_steps(steps_fn[name], params, *state[name], steps)
            per_round[name].append(ms)
    ms = {name: float(np.median(t)) for name, t in per_round.items()}
    row = dict(preset=preset, params=cfg.num_params(), layers=cfg.num_layers, heads=cfg.num_heads,
               kv_heads=cfg.num_kv_heads, head_dim=cfg.head_size, batch=batch, length=length,
               steps=steps, rounds=rounds, ms=ms, ms_rounds=per_round,
               tokens_per_s={n: batch * 1e3 / t for n, t in ms.items()},
               vs_dense={n: ms["dense"] / t for n, t in ms.items()}, first_tokens=first)
    log(f"  {preset} B{batch} cache {length}: " + ", ".join(
        f"{n} {t:.3f} ms/step ({row['tokens_per_s'][n]:,.0f} tokens/s, {row['vs_dense'][n]:.2f}x)"
        for n, t in ms.items()))
    return row


#: (batch, new tokens, cached before, cache slots, query heads, kv heads, head dim): the 50m preset's heads, then
#: a larger model's; a prompt into an empty cache, a chunk of one after cached tokens, and a short chunk (the
#: tokens a speculative decoder verifies)
PREFILL_SHAPES = ((4, 2048, 0, 8192, 10, 5, 64), (4, 512, 4096, 8192, 10, 5, 64), (8, 16, 4000, 8192, 10, 5, 64),
                  (1, 8192, 0, 32768, 32, 8, 128), (1, 2048, 16384, 32768, 32, 8, 128),
                  (1, 16, 16000, 32768, 32, 8, 128))


def prefill_op(b: int, t: int, start: int, slots: int, h: int, hkv: int, d: int, *, impls=("cudnn", "xla"),
               log=print) -> dict:
    """``cached_attention`` of ``t`` new tokens at ``start`` over a cache of ``slots`` (bf16; slots past
    ``start + t`` hold garbage): ms, XLA temporaries and the error of each implementation."""
    ks = jax.random.split(jax.random.PRNGKey(t + start), 3)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (b, slots, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (b, slots, hkv, d), jnp.bfloat16)
    st = jnp.int32(start)
    exact = lowbit_jax.dense.cached_attention(*(x.astype(jnp.float32) for x in (q, kc, vc)), st, implementation="xla")
    row = dict(batch=b, tokens=t, start=start, slots=slots, heads=h, kv_heads=hkv, head_dim=d, ms={}, temp_mib={},
               rel_l2={}, outputs={})
    for impl in impls:
        fn = jax.jit(lambda q, kc, vc, st, impl=impl: lowbit_jax.dense.cached_attention(q, kc, vc, st,
                                                                                        implementation=impl))
        out = fn(q, kc, vc, st).astype(jnp.float32)
        row["outputs"][impl] = out
        row["rel_l2"][impl] = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
        row["ms"][impl] = time_fn(fn, q, kc, vc, st)
        row["temp_mib"][impl] = temp_mib(fn, q, kc, vc, st)
    outs = row.pop("outputs")
    if len(impls) == 2:
        row["max_abs_between"] = float(jnp.max(jnp.abs(outs[impls[0]] - outs[impls[1]])))
    log(f"  B{b} T{t} at {start} of {slots} H{h}/{hkv} D{d}: " + ", ".join(
        f"{i} {row['ms'][i]:.3f} ms ({row['temp_mib'][i]:.0f} MiB temp, rel-L2 {row['rel_l2'][i]:.1e})"
        for i in impls) + (f"; max |diff| {row['max_abs_between']:.1e}" if "max_abs_between" in row else ""))
    return row


def prefill_model(preset: str, batch: int, prompt: int, slots: int, *, budgets=(0.05,), impl: dict | None = None,
                  log=print) -> dict:
    """A ``prompt``-token prompt into the model's empty caches of ``slots``, by each route: ``prefill`` (the
    static empty-cache route ``train.generate`` takes), ``decode`` from ``init_cache`` in the same jit (dense: the
    cuDNN route for any cache; thrift: its run-time switch), and the routes before (dense: XLA's masked
    attention; thrift: thrift_decode calls); beside each method's forward pass over the same tokens (no cache
    written), whose logits the others' are compared with. Each one jitted, the greedy pick included, one call at a
    time and waited for (a prompt arrives alone): ms (median of 5) and the first call's seconds (compilation
    included)."""
    cfg = model_config(preset, method="dense", max_len=slots)
    dense = TransformerLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(dense)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt), 0, 256)
    original = lowbit_jax.dense.cached_attention
    methods = {"dense": dense}
    methods.update({f"thrift f={f:g}": with_method(dense, "thrift", dict(budget=f, **(impl or {}))) for f in budgets})
    xla_route = mock.patch.object(models.attention, "cached_attention",
                                  lambda *a, **k: original(*a, **k, implementation="xla"))
    decode_calls = mock.patch.object(models.attention.Attention, "_thrift_prefill",
                                     models.attention.Attention._thrift_decode_chunks)
    variants = {}  # name: (method, entry, patch)
    for method in methods:
        variants[f"{method} forward (no cache)"] = (method, "forward", None)
        variants[f"{method} prefill"] = (method, "prefill", None)
        variants[f"{method} decode"] = (method, "decode", None)
        before = xla_route if method == "dense" else decode_calls
        variants[f"{method} decode, route before"] = (method, "decode", before)

    def entry_fn(model, entry):  # (params, tokens) -> (logits of the last token's pick, full logits)
        graphdef = nnx.graphdef(model)

        def run(p, x):
            m = nnx.merge(graphdef, p)
            logits = (m(x) if entry == "forward" else m.prefill(x)[0] if entry == "prefill"
                      else m.decode(x, m.init_cache(x.shape[0]))[0])
            return jnp.argmax(logits[:, -1], axis=-1), logits
        return jax.jit(run)

    ms, first_s, logits = {}, {}, {}
    for name, (method, entry, patch) in variants.items():
        with patch or contextlib.nullcontext():
            fn = entry_fn(methods[method], entry)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(params, tokens))
            first_s[name] = time.perf_counter() - t0
            logits[name] = out[1].astype(jnp.float32)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(params, tokens)[0])
                times.append((time.perf_counter() - t0) * 1e3)
            ms[name] = float(np.median(times))
    diffs = {n: float(jnp.max(jnp.abs(x - logits[f"{variants[n][0]} forward (no cache)"]))) for n, x in logits.items()}
    row = dict(preset=preset, params=cfg.num_params(), heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
               head_dim=cfg.head_size, batch=batch, prompt=prompt, slots=slots, ms=ms, first_call_s=first_s,
               tokens_per_s={n: batch * prompt * 1e3 / t for n, t in ms.items()}, logits_max_abs_vs_forward=diffs,
               logits_max_abs=max(float(jnp.max(jnp.abs(x))) for x in logits.values()))
    log(f"  {preset} B{batch} prompt {prompt} into {slots} slots: " + ", ".join(
        f"{n} {t:.2f} ms (first call {first_s[n]:.1f} s, logits max |diff| vs forward {diffs[n]:.3f})"
        for n, t in ms.items()))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="50m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=50, help="decode steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS),
                        help="thrift's 16-bit budgets f (each method holds its own caches: fewer fit longer ones)")
    parser.add_argument("--smoke", action="store_true", help="preset tiny, B2, a 200-token cache, 2 steps")
    parser.add_argument("--prefill", action="store_true", help="a prompt through the cache (op and model)")
    args = parser.parse_args(argv)
    command = "PYTHONPATH=. python benchmarks/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.prefill:
        env = environment()
        print(f"# {env}")
        ops = [prefill_op(*shape) for shape in PREFILL_SHAPES]
        model_rows = [prefill_model(args.preset, 4, 2048, 8192)]
        for p in write_json("serving_prefill", dict(env=env, command=command.strip(), ops=ops, models=model_rows)):
            print(f"wrote {p}")
        return 0
    impl = None
    if args.smoke:
        args.preset, args.batch, args.lengths, args.steps, args.rounds = "tiny", 2, [200], 2, 1
        impl = dict(implementation="pallas", interpret=True)
    env = environment()
    print(f"# {env}")
    rows = [run(args.preset, args.batch, n, steps=args.steps, rounds=args.rounds, budgets=tuple(args.budgets),
                impl=impl) for n in args.lengths]
    payload = dict(env=env, command=command.strip(), rows=rows)
    for p in write_json("serving_smoke" if args.smoke else "serving", payload):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
