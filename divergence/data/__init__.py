"""Text -> byte-level BPE or word-level tokens -> cached, memory-mapped token ids -> seeded batches, plus corpus
statistics."""
from .corpus import Corpus, load_corpus
from .sampler import Batches
from .stats import corpus_stats, format_stats

__all__ = ["load_corpus", "Corpus", "Batches", "corpus_stats", "format_stats"]
