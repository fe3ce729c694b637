"""Validation loss of a checkpoint, served with its own or another attention method.

``python -m train.evaluate --from RUN [--method thrift --budget 0.05] [--seq 2048] [--windows 16]`` prints the
loss in nats and bits per byte over non-overlapping windows of the run's validation split (the same corpus,
size cap and split as its training), and the loss per position bucket: how much the model gains from a
longer context, which is where a long-context method such as ThriftAttention can lose.

``python -m train.evaluate --pretrained PATH --text FILE_OR_DIR --seq N --method M [--budget F]`` does the same for
a pretrained Llama-family model on windows of a local text (tokenized with its own tokenizer): loss in nats per
token, perplexity, the loss per position bucket, and how often its argmax agrees with 16-bit attention's.
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import TransformerLM
from train.checkpoint import CheckpointError, read_config, resolve_dir
from train.cli import EXIT_BAD_INPUT, Parser, interruptible, number
from train.data import ByteTokenizer, load_corpus, tokenize, train_val_split
from train.generate import BAD_INPUT, add_serving_args, serving_model, with_method


def validation_windows(run: str, seq: int, windows: int) -> np.ndarray:
    """The first ``windows`` non-overlapping windows of a run's validation split: int32 (windows, seq + 1).

    Raises:
      ValueError if the split holds fewer windows of ``seq + 1`` tokens.
    """
    saved = read_config(resolve_dir(run))["train"]
    _, val = train_val_split(load_corpus(saved["corpus"], saved["max_corpus_mb"] * 2**20))
    available = len(val) // (seq + 1)
    if seq < 1 or windows < 1 or windows > available:
        raise ValueError(f"the validation split ({len(val)} tokens) holds {available} windows of seq + 1 = {seq + 1} "
                         f"tokens; asked for windows={windows}, seq={seq}")
    return val[: windows * (seq + 1)].reshape(windows, seq + 1).astype(np.int32)


def text_windows(path: str | None, tokenizer, seq: int, windows: int) -> np.ndarray:
    """The first ``windows`` non-overlapping windows of a text file or folder (None: the built-in corpus,
    :func:`train.data.load_corpus`), tokenized: int32 (windows, seq + 1).

    Raises:
      FileNotFoundError: no such path. ValueError: it holds fewer windows of ``seq + 1`` tokens.
    """
    if seq < 1 or windows < 1:
        raise ValueError(f"seq and windows must be >= 1, got seq={seq}, windows={windows}")
    need = windows * (seq + 1)
    tokens = tokenize(load_corpus(path, max(2**20, 16 * need)), tokenizer)  # ≤ 16 bytes per token is ample
    if len(tokens) < need:
        raise ValueError(f"{path or 'the built-in corpus'} holds {len(tokens) // (seq + 1)} windows of seq + 1 = "
                         f"{seq + 1} tokens; asked for {windows}")
    return tokens[:need].reshape(windows, seq + 1).astype(np.int32)


def scores(model: TransformerLM, windows: np.ndarray, *, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Next-token cross-entropy and the argmax prediction of every position, from one forward pass per batch.

    Args:
      model: the LM to score with (its attention method and options as built).
      windows: int32 (N, seq + 1) from :func:`validation_windows`; inputs ``[:, :-1]``, targets ``[:, 1:]``.
      batch: windows per forward call (N need not be a multiple: the last call is shorter).
    Returns:
      float64 (N, seq) nats, and int32 (N, seq) predicted tokens.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    graphdef, params = nnx.split(model)

    @jax.jit
    def losses_and_picks(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return (optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]),
                jnp.argmax(logits, -1).astype(jnp.int32))

    out = [losses_and_picks(params, jnp.asarray(windows[i:i + batch])) for i in range(0, len(windows), batch)]
    return (np.concatenate([np.asarray(x, np.float64) for x, _ in out]),
            np.concatenate([np.asarray(p) for _, p in out]))


def token_losses(model: TransformerLM, windows: np.ndarray, *, batch: int) -> np.ndarray:
    """Next-token cross-entropy of every position: float64 (windows, seq), nats (:func:`scores`)."""
    return scores(model, windows, batch=batch)[0]


def summarize(losses: np.ndarray, buckets: int = 4, *, unit: str = "byte") -> dict:
    """Mean loss (nats, ``bits_per_<unit>``, perplexity), per window and per position bucket of a (windows, seq)
    loss array; ``unit`` is "byte" for our byte-level models, "token" for a pretrained tokenizer's."""
    per_bucket = [float(x.mean()) for x in np.array_split(losses, buckets, axis=1)]
    loss = float(losses.mean())
    return {"loss": loss, f"bits_per_{unit}": loss / math.log(2), "perplexity": math.exp(loss),
            "window_loss": losses.mean(axis=1).tolist(), "bucket_loss": per_bucket, "tokens": int(losses.size)}


def main(argv: list[str] | None = None) -> int:
    """``python -m train.evaluate --from RUN | --pretrained PATH --text FILE_OR_DIR ...``: print the loss; returns
    the exit code."""
    parser = Parser(prog="python -m train.evaluate", description=__doc__.splitlines()[0])
    add_serving_args(parser)
    parser.add_argument("--text", metavar="FILE_OR_DIR", default=None,
                        help="score windows of this text file or folder (required with --pretrained; default for "
                             "--from: the run's validation split)")
    parser.add_argument("--seq", type=number(int, minimum=1), default=None,
                        help="window length in tokens (bytes for our runs), >= 1 (default: the run's --seq; 1024 "
                             "for --pretrained)")
    parser.add_argument("--windows", type=number(int, minimum=1), default=16,
                        help="windows to score (default: %(default)s)")
    parser.add_argument("--batch", type=number(int, minimum=1), default=4,
                        help="windows per forward call (default: %(default)s)")
    parser.add_argument("--buckets", type=number(int, minimum=1), default=4,
                        help="position buckets of the per-position loss (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    if args.pretrained is not None and args.text is None:
        parser.error("argument --text: required with --pretrained (a text file or folder to score)")
    try:
        seq = args.seq or (1024 if args.pretrained else read_config(resolve_dir(args.checkpoint))["train"]["seq"])
        model, tokenizer = serving_model(args, max_len=seq)
        windows = (validation_windows(args.checkpoint, seq, args.windows) if args.text is None
                   else text_windows(args.text, tokenizer, seq, args.windows))
        unit = "byte" if tokenizer is ByteTokenizer else "token"
        losses, picks = scores(model, windows, batch=args.batch)
        result = summarize(losses, args.buckets, unit=unit)
        if model.cfg.method != "dense":  # where 16-bit attention over the same weights predicts the same token
            reference = scores(with_method(model, "dense"), windows, batch=args.batch)[1]
            result["argmax_agreement"] = float((picks == reference).mean())
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "window_loss"}))
        return 0
    buckets = ", ".join(f"{x:.4f}" for x in result["bucket_loss"])
    agree = (f"; argmax agrees with 16-bit attention at {result['argmax_agreement']:.2%} of positions"
             if "argmax_agreement" in result else "")
    print(f"loss {result['loss']:.4f} nats/{unit} ({result[f'bits_per_{unit}']:.4f} bits/{unit}, perplexity "
          f"{result['perplexity']:.3f}) over {result['tokens']} tokens ({args.windows} windows of {seq}); by position "
          f"bucket: {buckets}{agree}")
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main))
