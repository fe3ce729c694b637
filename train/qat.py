"""Quantization-aware continued training: ``python -m train.qat --from CHECKPOINT [--method qat_fp4]``.

Starts from a pretraining checkpoint's parameters (fresh optimizer), switches the
attention method (default ``qat_fp4``, Attn-QAT; ``sage`` for INT8; add
``--naive-backward true`` for the mismatched-backward ablation), and trains into its own ``--out``. Other flags as
``train.pretrain``; the model preset must match the checkpoint's.
"""

from __future__ import annotations

import argparse
import sys

from train.checkpoint import read_config
from train.pretrain import run_cli


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    source_parser = argparse.ArgumentParser(add_help=False)
    source_parser.add_argument("--from", dest="source")
    known, rest = source_parser.parse_known_args(argv)
    if known.source is None:
        print("error: --from CHECKPOINT is required", file=sys.stderr)
        return 2
    try:
        saved = read_config(known.source)["train"]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = {"preset": saved["preset"], "seq": saved["seq"], "batch": saved["batch"], "out": "runs/qat", "method": "qat_fp4",
                "lr": saved["lr"] * 0.3, "warmup": 10}
    return run_cli(rest + ["--init-from", known.source], __doc__.splitlines()[0], defaults)


if __name__ == "__main__":
    sys.exit(main())
