"""Quantization-aware continued training: ``python -m train.qat --from RUN | --pretrained PATH [--method qat_fp4]``.

Starts from a pretraining run's parameters or a pretrained Llama-family model (a Hugging Face directory or a GGUF
file, with its tokenizer; ``--corpus`` is the local text to train on), with a fresh optimizer, switches the
attention method (default ``qat_fp4``, Attn-QAT; ``sage`` for INT8; ``dense`` for the 16-bit baseline;
``--naive-backward true`` for the mismatched-backward ablation) and trains into its own ``--out``, with checkpoints
and resume as for pretraining. The other flags are ``train.pretrain``'s. From a run, the preset, sequence length and
batch default to the run's and the learning rate to 0.3× its own; from a pretrained model, sequence 512, batch 8 and
a learning rate of 1e-4.
"""

from __future__ import annotations

import sys

from train.checkpoint import CheckpointError, read_config
from train.cli import EXIT_BAD_INPUT, Parser, add_config_flags, config_from, interruptible, run_training

#: defaults of continued training from a pretrained model (a fine-tuning learning rate, windows it can afford on
#: one GPU)
PRETRAINED_DEFAULTS = {"seq": 512, "batch": 8, "lr": 1e-4, "warmup": 20}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="python -m train.qat", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source", metavar="RUN",
                        help="the pretraining run (its directory or its checkpoints/)")
    add_config_flags(parser, defaults={"out": "runs/qat", "method": "qat_fp4", "warmup": 10},
                     skip=("init_from",), group=source)
    known = parser.parse_known_args(argv)[0]  # --help and a missing or doubled source end here
    if known.pretrained is not None:
        parser.set_defaults(**PRETRAINED_DEFAULTS)
        return run_training(parser, config_from(parser.parse_args(argv)))
    try:
        saved = read_config(known.source)["train"]
    except (FileNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser.set_defaults(preset=saved["preset"], seq=saved["seq"], batch=saved["batch"], lr=saved["lr"] * 0.3)
    cfg = config_from(parser.parse_args(argv))
    cfg.init_from = known.source
    return run_training(parser, cfg)


if __name__ == "__main__":
    sys.exit(interruptible(main))
