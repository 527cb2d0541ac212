"""How skewed the token distribution is, and what that means for the embedding's gradient per step."""
from __future__ import annotations

import numpy as np

from .corpus import Corpus

# Fit the Zipf exponent on ranks 1..1000 only. On WikiText-2 at 4096 tokens the slope is 0.89 there but 1.75
# over ranks 1000..3852: BPE's last merges all sit near the same frequency floor and their sub-pieces are
# absorbed by later merges, so the tail falls off faster than any power law and would dominate a full fit.
ZIPF_RANKS = 1000
TOPS = (1, 10, 100, 1000)


def corpus_stats(corpus: Corpus, tokens_per_step: int) -> dict:
    counts = corpus.counts
    total = int(counts.sum())
    order = np.argsort(corpus.rank)  # ids by frequency, most frequent first (the corpus's ranking)
    freq = counts[order]
    seen = int((freq > 0).sum())
    hi = min(ZIPF_RANKS, seen)
    if hi >= 2:
        ranks = np.arange(1, hi + 1)
        zipf = float(-np.polyfit(np.log(ranks), np.log(freq[:hi]), 1)[0])
    else:
        zipf = float("nan")
    d = {
        "source": corpus.source,
        "key": corpus.key,
        "tokens_train": int(len(corpus.train)),
        "tokens_val": int(len(corpus.val)),
        "vocab_size": int(corpus.vocab_size),
        "ids_seen": seen,  # ids occurring at least once in train
        "coverage": seen / corpus.vocab_size,
        "zipf_exponent": zipf,
        "zipf_ranks": [1, hi],
    }
    for k in TOPS:
        d[f"top{k}_share"] = float(freq[:k].sum() / total)
    # skip_special_tokens=False: a special token among the most frequent (word level's <unk>) shows by name, not as ''
    d["top_tokens"] = [[corpus.tokenizer.decode([int(i)], skip_special_tokens=False), float(counts[i] / total)]
                       for i in order[:5]]
    # Rows of the embedding gradient: a token at position t adds one contribution to row x_t.
    d["tokens_per_step"] = int(tokens_per_step)
    d["top_row_per_step"] = d["top1_share"] * tokens_per_step
    d["uniform_row_per_step"] = tokens_per_step / corpus.vocab_size
    d["top_vs_uniform"] = d["top_row_per_step"] / d["uniform_row_per_step"]
    return d


def format_stats(d: dict) -> str:
    pct = lambda x: f"{100 * x:.2f}%"
    lo, hi = d["zipf_ranks"]
    rows = [
        ("source", d["source"]),
        ("tokens", f"{d['tokens_train']:,} train + {d['tokens_val']:,} val"),
        ("vocabulary", f"{d['vocab_size']:,} ids, {d['ids_seen']:,} seen in train ({pct(d['coverage'])})"),
        ("Zipf exponent", f"{d['zipf_exponent']:.2f} (slope of log count on log rank, ranks {lo}..{hi})"),
    ]
    rows += [(f"top-{k} share", pct(d[f"top{k}_share"])) for k in TOPS]
    rows.append(("most frequent", ", ".join(f"{t!r} {pct(s)}" for t, s in d["top_tokens"])))
    rows.append((
        "top row / step",
        f"{d['top_row_per_step']:,.1f} gradient contributions at {d['tokens_per_step']:,} tokens/step, "
        f"vs {d['uniform_row_per_step']:,.2f} under uniform sampling ({d['top_vs_uniform']:,.0f}x)",
    ))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
