"""What the command-line tools share: a parser whose errors are one line, flags from :class:`TrainConfig`,
value checks, and the exit codes (0 done, 2 bad input, 3 diverged, 130 interrupted)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any, Callable, NoReturn

from train.config import ConfigError, TrainConfig, _value_type

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """``argparse`` with one-line errors (``prog: error: argument --flag: ...``, exit 2): with 36 flags the usage
    text would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def number(kind: type, *, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind`` (int or float), finite, within the bounds given."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, got {text}")
        return value

    return convert


def add_config_flags(parser: argparse.ArgumentParser, defaults: dict | None = None,
                     skip: tuple[str, ...] = (), group: Any = None) -> None:
    """One ``--flag`` per :class:`TrainConfig` field, with its help, choices and default; ``--pretrained`` goes
    into ``group`` (e.g. a mutually exclusive group with ``--from``) when one is given."""
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        kind = _value_type(f)
        default = (defaults or {}).get(f.name, f.default)
        meta = f.metadata
        text = meta["help"]
        if meta["choices"]:
            text += f" ({', '.join(meta['choices'])})"
        text += f"; default: {default}"
        into = group if group is not None and f.name == "pretrained" else parser
        into.add_argument("--" + f.name.replace("_", "-"), type=parse_bool if kind is bool else kind,
                            default=default, choices=meta["choices"], help=text,
                            metavar="{true,false}" if kind is bool else None if meta["choices"] else f.name.upper())


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed flags (other attributes of ``args`` are ignored)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def fail(parser: argparse.ArgumentParser, error: ConfigError) -> NoReturn:
    parser.error(f"argument {error.flag}: {error.message}")


def run_training(parser: argparse.ArgumentParser, cfg: TrainConfig) -> int:
    """Train (or resume) ``cfg``; print one summary line; map failures to an exit code and one line."""
    import jax

    from train.checkpoint import CheckpointError
    from train.loop import TrainingDiverged, TrainingInterrupted, train

    try:
        cfg.validate()
    except ConfigError as e:
        fail(parser, e)
    lead = True
    try:
        summary = train(cfg)
        lead = jax.process_index() == 0  # several processes: process 0 reports (asked before the shutdown)
    except ConfigError as e:
        fail(parser, e)
    except TrainingDiverged as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return EXIT_DIVERGED
    except TrainingInterrupted as e:
        saved = "no checkpoint yet" if e.checkpoint is None else f"last checkpoint: step {e.checkpoint}"
        print(f"\ninterrupted at step {e.step} ({saved}); rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:  # several processes: leave the coordination service together (a no-op otherwise)
        jax.distributed.shutdown()
    if not lead:
        return 0
    val = summary["val_loss"]
    print(f"done: step {summary['step']}, train loss {summary['loss']:.4f}"
          + (f", val loss {val:.4f}" if val is not None else "")
          + f"; checkpoint {summary['checkpoint']}; plot {summary['plot']}")
    return 0


def interruptible(main: Callable[[], int]) -> int:
    """``main()``, with Ctrl-C outside training (start-up, sampling) as exit 130 and one line, no traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
