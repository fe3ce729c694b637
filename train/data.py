"""Byte-level data: tokenizer, the built-in corpus, deterministic packed batches.

The built-in corpus is the running interpreter's own standard library source
(``*.py`` under ``sysconfig.get_paths()["stdlib"]``): tens of MB of real text on
every machine, no download. Any text file or folder can replace it.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html", ".csv")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255."""

    vocab_size = 256

    @staticmethod
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    @staticmethod
    def decode(tokens) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def stdlib_files() -> list[Path]:
    """The interpreter's standard-library ``.py`` files, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def load_corpus(path: str | None = None, max_bytes: int = 64 * 2**20) -> np.ndarray:
    """Corpus bytes as uint8 (at most ``max_bytes``).

    Args:
      path: None for the built-in corpus, else a text file or a folder (its text
        files, sorted, concatenated).
    Raises:
      FileNotFoundError if ``path`` does not exist; ValueError if it holds no text.
    """
    if path is None:
        files = stdlib_files()
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"corpus path {str(p)!r} does not exist")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)
    if corpus.size < 1024:
        raise ValueError(f"corpus {path or 'stdlib'!r} has only {corpus.size} bytes of text; need at least 1024")
    return corpus


def tokenize(corpus: np.ndarray, tokenizer) -> np.ndarray:
    """int32 tokens of corpus bytes (:func:`load_corpus`): the bytes themselves for :class:`ByteTokenizer`, else
    the UTF-8 text encoded by ``tokenizer`` (a :class:`models.TextTokenizer`) in chunks of about 1 MiB cut at line
    ends, in parallel."""
    if tokenizer is ByteTokenizer or isinstance(tokenizer, ByteTokenizer):
        return corpus.astype(np.int32)
    text = corpus.tobytes().decode("utf-8", errors="replace")
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + 2**20)
        end = len(text) if end < 0 else end + 1
        chunks.append(text[start:end])
        start = end
    return np.concatenate(tokenizer.encode_batch(chunks) or [np.zeros(0, np.int32)]).astype(np.int32)


def train_val_split(corpus: np.ndarray, val_fraction: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split: the last ``val_fraction`` of the bytes is validation."""
    n_val = max(int(len(corpus) * val_fraction), 4096)
    return corpus[:-n_val], corpus[-n_val:]


class PackedBatches:
    """Fixed-length windows of a token stream; batch ``i`` depends only on (seed, i).

    That makes a resumed run see exactly the data an uninterrupted one would.
    ``batch(step)`` returns int32 (accum, global_batch, seq_len + 1): inputs are
    ``[..., :-1]``, targets ``[..., 1:]``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, accum: int = 1, seed: int = 0):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is too short for sequences of {seq_len}")
        self.tokens, self.seq_len, self.global_batch, self.accum, self.seed = tokens, seq_len, global_batch, accum, seed

    @property
    def tokens_per_step(self) -> int:
        return self.accum * self.global_batch * self.seq_len

    def batch(self, step: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, step))
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=(self.accum, self.global_batch))
        idx = starts[..., None] + np.arange(self.seq_len + 1)
        return self.tokens[idx].astype(np.int32)
