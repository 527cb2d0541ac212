"""Byte-level BPE: train one on the corpus with `tokenizers`, or load a given tokenizer.json; encode to ids.

Measured on WikiText-2 (2.4 MB, 2 cores): training takes 0.7 s at 4096 tokens and 1.0 s at 16384, encoding
0.5 s with `encode_batch` over lines, against 2.5 s for one `encode` of the whole text (same ids here).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import DataError
from .base import search_paths

EOT = "<|endoftext|>"  # the one special token; separates documents (files) in the token stream
BATCH_LINES = 16384  # lines per encode_batch call: bounds the Encoding objects alive at once


def lines_of(docs: list):
    for doc in docs:
        yield from doc.splitlines(keepends=True)


def train_bpe(docs: list, vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE: all 256 bytes in the alphabet, so any text encodes without <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines_of(docs), trainer)
    return tok


def tokenizer_path(path: str) -> Path:
    for cand in search_paths(Path(path).expanduser()):
        if cand.is_file():
            return cand.resolve()
    raise DataError(f"data.tokenizer {path!r}: no such file; give a tokenizers tokenizer.json, or null to train BPE")


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"data.tokenizer {path}: not a tokenizers tokenizer.json ({first})") from None


def id_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 65536 else np.uint32


def encode(tok: Tokenizer, docs: list) -> np.ndarray:
    """All documents as one id stream, EOT between documents when the tokenizer has it.

    Lines are encoded without the tokenizer's own special tokens (add_special_tokens=False): a given
    tokenizer.json with a BOS template would otherwise put a BOS before every line.
    """
    vocab = tok.get_vocab_size()
    dtype, eot = id_dtype(vocab), tok.token_to_id(EOT)
    parts = []
    for i, doc in enumerate(docs):
        if i and eot is not None:
            parts.append(np.array([eot], dtype))
        lines = doc.splitlines(keepends=True)
        for start in range(0, len(lines), BATCH_LINES):
            encs = tok.encode_batch(lines[start:start + BATCH_LINES], add_special_tokens=False)
            parts.extend(np.asarray(e.ids, dtype=np.int64) for e in encs if e.ids)
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if ids.size and ids.max() >= vocab:
        raise DataError(f"tokenizer emits id {int(ids.max())} but reports {vocab} tokens; inconsistent tokenizer.json")
    return ids.astype(dtype)
