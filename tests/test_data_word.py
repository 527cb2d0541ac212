"""Word-level tokens (data.tokenization: word, data/wordlevel.py): ids round-trip to the words, the Zipf head, <unk>,
a cache of their own, the recipe key's errors, and `data stats` on WikiText-2 (marked real_text)."""
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from divergence.cli import main
from divergence.data import load_corpus
from divergence.data.tokenizer import EOT, encode
from divergence.data.wordlevel import UNK, train_wordlevel
from divergence.errors import RecipeError
from divergence.overrides import sets_to_overrides
from divergence.recipe import DataConfig, load_recipe
from test_data import write

# WikiText-2's layout: punctuation apart, `@-@` and `@,@` joiners, the text's own <unk>, a word with a dot inside
# (`H.`: one word here, two under a pre-tokenizer that splits punctuation). "the" is the most frequent.
TEXT = "".join(
    f" the {w} sat on the mat , and the {w} @-@ cat saw <unk> 1 @,@ {i % 7} H. americanus . \n"
    for i, w in enumerate(["cat", "dog", "owl", "the"] * 40)
)


@pytest.fixture
def word_cfg(tmp_path):
    f = write(tmp_path / "t.txt", TEXT)
    return DataConfig(source=str(f), tokenization="word", vocab_size=64, cache_dir=str(tmp_path / "cache"))


def test_ids_round_trip_to_the_words(word_cfg):
    c = load_corpus(word_cfg)
    ids = np.concatenate([c.train, c.val]).tolist()
    assert c.tokenizer.decode(ids) == " ".join(TEXT.split()).replace(UNK + " ", "")  # <unk> is special: skipped
    assert c.tokenizer.decode(ids, skip_special_tokens=False) == " ".join(TEXT.split())
    assert [c.tokenizer.id_to_token(i) for i in ids] == TEXT.split()  # one id per word, punctuation kept as is
    for w in ("@-@", "@,@", ",", "."):
        assert c.tokenizer.decode([c.tokenizer.token_to_id(w)]) == w


def test_most_frequent_word_gets_the_most_occurrences(word_cfg):
    c = load_corpus(word_cfg)
    words = Counter(TEXT.split()[: len(c.train)])
    top = c.tokenizer.token_to_id("the")
    assert words.most_common(1)[0][0] == "the"
    assert c.counts[top] == words["the"] == c.counts.max() and c.rank[top] == 0
    order = np.argsort(c.rank)
    assert [c.tokenizer.id_to_token(int(i)) for i in order[:3]] == [w for w, _ in words.most_common(3)]


def test_unknown_words_map_to_unk_and_the_vocabulary_is_dense():
    docs = ["a a a a b b b c c d <unk> <unk>\n", "e a"]
    tok = train_wordlevel(docs, 5)  # EOT, <unk> and the three most frequent words: a, b, c
    unk = tok.token_to_id(UNK)
    assert tok.get_vocab_size() == 5 and sorted(tok.get_vocab().values()) == list(range(5))
    assert {tok.token_to_id(w) for w in "abc"} == {2, 3, 4} and tok.token_to_id(EOT) == 0
    ids = encode(tok, docs).tolist()
    assert ids == [2] * 4 + [3] * 3 + [4] * 2 + [unk] * 3 + [0] + [unk, 2]  # d, the text's <unk>, e; EOT between docs
    assert tok.encode("zebra a", add_special_tokens=False).ids == [unk, 2]
    # the text's literal <unk> is not counted as a word too (tokenizers 0.23.3 left id 1 unused and overran the size)
    assert train_wordlevel(["<unk> " * 9 + "a b"], 4).get_vocab() == {EOT: 0, UNK: 1, "a": 2, "b": 3}


def test_training_is_deterministic():
    docs = [TEXT, "x y z y z z " * 3]  # ties in count broken by the word
    assert train_wordlevel(docs, 12).to_str() == train_wordlevel(docs, 12).to_str()


