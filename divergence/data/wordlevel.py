"""Word-level tokens (`data.tokenization: word`): one id per whitespace-separated word, as the lab's measurement of
the bf16 embedding-gradient bug under SGD was made (../shared/NOTES.md, "The same bug in training").

WikiText-2 is already tokenized with spaces (`the cat , said " no "`, `1 @,@ 000`), so splitting on whitespace
alone keeps its punctuation tokens as they are. The vocabulary is the `vocab_size - 2` most frequent words plus EOT
and `<unk>` (the trainer counts its special tokens inside vocab_size, as BpeTrainer does, so `data.vocab_size` is
the embedding's row count under either tokenization; fewer when the text has fewer word types); every other word
becomes `<unk>`, and so does the text's own literal `<unk>` (WikiText-2 already wrote its rare words so). Ties in
count are broken by the word (WordLevelTrainer sorts by count, then word), so training is deterministic: the same
tokenizer.json in three trainings.

Measured 2026-11-23 on WikiText-2 (test + valid, 2.4 MB; 2-core CPU): 455,097 words of 18,326 types besides the
literal `<unk>`, which is 5.92% of the words. Training takes 0.19 s at 16,384 and 0.22 s at 32,768, encoding 0.4 s.
At 16,384 the `<unk>` share becomes 6.35% (16,382 words kept), at 32,768 it stays 5.92% (all 18,328 ids).
Line ends are not tokens. The usual word-level WikiText-2 (PyTorch's word_language_model) adds an `<eos>` per line:
8,118 lines here, which with the 455,097 words gives the published 463,215 tokens of test + valid (the lab's "460k
tokens"); at 1.8% of tokens `<eos>` would not be the top row (`<unk>` 5.9%, `the` 5.9%).
"""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from .tokenizer import EOT, lines_of

UNK = "<unk>"
SPECIALS = [EOT, UNK]  # ids 0 and 1


def train_wordlevel(docs: list, vocab_size: int) -> Tokenizer:
    """No decoder: `decode` joins words with single spaces, which gives each word back (newlines are not tokens)."""
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(_words_without_specials(docs), trainer)
    return tok


def _words_without_specials(docs: list):
    """Lines with the special tokens' literal text taken out. WordLevelTrainer (tokenizers 0.23.3) counts the
    text's own `<unk>` as a word as well as taking it as a special token: on WikiText-2 at 16,384 the vocabulary then
    held 16,383 entries with id 1 unused and id 16,383 emitted (encode's range check caught it)."""
    for line in lines_of(docs):
        yield " ".join(w for w in line.split() if w not in SPECIALS)
