"""A pretrained model's tokenizer (Hugging Face ``tokenizers``): from tokenizer.json or a GGUF file's vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from models.pretrained.errors import PretrainedError, need

#: GGUF ``tokenizer.ggml.pre`` → the split before byte-level BPE: a regex (None: GPT-2's), and digits one by one
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False), "gpt2": (None, False),
    "smollm": (None, True),  # SmolLM: each digit alone, then GPT-2's split
    "llama-bpe": (_LLAMA3_SPLIT, False), "llama3": (_LLAMA3_SPLIT, False),
    "qwen2": (_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), False),
}
#: GGUF token type of control tokens (<|im_start|>, </s>): matched whole, never split
CONTROL = 3


class TextTokenizer:
    """Text ↔ int token ids with a pretrained vocabulary (no special tokens added on encode).

    Attributes:
      vocab_size: ids run 0 .. vocab_size − 1. eos_id: end of sequence (None if the checkpoint names none).
    """

    def __init__(self, tokenizer, *, eos_id: int | None = None):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id

    def encode(self, text: str) -> np.ndarray:
        """int32 (N,) token ids of ``text``."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text (in parallel threads)."""
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """The text of int ids (control tokens kept)."""
        return self._tok.decode(np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=False)

    @classmethod
    def from_file(cls, path: str | Path, *, eos_id: int | None = None) -> "TextTokenizer":
        """From a Hugging Face ``tokenizer.json``."""
        tokenizers = need("tokenizers")
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)), eos_id=eos_id)
        except Exception as e:  # the Rust error says what is wrong but not where
            raise PretrainedError(path, f"not a tokenizer.json ({str(e).splitlines()[0][:200]})") from None

    @classmethod
    def from_gguf_vocab(cls, path: str | Path, *, model: str, pre: str, tokens: list[str], token_types: list[int],
                        merges: list[str], eos_id: int | None) -> "TextTokenizer":
        """Byte-level BPE from a GGUF file's ``tokenizer.ggml.*`` fields (``model`` "gpt2": GPT-2, Llama-3, Qwen,
        SmolLM vocabularies)."""
        if model != "gpt2":
            raise PretrainedError(path, f"tokenizer.ggml.model {model!r} is not supported (byte-level BPE, 'gpt2', "
                                  f"is); load the model's Hugging Face directory with its tokenizer.json instead")
        if pre not in PRE_TOKENIZERS:
            raise PretrainedError(path, f"tokenizer.ggml.pre {pre!r} is not supported; known: "
                                  f"{', '.join(sorted(PRE_TOKENIZERS))}")
        tk = need("tokenizers")
        split, digits = PRE_TOKENIZERS[pre]
        bpe = tk.models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges],
                            ignore_merges=False)
        tok = tk.Tokenizer(bpe)
        steps = [tk.pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if split is None:
            steps.append(tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated"),
                      tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence(steps)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == CONTROL])
        return cls(tok, eos_id=eos_id)
