"""Orbax checkpoints of the training state (params, optimizer state, step) plus the run's config.

Each saved step also gets a manifest (:data:`MANIFEST`: every file's size and CRC-32, written by process 0
after Orbax has committed the step), so a damaged file is found and named before Orbax reads it. Damage is
reported in one line naming the directory, the step and the file (:class:`CheckpointError`); resuming skips a
damaged step with a warning, moves it aside (into ``<run>/checkpoints-damaged/``, nothing is deleted) and
continues from the newest intact one. Orbax writes a step into a temporary directory and renames it when
complete, so a run killed inside a save leaves no partial step behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

SUBDIR = "checkpoints"  # a run directory keeps its Orbax checkpoints here
DAMAGED_SUBDIR = "checkpoints-damaged"  # damaged steps are moved here, beside SUBDIR
MANIFEST = "lowbit_manifest.json"
_JSON_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "config/metadata")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message is one line naming the directory, the step and the file."""


def resolve_dir(path: str | Path) -> Path:
    """The checkpoint directory for a run directory (``<out>``) or the directory itself."""
    path = Path(path)
    return path / SUBDIR if (path / SUBDIR).exists() else path


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
    """Record every file of a committed step (size, CRC-32); written atomically (a temporary file renamed)."""
    entries = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, step_dir / MANIFEST)


def damage(step_dir: Path) -> str | None:
    """What is wrong with a step directory, as "FILE: reason", or None if it looks intact.

    With a manifest: every listed file must exist with its size and CRC-32. Without one (a run killed between
    Orbax's commit and the manifest): the JSON files must parse; Orbax's own read is the remaining check.
    """
    manifest = step_dir / MANIFEST
    if manifest.exists():
        try:
            entries = json.loads(manifest.read_text())
        except (OSError, ValueError) as e:
            return f"{MANIFEST}: unreadable ({e})"
        for name, (size, crc) in entries.items():
            path = step_dir / name
            if not path.is_file():
                return f"{name}: missing"
            if path.stat().st_size != size:
                return f"{name}: {path.stat().st_size} bytes, {size} were written (truncated or overwritten)"
            if _crc32(path) != crc:
                return f"{name}: contents changed since it was written (CRC-32 mismatch)"
        return None
    for name in _JSON_FILES:
        path = step_dir / name
        try:
            json.loads(path.read_text())
        except FileNotFoundError:
            return f"{name}: missing"
        except (OSError, ValueError) as e:
            return f"{name}: not valid JSON ({e})"
    return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


class Checkpoints:
    """``ocp.CheckpointManager`` for {"params", "opt_state"} at integer steps, with damage checks."""

    def __init__(self, directory: str | Path, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                                 cleanup_tmp_directories=True))

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: dict[str, Any], config: dict[str, Any]) -> None:
        """Write and commit ``step``; a Ctrl-C meanwhile takes effect once it is written (:func:`_interrupt_after`)."""
        with _interrupt_after():
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            config=ocp.args.JsonSave(config)))
            self.manager.wait_until_finished()
            if jax.process_index() == 0:
                write_manifest(self.step_dir(step))

    def restore(self, step: int | None, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """State shaped like ``like`` (abstract arrays are fine) and the saved config.

        Raises:
          FileNotFoundError: no checkpoint. CheckpointError: the step is damaged (one line naming the file).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        problem = damage(self.step_dir(step))
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.directory} step {step} is damaged: {problem}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     config=ocp.args.JsonRestore()))
        except Exception as e:  # Orbax/TensorStore report damage as many exception types, in many lines
            raise CheckpointError(f"checkpoint {self.directory} step {step} could not be read: "
                                  f"{_one_line(e)}") from None
        return out["state"], out["config"]

    def restore_intact(self, like: dict[str, Any], warn: Callable[[str], None],
                       move_damaged: bool = False) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """The newest step that restores: (step, state, config), or None if there is no checkpoint.

        Each damaged step on the way gets one ``warn`` line; with ``move_damaged`` (a resuming run, process 0)
        it is moved to ``<run>/checkpoints-damaged/`` so that training can save that step again.

        Raises:
          CheckpointError: checkpoints exist but none is intact.
        """
        steps = self.steps()
        for step in reversed(steps):
            try:
                state, config = self.restore(step, like)
            except CheckpointError as e:
                warn(f"warning: {e}; skipping it")
                if move_damaged:
                    self.move_aside(step)
                continue
            return step, state, config
        if steps:
            raise CheckpointError(f"no intact checkpoint in {self.directory} (steps {steps} are all damaged)")
        return None

    def move_aside(self, step: int) -> Path:
        """Move a (damaged) step out of Orbax's directory, keeping its files; returns where it went."""
        target = self.directory.parent / DAMAGED_SUBDIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.step_dir(step)), str(target))
        self.manager.reload()
        return target

    def close(self) -> None:
        with _interrupt_after():
            self.manager.close()


@contextlib.contextmanager
def _interrupt_after():
    """Ctrl-C inside: the block runs to its end, then ``KeyboardInterrupt`` is raised. Orbax's wait for a save to
    finish logs a traceback when interrupted and drops that step; deferred, the step commits whole and the CLI's
    one-line interrupt message is all the user sees. A no-op off the main thread (signals go to the main thread),
    and where SIGINT is ignored (a job a script started in the background): a save must not turn it into a stop."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def read_config(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The JSON config saved beside a checkpoint (the newest step whose config parses, by default); a run
    directory works too.

    Raises:
      FileNotFoundError: no checkpoint. CheckpointError: the config file is damaged (one line naming it).
    """
    directory = resolve_dir(directory)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
    for s in reversed(steps if step is None else [step]):
        path = directory / str(s) / "config" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            error = CheckpointError(f"checkpoint {directory} step {s} is damaged: config/metadata: "
                                    f"{_one_line(e)}")
    raise error
