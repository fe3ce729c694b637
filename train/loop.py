"""The training loop shared by pretraining and QAT: jitted data-parallel step, eval, checkpoints, NaN guard."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

import lowbit_jax as lb
from models import ModelConfig, TransformerLM, from_pretrained, model_config, pretrained_config
from train.checkpoint import SUBDIR, Checkpoints, read_config, resolve_dir
from train.config import TrainConfig, check_same_architecture
from train.data import ByteTokenizer, PackedBatches, load_corpus, tokenize, train_val_split
from train.metrics import MetricsLog, plot_losses
from train.parallel import DATA_AXIS, batch_sharding, data_parallel, init_distributed, make_mesh


class TrainingDiverged(RuntimeError):
    """A step produced a non-finite loss or gradient; the last good checkpoint is kept."""


class TrainingInterrupted(RuntimeError):
    """Ctrl-C (KeyboardInterrupt) during training: ``step`` steps were done, ``checkpoint`` is the last saved step
    (None: none yet). Nothing half-written is left: Orbax commits a step by renaming it when complete."""

    def __init__(self, step: int, checkpoint: int | None):
        super().__init__(f"interrupted at step {step}")
        self.step, self.checkpoint = step, checkpoint


def _loss_fn(graphdef, params, tokens):
    model = nnx.merge(graphdef, params)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup and cosine decay, after global-norm clipping; returns (tx, schedule)."""
    warmup = min(max(cfg.warmup, 1), max(cfg.steps - 1, 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1),
                                                  cfg.lr * cfg.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    return tx, schedule


def build(cfg: TrainConfig, *, mcfg: ModelConfig | None = None) -> dict:
    """Model, optimizer, data and the jitted steps for a resolved config (``mcfg``: its model config, if the caller
    has it already; a pretrained model's costs a read of the checkpoint's metadata).

    Returns:
      a dict: ``model_config``, ``mesh``, ``graphdef``, ``params`` (float32: a pretrained model's weights with
      ``cfg.pretrained``, else initialised from ``cfg.seed``), ``tokenizer``, ``tx``, ``schedule``,
      ``train_step(params, opt_state, batch (accum, global batch, seq + 1) int32) -> (params, opt_state,
      {"loss", "grad_norm"})`` (jitted, data parallel over ``mesh``) and ``eval_fn(params, batch) -> loss``.
    """
    mcfg = mcfg or _model_config(cfg)
    if cfg.seq > mcfg.max_len:
        raise ValueError(f"seq ({cfg.seq}) exceeds the model's max_len ({mcfg.max_len}) for "
                         f"{cfg.pretrained or f'preset {cfg.preset!r}'}; set max_len to train longer sequences")
    mesh = make_mesh(cfg.devices)
    if cfg.batch % mesh.size:
        raise ValueError(f"batch ({cfg.batch}) must be divisible by the number of devices ({mesh.size})")
    options = {} if cfg.implementation is None else {"implementation": cfg.implementation}
    if cfg.naive_backward:
        options["naive_backward"] = True
    if cfg.ds_scale != "tile":
        head_dim = mcfg.head_size
        options["config"] = dataclasses.replace(lb.sage_fwd_config(head_dim, True), ds_scale=cfg.ds_scale)
    if cfg.implementation == "pallas" and jax.default_backend() == "cpu":
        options["interpret"] = True
    if cfg.pretrained:
        model, tokenizer = from_pretrained(cfg.pretrained, attention_options=options,
                                           **_run_options(cfg, mcfg.max_len))
    else:
        model, tokenizer = TransformerLM(mcfg, rngs=nnx.Rngs(cfg.seed), attention_options=options), ByteTokenizer
    graphdef, params = nnx.split(model)
    tx, schedule = make_optimizer(cfg)
    loss_fn = lambda p, t: _loss_fn(graphdef, p, t)  # noqa: E731

    def step_fn(params, opt_state, batch):
        def micro(g_acc, tokens):
            loss, g = jax.value_and_grad(loss_fn)(params, tokens)
            return jax.tree.map(jnp.add, g_acc, g), loss

        grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), batch)
        grads = jax.lax.pmean(jax.tree.map(lambda g: g / batch.shape[0], grads), DATA_AXIS)
        loss = jax.lax.pmean(losses.mean(), DATA_AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    eval_fn = jax.jit(jax.shard_map(lambda p, b: jax.lax.pmean(loss_fn(p, b[0]), DATA_AXIS), mesh=mesh,
                                    in_specs=(P(), P(None, DATA_AXIS)), out_specs=P(), check_vma=False))
    return dict(model_config=mcfg, mesh=mesh, graphdef=graphdef, params=params, tokenizer=tokenizer, tx=tx,
                schedule=schedule,
                train_step=data_parallel(step_fn, mesh), eval_fn=eval_fn)


def _architecture_source(cfg: TrainConfig) -> tuple[dict, str] | None:
    """The saved model config a run must match, and where it is from: its own checkpoints (resuming) or
    ``init_from``'s; None for a fresh run."""
    for source in (Path(cfg.out) / SUBDIR, cfg.init_from):
        if source is None or not Path(source).exists():
            continue
        try:
            return read_config(source)["model"], str(source)
        except FileNotFoundError:
            if source == cfg.init_from:
                raise
    if cfg.init_from is not None:
        read_config(cfg.init_from)  # FileNotFoundError naming it
    return None


def _run_options(cfg: TrainConfig, max_len: int | None = None) -> dict:
    """The model fields a run sets (the rest are its preset's or its pretrained model's)."""
    longest = max_len or cfg.max_len
    return dict(method=cfg.method, smooth_k=cfg.smooth_k, dtype=cfg.dtype, remat=cfg.remat,
                fuse_qk_prologue=cfg.fuse_qk_prologue, **({} if longest is None else {"max_len": longest}))


def _model_config(cfg: TrainConfig):
    """The :class:`models.ModelConfig` a run builds: its preset's, or its pretrained model's (metadata only)."""
    if cfg.pretrained:
        return pretrained_config(cfg.pretrained, **_run_options(cfg))
    return model_config(cfg.preset, qk_norm=cfg.qk_norm, **_run_options(cfg))


def train(cfg: TrainConfig, *, log: Callable[..., None] = print) -> dict:
    """Run (or resume) training; returns a summary dict.

    Resuming takes the newest intact checkpoint: a damaged step is reported in one line, moved to
    ``<out>/checkpoints-damaged/`` and training goes on from the step before it.

    Raises:
      ConfigError: a field that makes no sense, or a model that does not match the checkpoint it resumes or
        starts from (before anything is built).
      CheckpointError: checkpoints exist but none is intact.
      TrainingDiverged: a non-finite loss or gradient norm (nothing is saved for that step; the last good
        checkpoint stays).
      TrainingInterrupted: Ctrl-C; the last checkpoint stays.
    """
    cfg = cfg.resolved()
    mcfg = _model_config(cfg)
    saved = _architecture_source(cfg)
    if saved is not None:
        check_same_architecture(saved[0], dataclasses.asdict(mcfg), saved[1],
                                flag="pretrained" if cfg.pretrained else None)
    init_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)
    lead = jax.process_index() == 0  # several processes: all train and checkpoint, process 0 alone reports
    if not lead:
        log = lambda *_, **__: None  # noqa: E731
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    b = build(cfg, mcfg=mcfg)
    corpus = load_corpus(cfg.corpus, cfg.max_corpus_mb * 2**20)
    train_tokens, val_tokens = train_val_split(tokenize(corpus, b["tokenizer"]))
    unit = "byte" if b["tokenizer"] is ByteTokenizer else "token"
    data = PackedBatches(train_tokens, cfg.seq, cfg.batch, cfg.accum, cfg.seed)
    val = PackedBatches(val_tokens, cfg.seq, cfg.batch, 1, cfg.seed + 1)
    # Placed on the mesh first, so that a restore comes back with the same (global) sharding: with several
    # processes a restored single-device array could not be moved onto the other processes' devices.
    replicated = NamedSharding(b["mesh"], P())
    params, opt_state = jax.device_put((b["params"], b["tx"].init(b["params"])), replicated)
    ckpts = Checkpoints(out / SUBDIR)
    saved_config = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(b["model_config"])}
    start = 0
    restored = ckpts.restore_intact({"params": params, "opt_state": opt_state}, warn=log, move_damaged=lead)
    if restored is not None:
        start, state, _ = restored
        params, opt_state = state["params"], state["opt_state"]
        log(f"resumed from {ckpts.directory} at step {start}")
    elif cfg.init_from:
        params = load_params(cfg.init_from, params, opt_state, warn=log)
        log(f"initialised parameters from {cfg.init_from}")
    metrics = MetricsLog(out / "metrics.jsonl", append=start > 0, writer=lead)
    metrics.truncate(start)  # steps after the checkpoint are trained again: their old records go
    shard = batch_sharding(b["mesh"])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    log(f"model {cfg.pretrained or cfg.preset} ({n_params / 1e6:.2f}M params, attention {cfg.method}), "
        f"{data.tokens_per_step} tokens/step on {b['mesh'].size} device(s), corpus {len(corpus) / 2**20:.1f} MiB")

    def evaluate():
        losses = [float(b["eval_fn"](params, jax.device_put(val.batch(i), shard))) for i in range(cfg.eval_batches)]
        return float(np.mean(losses))

    last_loss, val_loss, tok_s = float("nan"), None, 0.0
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    if start >= end:  # resumed a finished run: report its last numbers instead of NaN
        previous = metrics.read()
        if previous:
            last_loss = previous[-1].get("loss", last_loss)
            val_loss = next((r["val_loss"] for r in reversed(previous) if "val_loss" in r), None)
        log(f"run already at step {start} of {cfg.steps}: nothing to train (use a new --out or more --steps)")
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc="train", disable=None if lead else True)
    t_last = time.perf_counter()
    done = start
    try:
        for step in bar:
            batch = jax.device_put(data.batch(step), shard)
            params, opt_state, m = b["train_step"](params, opt_state, batch)
            loss, gnorm = float(m["loss"]), float(m["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                good = ckpts.latest_step()
                raise TrainingDiverged(
                    f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step {step + 1} "
                    f"(loss {loss}, grad norm {gnorm}); stopping. Last good checkpoint: "
                    f"{'none' if good is None else f'step {good} in {ckpts.directory}'}")
            now = time.perf_counter()
            tok_s = data.tokens_per_step / (now - t_last)
            t_last = now
            last_loss = loss
            done = step + 1
            record = {"step": step + 1, "loss": loss, "grad_norm": gnorm, "lr": float(b["schedule"](step)),
                      "tokens_per_s": tok_s}
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                val_loss = evaluate()
                record.update(val_loss=val_loss, **{f"val_bits_per_{unit}": val_loss / math.log(2)})
                log(f"step {step + 1}: train loss {loss:.4f}, val loss {val_loss:.4f} "
                    f"({val_loss / math.log(2):.3f} bits/{unit}), {tok_s:,.0f} tokens/s")
            metrics.write(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            if (step + 1) % cfg.ckpt_every == 0 or step + 1 == end:
                ckpts.save(step + 1, {"params": params, "opt_state": opt_state}, saved_config)
    except KeyboardInterrupt:
        raise TrainingInterrupted(done, ckpts.latest_step()) from None
    finally:
        bar.close()
        ckpts.close()
    plot = out / "loss.png"
    summary = {"step": end, "loss": last_loss, "val_loss": val_loss, "tokens_per_s": tok_s,
               "checkpoint": str(ckpts.directory), "plot": str(plot), "params": n_params}
    if lead:
        plot_losses(metrics.read(), plot, f"{Path(cfg.pretrained).name if cfg.pretrained else cfg.preset}, "
                                          f"attention={cfg.method}")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_params(checkpoint_dir: str, like_params: nnx.State, like_opt_state: optax.OptState,
                warn: Callable[[str], None] = print) -> nnx.State:
    """Parameters from the newest intact checkpoint of a run (``<out>`` or ``<out>/checkpoints``), shaped like
    ``like_params``; a damaged newer step gets one ``warn`` line and is skipped.

    Raises:
      FileNotFoundError: no checkpoint there. CheckpointError: none is intact.
    """
    path = resolve_dir(checkpoint_dir)
    read_config(path)  # a clear error when there is no checkpoint
    mgr = Checkpoints(path)
    try:
        restored = mgr.restore_intact({"params": like_params, "opt_state": like_opt_state}, warn=warn)
    finally:
        mgr.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {path}")
    return restored[1]["params"]
