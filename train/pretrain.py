"""Pretraining CLI: ``python -m train.pretrain [--preset tiny] [--method sage] [--steps 200] ...``.

Every field of :class:`train.loop.TrainConfig` is a flag (``--tokens-per-step``,
``--eval-every``, ``--devices``...). Writes ``<out>/checkpoints`` (Orbax),
``<out>/metrics.jsonl``, ``<out>/loss.png`` and ``<out>/summary.json``; rerunning
with the same ``--out`` resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing

import jax

from train.loop import TrainConfig, TrainingDiverged, train


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def parser_for(config_cls=TrainConfig, description: str = "", defaults: dict | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one ``--flag`` per dataclass field."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        hint = hints[field.name]
        optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kind = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        conv = _parse_bool if kind is bool else kind
        default = (defaults or {}).get(field.name, field.default)
        parser.add_argument("--" + field.name.replace("_", "-"), type=conv, default=default,
                            help=f"default: {default}")
    return parser


def run_cli(argv, description: str, defaults: dict | None = None) -> int:
    args = parser_for(TrainConfig, description, defaults).parse_args(argv)
    cfg = TrainConfig(**vars(args))
    try:
        summary = train(cfg)
        lead = jax.process_index() == 0  # several processes: process 0 reports (asked before the shutdown)
    except TrainingDiverged as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:  # several processes: leave the coordination service together (a no-op otherwise)
        jax.distributed.shutdown()
    if not lead:
        return 0
    val = summary["val_loss"]
    print(f"done: step {summary['step']}, train loss {summary['loss']:.4f}"
          + (f", val loss {val:.4f}" if val is not None else "")
          + f"; checkpoint {summary['checkpoint']}; plot {summary['plot']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
