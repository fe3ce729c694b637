"""Quantization-aware continued training: ``python -m train.qat --from RUN [--method qat_fp4]``.

Starts from a pretraining run's parameters (fresh optimizer), switches the attention method (default
``qat_fp4``, Attn-QAT; ``sage`` for INT8; ``--naive-backward true`` for the mismatched-backward ablation) and
trains into its own ``--out``. The other flags are ``train.pretrain``'s; the preset, sequence length and batch
default to the run's, the learning rate to 0.3× its own; the model must match the checkpoint's.
"""

from __future__ import annotations

import sys

from train.checkpoint import CheckpointError, read_config
from train.cli import EXIT_BAD_INPUT, Parser, add_config_flags, config_from, interruptible, run_training


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="python -m train.qat", description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", required=True, metavar="RUN",
                        help="the pretraining run (its directory or its checkpoints/)")
    add_config_flags(parser, defaults={"out": "runs/qat", "method": "qat_fp4", "warmup": 10},
                     skip=("init_from",))
    source = parser.parse_known_args(argv)[0].source  # --help and a missing --from end here
    try:
        saved = read_config(source)["train"]
    except (FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser.set_defaults(preset=saved["preset"], seq=saved["seq"], batch=saved["batch"], lr=saved["lr"] * 0.3)
    cfg = config_from(parser.parse_args(argv))
    cfg.init_from = source
    return run_training(parser, cfg)


if __name__ == "__main__":
    sys.exit(interruptible(main))
