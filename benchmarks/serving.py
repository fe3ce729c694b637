"""The model's decode step over a long KV cache: 16-bit attention (dense) against ThriftAttention.

Usage (repo root):
    PYTHONPATH=. python benchmarks/serving.py                          # GPU: preset 50m, B8, caches of 8k and 32k
    PYTHONPATH=. python benchmarks/serving.py --batch 2 --lengths 131072
    PYTHONPATH=. python benchmarks/serving.py --smoke                  # tiny, any backend

What a server pays per generated token: ``TransformerLM.decode`` of one new token per sequence (embedding,
every block's projections, attention over its cache, MLP, logits, the greedy pick of the next token), jitted
with the caches donated so they are updated in place, as a serving loop would. Every method gets the same
parameters (random: the speed does not depend on them) and caches holding the same random K/V of ``length``
tokens. ``dense`` is the model's 16-bit decode (:func:`models.attention.cached_attention`: cuDNN over the
filled length on a GPU);
``thrift f=…`` reads the selected blocks from the 16-bit cache and the rest from the 4-bit one
(:func:`lowbit_jax.thrift_decode`). Each round times every method for ``--steps`` steps in turn; a method's
figure is its median over ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import environment, write_json
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
        filled.append({"k": cache["k"].at[:, :length].set(k), "v": cache["v"].at[:, :length].set(v),
                       "length": jnp.asarray(length, jnp.int32)} if dense else cache.append(k, v))
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
               kv_heads=cfg.num_kv_heads, head_dim=cfg.dim // cfg.num_heads, batch=batch, length=length,
               steps=steps, rounds=rounds, ms=ms, ms_rounds=per_round,
               tokens_per_s={n: batch * 1e3 / t for n, t in ms.items()},
               vs_dense={n: ms["dense"] / t for n, t in ms.items()}, first_tokens=first)
    log(f"  {preset} B{batch} cache {length}: " + ", ".join(
        f"{n} {t:.3f} ms/step ({row['tokens_per_s'][n]:,.0f} tokens/s, {row['vs_dense'][n]:.2f}x)"
        for n, t in ms.items()))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="50m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--steps", type=int, default=50, help="decode steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="preset tiny, B2, a 200-token cache, 2 steps")
    args = parser.parse_args(argv)
    impl = None
    if args.smoke:
        args.preset, args.batch, args.lengths, args.steps, args.rounds = "tiny", 2, [200], 2, 1
        impl = dict(implementation="pallas", interpret=True)
    env = environment()
    print(f"# {env}")
    rows = [run(args.preset, args.batch, n, steps=args.steps, rounds=args.rounds, impl=impl) for n in args.lengths]
    command = "PYTHONPATH=. python benchmarks/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = dict(env=env, command=command.strip(), rows=rows)
    for p in write_json("serving_smoke" if args.smoke else "serving", payload):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
