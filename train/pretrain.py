"""Pretraining CLI: ``python -m train.pretrain [--preset tiny] [--method sage] [--steps 200] ...``.

Every field of :class:`train.config.TrainConfig` is a flag (``--tokens-per-step``, ``--eval-every``,
``--devices``...; ``--help`` lists them with their meaning). Writes ``<out>/checkpoints`` (Orbax),
``<out>/metrics.jsonl``, ``<out>/loss.png`` and ``<out>/summary.json``; rerunning with the same ``--out``
resumes from the newest intact checkpoint. Exit codes: 0 done, 2 bad input, 3 diverged (NaN guard), 130
interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys

from train.cli import Parser, add_config_flags, config_from, interruptible, run_training


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m train.pretrain", description=__doc__.splitlines()[0])
    add_config_flags(parser)
    args = parser.parse_args(argv)
    return run_training(parser, config_from(args))


if __name__ == "__main__":
    sys.exit(interruptible(main))
