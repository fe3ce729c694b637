"""JSON-lines metrics and the loss-curve plot."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Metrics as JSON lines. In a multi-process run every process reads the file but only the one built
    with ``writer=True`` (process 0) creates, truncates or appends to it."""

    def __init__(self, path: Path, append: bool = False, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        if writer:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append and self.path.exists():
                self.path.unlink()

    def write(self, record: dict) -> None:
        if not self.writer:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate(self, step: int) -> None:
        """Drop the records after ``step`` (a resumed run trains those steps again), by an atomic rewrite."""
        if not self.writer or not self.path.exists():
            return
        keep = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut short by a kill mid-write
                continue
        return records


def plot_losses(records: list[dict], path: Path, title: str) -> Path:
    """Train and validation loss vs step as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
