"""Token-frequency buckets of embedding rows: the lockstep check, the drift distances and the report split the
vocabulary the same way, by rank on the training text (rank 0 = the most frequent token)."""
from __future__ import annotations

import numpy as np

BUCKETS = (("top-10", 0, 10), ("top-100", 10, 100), ("top-1000", 100, 1000), ("tail", 1000, None))


def bucket_rows(rank: np.ndarray, vocab: int) -> dict:
    """bucket -> row ids, by frequency rank on the training text (rank 0 = most frequent)."""
    order = np.argsort(rank[:vocab], kind="stable")
    return {name: order[lo:hi] for name, lo, hi in BUCKETS if lo < len(order)}
