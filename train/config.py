"""The training run's configuration: one dataclass whose fields are the CLI flags, each with its help, choices
and range, checked before anything is built or compiled."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from models import PRESETS, ModelConfig
from models.transformer import ARCHITECTURE_FIELDS

#: attention methods a run can train with (``thrift`` is training-free: it serves a trained model)
TRAIN_METHODS = ("dense", "sage", "qat_fp4")
DTYPES = ("bfloat16", "float16", "float32")
REMATS = ("none", "block", "dots")
IMPLEMENTATIONS = ("pallas", "xla")
DS_SCALES = ("tile", "row")


class ConfigError(ValueError):
    """A field with a value that makes no sense; ``field`` names it (the CLI shows it as ``--field-name``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


def _positive(x) -> str | None:
    return None if x >= 1 else f"must be >= 1, got {x}"


def _non_negative(x) -> str | None:
    return None if x >= 0 else f"must be >= 0, got {x}"


def _positive_finite(x) -> str | None:
    return None if math.isfinite(x) and x > 0 else f"must be a finite number > 0, got {x}"


def _non_negative_finite(x) -> str | None:
    return None if math.isfinite(x) and x >= 0 else f"must be a finite number >= 0, got {x}"


def _unit_interval(x) -> str | None:
    return None if 0.0 <= x <= 1.0 else f"must be in [0, 1], got {x}"


def _field(default: Any, help: str, *, choices: tuple | None = None, check: Callable | None = None):
    return dataclasses.field(default=default, metadata=dict(help=help, choices=choices, check=check))


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; the CLI flags are these fields (``--tokens-per-step`` etc.)."""

    out: str = _field("runs/pretrain", "run directory: checkpoints, metrics.jsonl, loss.png, summary.json "
                      "(rerun the same command to resume)")
    preset: str = _field("tiny", "model size", choices=tuple(PRESETS))
    method: str = _field("sage", "attention method to train with", choices=TRAIN_METHODS)
    qk_norm: bool = _field(True, "RMS-normalize q and k per head (bounds SageBwd's dS error at large steps)")
    smooth_k: bool = _field(True, "subtract K's token mean before quantizing (sage)")
    dtype: str = _field("bfloat16", "compute dtype of the model (parameters stay float32)", choices=DTYPES)
    remat: str = _field("none", "recompute per block in the backward: none, block (all), dots (keep matmul outputs)",
                        choices=REMATS)
    max_len: int | None = _field(None, "the model's longest sequence (default: the preset's)", check=_positive)
    implementation: str | None = _field(None, "attention implementation (default: pallas on a GPU, xla on CPU)",
                                        choices=IMPLEMENTATIONS)
    naive_backward: bool = _field(False, "qat_fp4 only: the mismatched 16-bit backward (ablation)")
    ds_scale: str = _field("tile", "sage only: INT8 dS scales per tile (the paper) or per row (more accurate, "
                           "slower)", choices=DS_SCALES)
    fuse_qk_prologue: bool = _field(True, "sage, qat_fp4: QK-norm and RoPE inside the quantize kernels "
                                    "(same values)")
    corpus: str | None = _field(None, "text file or folder to train on (default: this Python's standard library)")
    max_corpus_mb: int = _field(64, "read at most this many MiB of the corpus", check=_positive)
    steps: int = _field(200, "optimizer steps in all", check=_positive)
    batch: int = _field(16, "sequences per micro-step, over all devices", check=_positive)
    seq: int = _field(128, "tokens per sequence", check=_positive)
    accum: int = _field(1, "gradient accumulation micro-steps per step", check=_positive)
    tokens_per_step: int | None = _field(None, "sets accum = tokens_per_step / (batch * seq), which must divide",
                                         check=_positive)
    lr: float = _field(3e-3, "peak learning rate (AdamW)", check=_positive_finite)
    warmup: int = _field(20, "linear warmup steps before the cosine decay", check=_non_negative)
    min_lr_ratio: float = _field(0.1, "final learning rate as a fraction of lr", check=_unit_interval)
    weight_decay: float = _field(0.1, "AdamW weight decay", check=_non_negative_finite)
    clip: float = _field(1.0, "global gradient-norm clipping threshold", check=_positive_finite)
    eval_every: int = _field(50, "validation loss every this many steps (and at the end)", check=_positive)
    eval_batches: int = _field(4, "validation batches per evaluation", check=_positive)
    ckpt_every: int = _field(100, "checkpoint every this many steps (and at the end)", check=_positive)
    seed: int = _field(0, "seed of the parameters and the data order", check=_non_negative)
    devices: int | None = _field(None, "data-parallel devices (default: all local devices)", check=_positive)
    init_from: str | None = _field(None, "start from this run's parameters (fresh optimizer): QAT, fine-tuning")
    pretrained: str | None = _field(None, "start from a pretrained Llama-family model (a Hugging Face directory or "
                                    "a GGUF file): its architecture, weights and tokenizer replace --preset and "
                                    "--qk-norm")
    stop_after: int | None = _field(None, "stop, with a checkpoint, after this many steps of this invocation",
                                    check=_positive)
    coordinator: str | None = _field(None, "several hosts: the jax.distributed coordinator, HOST:PORT")
    num_processes: int | None = _field(None, "several hosts: the number of processes", check=_positive)
    process_id: int | None = _field(None, "several hosts: this process's index", check=_non_negative)

    def validate(self) -> "TrainConfig":
        """Check every field's type, choices and range; returns self. Raises :class:`ConfigError`."""
        if self.method == "thrift":
            raise ConfigError("method", "'thrift' is training-free (inference only): train with dense, sage or "
                              "qat_fp4, then serve with `python -m train.generate --from RUN --method thrift`")
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            kind = _value_type(f)
            if kind is bool and not isinstance(value, bool):
                raise ConfigError(f.name, f"must be true or false, got {value!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f.name, f"must be an integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f.name, f"must be a number, got {value!r}")
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ConfigError(f.name, f"must be one of {', '.join(meta['choices'])}, got {value!r}")
            if meta["check"] is not None and (problem := meta["check"](value)) is not None:
                raise ConfigError(f.name, problem)
        if self.pretrained is not None and self.init_from is not None:
            raise ConfigError("pretrained", "starts from a pretrained model's weights: it cannot be combined with "
                              "--init-from")
        if self.naive_backward and self.method != "qat_fp4":
            raise ConfigError("naive_backward", f"is an Attn-QAT ablation: it needs --method qat_fp4, got "
                              f"{self.method!r}")
        if self.ds_scale != "tile" and self.method != "sage":
            raise ConfigError("ds_scale", f"is a SageBwd option: it needs --method sage, got {self.method!r}")
        if self.tokens_per_step is not None and self.tokens_per_step % (self.batch * self.seq):
            raise ConfigError("tokens_per_step", f"({self.tokens_per_step}) must be a multiple of batch × seq "
                              f"({self.batch * self.seq})")
        return self

    def resolved(self) -> "TrainConfig":
        """Validated, with ``accum`` derived from ``tokens_per_step`` where that is set."""
        cfg = dataclasses.replace(self).validate()
        if cfg.tokens_per_step is not None:
            cfg.accum = cfg.tokens_per_step // (cfg.batch * cfg.seq)
        return cfg


def _value_type(f: dataclasses.Field) -> type:
    """bool, int, float or str: a field's type without ``| None``."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return {"bool": bool, "int": int, "float": float}.get(text.split("|")[0].strip(), str)


#: the model's architecture fields, and the flag that sets each: the preset sets the sizes, --qk-norm QK-norm, and
#: only a pretrained model (--pretrained) the rest
_PRESET_FIELDS = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_hidden")
ARCHITECTURE_FLAGS = {name: "qk_norm" if name == "qk_norm" else "preset" if name in _PRESET_FIELDS else "pretrained"
                      for name in ARCHITECTURE_FIELDS}


def check_same_architecture(saved: dict, model: dict, source: str, *, flag: str | None = None) -> None:
    """``ConfigError`` naming the flag if the model a run would build cannot take a checkpoint's parameters.

    Args:
      saved: the checkpoint's model config (a dict of :class:`models.ModelConfig` fields).
      model: the model config this run builds (as a dict).
      source: the checkpoint, for the message.
      flag: the field to name (default: the one that sets the first differing model field).
    """
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}  # an older checkpoint lacks new fields

    def value(config, name):
        x = config.get(name, defaults[name])
        return tuple(x) if isinstance(x, list) else x  # JSON turned a tuple into a list

    diffs = [(name, value(saved, name), value(model, name)) for name in ARCHITECTURE_FLAGS
             if value(saved, name) != value(model, name)]
    if diffs:
        name = diffs[0][0]
        shown = ", ".join(f"{n} {m} here vs {s} there" for n, s, m in diffs)
        raise ConfigError(flag or ARCHITECTURE_FLAGS[name],
                          f"the model does not match the checkpoint {source} ({shown})")
