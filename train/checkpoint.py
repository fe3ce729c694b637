"""Orbax checkpoints of the training state (params, optimizer state, step) plus the run's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


SUBDIR = "checkpoints"  # a run directory keeps its Orbax checkpoints here


def resolve_dir(path: str | Path) -> Path:
    """The checkpoint directory for a run directory (``<out>``) or the directory itself."""
    path = Path(path)
    return path / SUBDIR if (path / SUBDIR).exists() else path


class Checkpoints:
    """Thin wrapper over ``ocp.CheckpointManager`` for {"params", "opt_state"} at integer steps."""

    def __init__(self, directory: str | Path, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], config: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        config=ocp.args.JsonSave(config)))
        self.manager.wait_until_finished()

    def restore(self, step: int | None, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """State shaped like ``like`` (abstract arrays are fine) and the saved config."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 config=ocp.args.JsonRestore()))
        return out["state"], out["config"]

    def close(self) -> None:
        self.manager.close()


def read_config(directory: str | Path, step: int | None = None) -> dict[str, Any]:
    """The JSON config saved beside a checkpoint (latest step by default); a run directory works too."""
    directory = resolve_dir(directory)
    if not directory.exists():
        raise FileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
    step = steps[-1] if step is None else step
    return json.loads((directory / str(step) / "config" / "metadata").read_text())
