"""Sample text from a checkpoint: ``python -m train.generate --from runs/demo --prompt "def " --tokens 200``.

``--pretrained PATH`` samples from a pretrained Llama-family model instead (a Hugging Face directory or a GGUF
file, with its own tokenizer). Prefills the prompt (``TransformerLM.prefill``), then decodes token by token through
the model's KV cache. ``--method`` serves the weights with another attention method than they were trained with,
e.g. ``--method thrift --budget 0.1`` (ThriftAttention over a 16-bit + 4-bit KV cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from models import METHODS, ModelConfig, PretrainedError, TransformerLM, from_pretrained, pretrained_config
from models.pretrained.load import read_checkpoint
from train.checkpoint import CheckpointError, read_config, resolve_dir
from train.cli import EXIT_BAD_INPUT, Parser, interruptible, number
from train.config import DTYPES, TrainConfig
from train.data import ByteTokenizer
from train.loop import load_params, make_optimizer

#: what the serving CLIs report as one bad-input line (exit 2)
BAD_INPUT = (FileNotFoundError, ValueError, CheckpointError, PretrainedError)


def load_model(checkpoint: str, *, method: str | None = None, attention_options: dict | None = None,
               warn=print) -> TransformerLM:
    """A TransformerLM with the parameters of a training checkpoint directory (its newest intact step; a
    damaged newer one gets one ``warn`` line).

    Args:
      checkpoint: a run directory or its checkpoints/ folder.
      method: serve with this attention method instead of the trained one (the parameters are the same).
      attention_options: keyword options of the attention function (e.g. ``{"budget": 0.1}`` for thrift).
    Raises:
      FileNotFoundError: no checkpoint. CheckpointError: none is intact.
    """
    path = resolve_dir(checkpoint)
    saved = read_config(path)
    fields = dict(saved["model"], **({"method": method} if method else {}))
    model = TransformerLM(ModelConfig(**fields), rngs=nnx.Rngs(0), attention_options=attention_options)
    graphdef, params = nnx.split(model)
    tx, _ = make_optimizer(TrainConfig(**saved["train"]))
    opt_like = tx.init(params)
    return nnx.merge(graphdef, load_params(str(path), params, opt_like, warn=warn))


def with_method(model: TransformerLM, method: str, attention_options: dict | None = None) -> TransformerLM:
    """The same parameters (shared, not copied) behind another attention method and its options."""
    cfg = dataclasses.replace(model.cfg, method=method)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0),
                                                                 attention_options=attention_options)))
    return nnx.merge(graphdef, nnx.state(model))


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """``--from`` (a training run) or ``--pretrained`` (a Llama-family checkpoint), ``--method`` (serve with
    another attention method), ``--budget`` (its ThriftAttention budget) and ``--dtype``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="checkpoint", metavar="RUN",
                        help="the training run (its directory or its checkpoints/)")
    source.add_argument("--pretrained", metavar="PATH",
                        help="a pretrained Llama-family model: a Hugging Face directory or a GGUF file")
    parser.add_argument("--method", default=None, choices=METHODS,
                        help="attention method to serve with (default: the one the run trained with; dense for "
                             "--pretrained)")
    parser.add_argument("--budget", type=number(float, minimum=0.0, maximum=1.0), default=None,
                        help="thrift, sparse: the fraction of block pairs in 16-bit, in [0, 1] (default 0.05)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="--pretrained: compute dtype (default: bfloat16 on a GPU, float32 on a CPU)")


def run_tokenizer(run: str):
    """The tokenizer of a training run: its pretrained model's (``train.qat --pretrained``), else bytes."""
    pretrained = read_config(resolve_dir(run))["train"].get("pretrained")
    return ByteTokenizer if pretrained is None else read_checkpoint(pretrained, with_tensors=False).tokenizer()


def serving_model(args: argparse.Namespace, *, max_len: int | None = None):
    """The model :func:`add_serving_args`' flags ask for, and its tokenizer (warnings to stderr).

    Args:
      max_len: --pretrained: the KV caches' length (default: the checkpoint's context).
    Returns:
      (model, tokenizer): a :class:`models.TransformerLM`, and :class:`train.data.ByteTokenizer` or the pretrained
      model's :class:`models.TextTokenizer`.
    Raises:
      ValueError: ``--budget`` without ``--method thrift`` (before the checkpoint is read); ``--dtype`` without
        ``--pretrained``.
      FileNotFoundError, CheckpointError, PretrainedError: as :func:`load_model` / :func:`models.from_pretrained`.
    """
    options = None
    if args.budget is not None:
        if (args.method or "") not in ("thrift", "sparse"):
            raise ValueError("--budget is a ThriftAttention option: it needs --method thrift (or sparse)")
        options = {"budget": args.budget}
    if args.pretrained is None:
        if args.dtype is not None:
            raise ValueError("--dtype is for --pretrained models: a training run serves in the dtype it trained in")
        model = load_model(args.checkpoint, method=args.method, attention_options=options,
                           warn=lambda line: print(line, file=sys.stderr))
        return model, run_tokenizer(args.checkpoint)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    ckpt = read_checkpoint(args.pretrained)  # once: its metadata (a GGUF vocabulary takes seconds) serves both calls
    longest = {} if max_len is None else {"max_len": min(max_len, pretrained_config(ckpt).max_len)}
    return from_pretrained(ckpt, method=args.method or "dense", dtype=dtype, attention_options=options, **longest)


def generate(model: TransformerLM, prompt: str, num_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0, tokenizer=ByteTokenizer) -> str:
    """Continue ``prompt`` by ``num_tokens`` tokens (bytes for our byte-level models), stopping early at the
    tokenizer's end-of-sequence token if it has one.

    Args:
      temperature: ≥ 0; 0 is greedy (argmax).
      top_k: sample among the ``top_k`` most likely tokens; 0 samples among all.
      tokenizer: ``encode(str) → int array`` and ``decode(ids) → str`` (a pretrained model's own).
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no top-k filter), got {top_k!r}")
    top_k = min(top_k, model.cfg.vocab_size)
    tokens = tokenizer.encode(prompt)
    eos = getattr(tokenizer, "eos_id", None)
    if len(tokens) == 0:
        raise ValueError("prompt must not be empty")
    if len(tokens) + num_tokens > model.cfg.max_len:
        raise ValueError(f"prompt ({len(tokens)}) + tokens ({num_tokens}) exceeds the model's max_len "
                         f"({model.cfg.max_len})")
    graphdef, params = nnx.split(model)

    def pick(logits, key):
        if temperature == 0:
            return jnp.argmax(logits, -1)
        if top_k:
            top = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < top, -jnp.inf, logits)
        return jax.random.categorical(key, logits / temperature, -1)

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
        if out[-1] == eos:
            break
        key, sub = jax.random.split(key)
        nxt, cache = step(params, nxt[:, None], cache, sub)
        out.append(int(nxt[0]))
    return prompt + tokenizer.decode(out)


def _cache_length(args: argparse.Namespace) -> int | None:
    """--pretrained: KV caches as long as this sample needs (a pretrained context of 8k–128k tokens would allocate
    caches that long), in whole 256-token blocks; None (the run's max_len) for --from."""
    if args.pretrained is None:
        return None
    need = len(args.prompt.encode("utf-8")) + args.tokens  # bytes bound tokens from above
    return -(-need // 256) * 256


def main(argv: list[str] | None = None) -> int:
    """``python -m train.generate --from RUN | --pretrained PATH [--prompt TEXT] ...``: print a sample; returns the
    exit code."""
    parser = Parser(prog="python -m train.generate", description=__doc__.splitlines()[0])
    add_serving_args(parser)
    parser.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    parser.add_argument("--tokens", type=number(int, minimum=1), default=200,
                        help="tokens (bytes, for our byte-level runs) to generate, >= 1 (default: %(default)s)")
    parser.add_argument("--temperature", type=number(float, minimum=0.0), default=0.8,
                        help="sampling temperature, >= 0; 0 is greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=number(int, minimum=0), default=40,
                        help="sample among the k most likely tokens; 0 among all (default: %(default)s)")
    parser.add_argument("--seed", type=number(int, minimum=0), default=0, help="sampling seed (default: 0)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer = serving_model(args, max_len=_cache_length(args))
        print(generate(model, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                       seed=args.seed, tokenizer=tokenizer))
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main))