def test_cache_key_differs_from_bpe_and_a_second_load_reuses_it(word_cfg, monkeypatch):
    from divergence.data import corpus as corpus_mod

    word = load_corpus(DataConfig(**{**word_cfg.__dict__, "vocab_size": 300}))
    bpe = load_corpus(DataConfig(**{**word_cfg.__dict__, "tokenization": "bpe", "vocab_size": 300}))
    assert word.key != bpe.key and word.tokenizer.token_to_id("owl") and not bpe.tokenizer.token_to_id("owl")
    names = {p.name for p in Path(word_cfg.cache_dir).iterdir()}
    assert names == {f"{kind}-{k}.{ext}" for k in (word.key, bpe.key) for kind, ext in (("tok", "json"), ("ids", "npy"))}

    def boom(*a, **k):
        raise AssertionError("cache miss: retrained")

    monkeypatch.setattr(corpus_mod, "train_wordlevel", boom)
    monkeypatch.setattr(corpus_mod, "train_bpe", boom)
    again = load_corpus(DataConfig(**{**word_cfg.__dict__, "vocab_size": 300}))
    assert again.key == word.key and np.array_equal(again.train, word.train)
    assert again.tokenizer.to_str() == word.tokenizer.to_str()


def test_a_given_tokenizer_wins_over_word(word_cfg, tmp_path):
    bpe = load_corpus(DataConfig(**{**word_cfg.__dict__, "tokenization": "bpe", "vocab_size": 300}))
    bpe.tokenizer.save(str(tmp_path / "tokenizer.json"))
    c = load_corpus(DataConfig(**{**word_cfg.__dict__, "tokenizer": str(tmp_path / "tokenizer.json")}))
    assert c.tokenizer.to_str() == bpe.tokenizer.to_str() and np.array_equal(c.train, bpe.train)


def test_bad_tokenization_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny", sets_to_overrides(["data.tokenization=words"]))
    msg = str(e.value)
    assert "\n" not in msg and "tiny.yaml" in msg and "data.tokenization: unknown 'words'; known: bpe, word" in msg
    f = write(tmp_path / "r.yaml", "name: r\ndata:\n  tokenization: bytes\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: data\.tokenization: unknown 'bytes'"):
        load_recipe(str(f))
    with pytest.raises(RecipeError, match=r"data\.vocab_size: 2 is below 3"):
        load_recipe("tiny", sets_to_overrides(["data.tokenization=word", "data.vocab_size=2"]))
    assert load_recipe("tiny", sets_to_overrides(["data.tokenization=word"])).data.tokenization == "word"
    assert load_recipe("tiny").data.tokenization == "bpe"  # the default


def test_h200_long_word_is_h200_long_on_word_tokens():
    long, word = load_recipe("h200-long"), load_recipe("h200-long-word")
    assert word.data.tokenization == "word" and long.data.tokenization == "bpe"
    for r in (long, word):
        r.name, r.path, r.data.tokenization = "x", "x", "x"
    assert word == long


@pytest.mark.real_text
def test_data_stats_on_wikitext_word_level(tmp_path, capsys):
    """What h200-long-word's comments claim, measured 2026-11-23: 455,097 words + 1 EOT, 18,326 word types, the
    text's <unk> 5.92% of all tokens and 6.35% at 16,384 (6.31% of the train split, which `data stats` prints),
    <unk> and `the` the top rows."""
    rc = main(["data", "stats", "--recipe", "h200-long", "--set", "data.tokenization=word",
               "--set", f"data.cache_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "432,344 train + 22,754 val" in out and "vocabulary      16,384 ids" in out
    assert "'<unk>' 6.31%" in out and "'the' 5.89%" in out and "',' 4.66%" in out
    assert "1,034.3 gradient contributions at 16,384 tokens/step" in out
    sets = ["data.tokenization=word", "data.vocab_size=32768", f"data.cache_dir={tmp_path}"]
    c = load_corpus(load_recipe("h200-long", sets_to_overrides(sets)).data)
    assert c.vocab_size == 18_328  # every word type of the text, and no more
