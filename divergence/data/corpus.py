"""`load_corpus(cfg)`: text -> tokenizer -> token ids (cached) -> train/val split and token frequencies."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from ..errors import DataError
from ..recipe import DataConfig
from . import cache
from .sources import resolve_source
from .tokenizer import encode, file_sha256, load_tokenizer, tokenizer_path, train_bpe
from .wordlevel import train_wordlevel

log = logging.getLogger(__name__)


@dataclass
class Corpus:
    train: np.ndarray  # token ids, memory-mapped; uint16 below 65536 tokens, else uint32
    val: np.ndarray  # the tail of the same stream (cfg.val_fraction of it)
    tokenizer: Tokenizer
    vocab_size: int  # the tokenizer's size, special tokens included
    counts: np.ndarray  # int64 [vocab_size]: occurrences of each id in train
    rank: np.ndarray  # int64 [vocab_size]: frequency rank of each id in train, 0 = most frequent (ties by id)
    source: str  # for people: what text this is
    key: str  # cache key: hash of the source's identity and the tokenizer settings


def load_corpus(cfg: DataConfig) -> Corpus:
    cfg.validate("data")
    source = resolve_source(cfg)
    if cfg.tokenizer:
        tok_file = tokenizer_path(cfg.tokenizer)
        tok_id = {"file": str(tok_file), "sha256": file_sha256(tok_file)}
    elif cfg.tokenization == "word":
        tok_file, tok_id = None, {"word": "whitespace", "vocab_size": cfg.vocab_size}
    else:  # the BPE key as it always was: existing caches stay valid
        tok_file, tok_id = None, {"bpe": "byte-level", "vocab_size": cfg.vocab_size}
    # val_fraction is not in the key: the split is a slice of the cached stream, free to change.
    key = cache.cache_key({"source": source.identity, "max_chars": cfg.max_chars, "tokenizer": tok_id})
    folder = cache.cache_dir(cfg)
    tok_path, ids_path = folder / f"tok-{key}.json", folder / f"ids-{key}.npy"

    docs = None
    if tok_path.is_file():
        tok = load_tokenizer(tok_path)
    else:
        if tok_file is not None:
            tok = load_tokenizer(tok_file)
        else:
            t0, docs = time.perf_counter(), source.read()
            train, what = (train_wordlevel, "word-level") if cfg.tokenization == "word" else (train_bpe, "byte-level BPE")
            tok = train(docs, cfg.vocab_size)
            log.info("trained %s (%d tokens) on %s in %.1f s",
                     what, tok.get_vocab_size(), source.description, time.perf_counter() - t0)
        cache.save_text(tok_path, tok.to_str())
    if not ids_path.is_file():
        t0, docs = time.perf_counter(), docs if docs is not None else source.read()
        ids = encode(tok, docs)
        cache.save_ids(ids_path, ids)
        log.info("encoded %s: %d tokens in %.1f s -> %s",
                 source.description, ids.size, time.perf_counter() - t0, ids_path)
    ids = cache.load_ids(ids_path)

    n_val = int(len(ids) * cfg.val_fraction)
    if n_val < 2 or len(ids) - n_val < 2:
        raise DataError(f"{source.description}: {len(ids)} tokens are too few to split "
                        f"(data.val_fraction={cfg.val_fraction}); give more text")
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val:]
    vocab = tok.get_vocab_size()
    counts = np.bincount(train, minlength=vocab).astype(np.int64)  # about 2 ms for the 625k ids of WikiText-2
    order = np.argsort(-counts, kind="stable")  # stable: equal counts rank by id, so ranks are reproducible
    rank = np.empty(vocab, np.int64)
    rank[order] = np.arange(vocab)
    return Corpus(train, val, tok, vocab, counts, rank, source.description, key)
