"""Sample text from a checkpoint: ``python -m train.generate --from runs/demo --prompt "def " --tokens 200``.

Prefills the prompt (``TransformerLM.prefill``), then decodes token by token through the model's KV cache.
``--method`` serves the checkpoint with another attention method than it was trained with, e.g. ``--method
thrift --budget 0.1`` (ThriftAttention over a 16-bit + 4-bit KV cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit_jax.thrift import check_budget
from models import ModelConfig, TransformerLM
from train.checkpoint import read_config, resolve_dir
from train.data import ByteTokenizer
from train.loop import TrainConfig, load_params, make_optimizer


def load_model(checkpoint: str, *, method: str | None = None, attention_options: dict | None = None) -> TransformerLM:
    """A TransformerLM with the parameters of a training checkpoint directory.

    Args:
      checkpoint: a run directory or its checkpoints/ folder.
      method: serve with this attention method instead of the trained one (the parameters are the same).
      attention_options: keyword options of the attention function (e.g. ``{"budget": 0.1}`` for thrift).
    """
    path = resolve_dir(checkpoint)
    saved = read_config(path)
    fields = dict(saved["model"], **({"method": method} if method else {}))
    model = TransformerLM(ModelConfig(**fields), rngs=nnx.Rngs(0), attention_options=attention_options)
    graphdef, params = nnx.split(model)
    tx, _ = make_optimizer(TrainConfig(**saved["train"]))
    opt_like = tx.init(params)
    return nnx.merge(graphdef, load_params(str(path), params, opt_like))


def with_method(model: TransformerLM, method: str, attention_options: dict | None = None) -> TransformerLM:
    """The same parameters (shared, not copied) behind another attention method and its options."""
    cfg = dataclasses.replace(model.cfg, method=method)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0),
                                                                 attention_options=attention_options)))
    return nnx.merge(graphdef, nnx.state(model))


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """``--method`` (serve with another attention method) and ``--budget`` (its ThriftAttention budget)."""
    parser.add_argument("--method", default=None, help="attention method to serve with (default: the trained one)")
    parser.add_argument("--budget", type=float, default=None, help="thrift: fraction of block pairs in 16-bit")


def serving_options(args: argparse.Namespace) -> dict | None:
    """The attention options of :func:`add_serving_args`' flags; ValueError for a budget without thrift."""
    if args.budget is None:
        return None
    if (args.method or "") != "thrift":
        raise ValueError("--budget is a ThriftAttention option: it needs --method thrift")
    return {"budget": check_budget(args.budget)}


def generate(model: TransformerLM, prompt: str, num_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> str:
    """Continue ``prompt`` by ``num_tokens`` bytes (temperature 0: greedy)."""
    tokens = ByteTokenizer.encode(prompt)
    if len(tokens) == 0:
        raise ValueError("prompt must not be empty")
    if len(tokens) + num_tokens > model.cfg.max_len:
        raise ValueError(f"prompt ({len(tokens)}) + tokens ({num_tokens}) exceeds the model's max_len "
                         f"({model.cfg.max_len})")
    graphdef, params = nnx.split(model)

    def pick(logits, key):
        if temperature <= 0:
            return jnp.argmax(logits, -1)
        top = jax.lax.top_k(logits, top_k)[0][:, -1:]
        return jax.random.categorical(key, jnp.where(logits < top, -jnp.inf, logits) / temperature, -1)

    @functools.partial(jax.jit, donate_argnums=(2,))  # the caches update in place, not copied per token
    def step(params, tok, cache, key):
        logits, cache = nnx.merge(graphdef, params).decode(tok, cache)
        return pick(logits[:, -1], key), cache

    @jax.jit
    def prefill(params, tok, key):
        logits, cache = nnx.merge(graphdef, params).prefill(tok)
        return pick(logits[:, -1], key), cache

    key = jax.random.PRNGKey(seed)
    nxt, cache = prefill(params, jnp.asarray(tokens)[None], key)
    out = [int(nxt[0])]
    for _ in range(num_tokens - 1):
        key, sub = jax.random.split(key)
        nxt, cache = step(params, nxt[:, None], cache, sub)
        out.append(int(nxt[0]))
    return prompt + ByteTokenizer.decode(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m train.generate --from RUN [--prompt TEXT] ...``: print a sample; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="checkpoint", required=True, help="run directory or its checkpoints/")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    add_serving_args(parser)
    args = parser.parse_args(argv)
    try:
        model = load_model(args.checkpoint, method=args.method, attention_options=serving_options(args))
        print(generate(model, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                       seed=args.seed))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
