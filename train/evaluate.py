"""Validation loss of a checkpoint, served with its own or another attention method.

``python -m train.evaluate --from RUN [--method thrift --budget 0.05] [--seq 2048] [--windows 16]`` prints the
loss in nats and bits per byte over non-overlapping windows of the run's validation split (the same corpus,
size cap and split as its training), and the loss per position bucket: how much the model gains from a
longer context, which is where a long-context method such as ThriftAttention can lose.
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
from train.data import load_corpus, train_val_split
from train.generate import add_serving_args, serving_model


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


def token_losses(model: TransformerLM, windows: np.ndarray, *, batch: int) -> np.ndarray:
    """Next-token cross-entropy of every position: float64 (windows, seq), nats.

    Args:
      model: the LM to score with (its attention method and options as built).
      windows: int32 (N, seq + 1) from :func:`validation_windows`; inputs ``[:, :-1]``, targets ``[:, 1:]``.
      batch: windows per forward call (N need not be a multiple: the last call is shorter).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    graphdef, params = nnx.split(model)

    @jax.jit
    def losses(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])

    out = [np.asarray(losses(params, jnp.asarray(windows[i:i + batch])), np.float64)
           for i in range(0, len(windows), batch)]
    return np.concatenate(out)


def summarize(losses: np.ndarray, buckets: int = 4) -> dict:
    """Mean loss (nats and bits per byte), per window and per position bucket of a (windows, seq) loss array."""
    per_bucket = [float(x.mean()) for x in np.array_split(losses, buckets, axis=1)]
    loss = float(losses.mean())
    return {"loss": loss, "bits_per_byte": loss / math.log(2), "window_loss": losses.mean(axis=1).tolist(),
            "bucket_loss": per_bucket, "tokens": int(losses.size)}


def main(argv: list[str] | None = None) -> int:
    """``python -m train.evaluate --from RUN ...``: print the validation loss; returns the exit code."""
    parser = Parser(prog="python -m train.evaluate", description=__doc__.splitlines()[0])
    add_serving_args(parser)
    parser.add_argument("--seq", type=number(int, minimum=1), default=None,
                        help="window length in bytes, >= 1 (default: the run's --seq)")
    parser.add_argument("--windows", type=number(int, minimum=1), default=16,
                        help="validation windows to score (default: %(default)s)")
    parser.add_argument("--batch", type=number(int, minimum=1), default=4,
                        help="windows per forward call (default: %(default)s)")
    parser.add_argument("--buckets", type=number(int, minimum=1), default=4,
                        help="position buckets of the per-position loss (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        model = serving_model(args)
        seq = args.seq if args.seq is not None else read_config(resolve_dir(args.checkpoint))["train"]["seq"]
        windows = validation_windows(args.checkpoint, seq, args.windows)
        result = summarize(token_losses(model, windows, batch=args.batch), args.buckets)
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "window_loss"}))
    else:
        buckets = ", ".join(f"{x:.4f}" for x in result["bucket_loss"])
        print(f"validation loss {result['loss']:.4f} nats/byte ({result['bits_per_byte']:.4f} bits/byte) over "
              f"{result['tokens']} tokens ({args.windows} windows of {seq}); by position bucket: {buckets}")
    return 0


if __name__ == "__main__":
    sys.exit(interruptible(main))
