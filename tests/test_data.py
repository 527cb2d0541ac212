"""Data pipeline: sources, cached BPE corpus, seeded batches, hub path on local files, statistics.

`wikitext-2` is the synthetic stand-in where no real text exists (tests/conftest.py); the tests that check facts
of WikiText-2 itself are marked real_text."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from divergence.data import Batches, corpus_stats, format_stats, load_corpus
from divergence.data import corpus as corpus_mod
from divergence.data import sources, synthetic
from divergence.data.tokenizer import EOT
from divergence.errors import DataError
from divergence.recipe import DataConfig


@pytest.fixture(scope="module")
def wiki_cfg(tmp_path_factory):
    # 4096 tokens, not 512: the Zipf fit needs 1000 ranks (at 512 only 380 ids occur and the slope is 0.6).
    return DataConfig(source="wikitext-2", vocab_size=4096, cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def wiki(wiki_cfg):
    return load_corpus(wiki_cfg)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


SAMPLE = "".join(f"The {w} sat on mat {i}, and the cat saw it.\n" for i, w in enumerate(["cat", "dog", "owl"] * 60))


# --- sources -------------------------------------------------------------------------------------------------


@pytest.mark.real_text
def test_data_root_holds_the_shared_text():
    root = sources.data_root(DataConfig())
    assert (root / "wikitext-2" / "valid.txt").is_file(), f"data root {root} lacks wikitext-2 (see ../shared/data)"


def test_no_text_anywhere_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "SOURCE_ROOT", tmp_path / "repo")
    monkeypatch.setenv("DIVERGENCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(sources.ENV_VAR, raising=False)
    monkeypatch.delenv(sources.FALLBACK_VAR, raising=False)
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(source="mytext"))  # no hub copy: nothing else to try
    msg = str(e.value)
    assert "\n" not in msg
    tried = (str(tmp_path / "shared" / "data"), str(tmp_path / "repo" / "data" / "text"), str(tmp_path / "cache"))
    for needle in ("'mytext'", "DIVERGENCE_DATA", "data.root", *tried):
        assert needle in msg


def test_no_data_root_is_told_by_its_kind_not_by_the_messages_words(tmp_path, monkeypatch):
    """resolve_source tells "no data root at all" from "not under the root" by find_local's `no_root`, not by how
    the message begins: reworded, the no-root message is still the whole error."""
    monkeypatch.setattr(sources, "SOURCE_ROOT", tmp_path / "repo")
    monkeypatch.setenv("DIVERGENCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(sources.ENV_VAR, raising=False)
    monkeypatch.delenv(sources.FALLBACK_VAR, raising=False)
    monkeypatch.setattr(sources, "_no_root_message", lambda: "nowhere to look (reworded)")
    assert sources.find_local("mytext", DataConfig(source="mytext")).no_root
    with pytest.raises(DataError) as e:
        sources.resolve_source(DataConfig(source="mytext"))
    assert str(e.value) == "data.source 'mytext': nowhere to look (reworded)"


def test_unknown_name_lists_what_the_root_holds(tmp_path):
    write(tmp_path / "root" / "mine" / "a.txt", SAMPLE)
    with pytest.raises(DataError, match=r"'nope'.*known under .*: mine") as e:
        load_corpus(DataConfig(source="nope", root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache")))
    assert "\n" not in str(e.value)


def test_env_var_names_the_root_and_folders_read_sorted_txt(tmp_path, monkeypatch):
    write(tmp_path / "root" / "mine" / "b.txt", "second file\n" * 50)
    write(tmp_path / "root" / "mine" / "a.txt", "first file\n" * 50)
    write(tmp_path / "root" / "mine" / "skip.md", "not text\n")
    monkeypatch.setenv(sources.ENV_VAR, str(tmp_path / "root"))
    c = load_corpus(DataConfig(source="mine", vocab_size=300, cache_dir=str(tmp_path / "cache")))
    ids = np.concatenate([c.train, c.val]).tolist()
    assert c.tokenizer.decode(ids, skip_special_tokens=False) == "first file\n" * 50 + EOT + "second file\n" * 50
    assert "a.txt, b.txt" in c.source


def test_bad_explicit_root_and_non_utf8_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="data.root"):
        load_corpus(DataConfig(source="x", root=str(tmp_path / "missing"), cache_dir=str(tmp_path)))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 100)
    with pytest.raises(DataError, match="not UTF-8"):
        load_corpus(DataConfig(source=str(tmp_path / "latin1.txt"), vocab_size=300, cache_dir=str(tmp_path)))


# --- corpus and cache ----------------------------------------------------------------------------------------


@pytest.mark.real_text
def test_wikitext_corpus(wiki, wiki_cfg):
    n = len(wiki.train) + len(wiki.val)
    assert wiki.vocab_size == wiki.tokenizer.get_vocab_size() == 4096
    assert wiki.train.dtype == np.uint16 and isinstance(wiki.train, np.memmap)
    assert len(wiki.val) == int(n * wiki_cfg.val_fraction)
    assert 500_000 < n < 800_000  # 2.4 MB of text; 657,459 ids measured
    assert wiki.counts.dtype == wiki.rank.dtype == np.int64
    assert wiki.counts.shape == wiki.rank.shape == (4096,) and wiki.counts.sum() == len(wiki.train)
    assert sorted(wiki.rank.tolist()) == list(range(4096))
    assert wiki.rank[wiki.counts.argmax()] == 0
    assert np.all(np.diff(wiki.counts[np.argsort(wiki.rank)]) <= 0)
    root = sources.data_root(DataConfig())
    text = (root / "wikitext-2" / "test.txt").read_text()  # sorted first: test.txt before valid.txt
    assert text.startswith(wiki.tokenizer.decode(wiki.train[:500].tolist()))
    assert "wikitext-2" in wiki.source and len(wiki.key) == 16


def test_second_load_reuses_the_cache(wiki, wiki_cfg, monkeypatch):
    files = sorted((p.name, p.stat().st_mtime_ns) for p in Path(wiki_cfg.cache_dir).iterdir())
    assert [f for f, _ in files] == [f"ids-{wiki.key}.npy", f"tok-{wiki.key}.json"]

    def boom(*a, **k):
        raise AssertionError("cache miss: retrained or re-encoded")

    monkeypatch.setattr(corpus_mod, "train_bpe", boom)
    monkeypatch.setattr(corpus_mod, "encode", boom)
    again = load_corpus(wiki_cfg)
    assert again.key == wiki.key and np.array_equal(again.train, wiki.train) and np.array_equal(again.val, wiki.val)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in Path(wiki_cfg.cache_dir).iterdir()) == files
    # val_fraction is a slice of the cached stream, not part of the key
    other = load_corpus(DataConfig(**{**wiki_cfg.__dict__, "val_fraction": 0.1}))
    assert other.key == wiki.key and len(other.val) > len(wiki.val)


def test_key_follows_source_and_tokenizer_settings(tmp_path):
    f = write(tmp_path / "t.txt", SAMPLE)
    cfg = DataConfig(source=str(f), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    k1 = load_corpus(cfg).key
    assert load_corpus(DataConfig(**{**cfg.__dict__, "vocab_size": 320})).key != k1
    assert load_corpus(DataConfig(**{**cfg.__dict__, "max_chars": 1000})).key != k1
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # an edited file must not hit the old entry
    assert load_corpus(cfg).key != k1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]


def test_given_tokenizer_json(wiki, tmp_path):
    tok_file = tmp_path / "tokenizer.json"
    wiki.tokenizer.save(str(tok_file))
    f = write(tmp_path / "t.txt", SAMPLE)
    c = load_corpus(DataConfig(source=str(f), tokenizer=str(tok_file), cache_dir=str(tmp_path / "cache")))
    assert c.vocab_size == 4096
    assert np.concatenate([c.train, c.val]).tolist() == wiki.tokenizer.encode(SAMPLE).ids
    with pytest.raises(DataError, match="data.tokenizer"):
        load_corpus(DataConfig(source=str(f), tokenizer=str(tmp_path / "nope.json"), cache_dir=str(tmp_path)))


# --- hub path, exercised offline on local files through the real datasets.load_dataset -----------------------


@pytest.fixture
def hf_calls(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    calls, real = [], datasets.load_dataset

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    return calls


def test_hf_local_jsonl(tmp_path, hf_calls):
    rows = [{"body": line, "id": i} for i, line in enumerate(SAMPLE.splitlines())]
    f = write(tmp_path / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    c = load_corpus(DataConfig(source=f"hf:{f}", hf_text_field="body", vocab_size=300, cache_dir=str(tmp_path / "c")))
    assert hf_calls == [(("json", None), {"split": "train", "streaming": False, "data_files": str(f)})]
    assert c.tokenizer.decode(np.concatenate([c.train, c.val]).tolist()) == SAMPLE
    assert c.source.startswith(f"hf:{f}")


def test_hf_local_folder_streams_when_max_chars_is_set(tmp_path, hf_calls):
    write(tmp_path / "ds" / "part.txt", SAMPLE)
    cfg = DataConfig(source=f"hf:{tmp_path / 'ds'}", max_chars=2000, vocab_size=300, cache_dir=str(tmp_path / "c"))
    c = load_corpus(cfg)
    assert hf_calls[0][1]["streaming"] is True
    assert c.tokenizer.decode(np.concatenate([c.train, c.val]).tolist()) == SAMPLE[:2000]


def test_hf_wrong_field_and_offline_hub_are_one_line_errors(tmp_path, hf_calls, monkeypatch):
    import datasets

    f = write(tmp_path / "rows.jsonl", '{"body": "x"}\n')
    with pytest.raises(DataError, match=r"no column 'text'.*columns: body"):
        load_corpus(DataConfig(source=f"hf:{f}", vocab_size=300, cache_dir=str(tmp_path / "c")))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once instead of 23 s of retries
    with pytest.raises(DataError, match=r"hf:no-such-user/no-such-dataset:cfg.*cannot load") as e:
        load_corpus(DataConfig(source="hf:no-such-user/no-such-dataset:cfg", cache_dir=str(tmp_path / "c")))
    assert "\n" not in str(e.value) and hf_calls[-1][0] == ("no-such-user/no-such-dataset", "cfg")


# --- batches -------------------------------------------------------------------------------------------------


def test_batches_are_a_function_of_seed_and_step(wiki):
    a, b, c = (Batches(wiki.train, 8, 64, seed) for seed in (0, 0, 1))
    for step in (0, 1, 7, 1000):
        xa, ya = a.get(step)
        xb, yb = b.get(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, c.get(step)[0])
    assert not torch.equal(a.get(0)[0], a.get(1)[0])
    assert torch.equal(Batches(wiki.train, 8, 64, 0).get(1000)[0], a.get(1000)[0])  # a resumed run: no history


def test_batch_shapes_and_targets(wiki):
    x, y = Batches(wiki.train, 4, 32, 3).get(5)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    stream = torch.from_numpy(wiki.train.astype(np.int64))
    for row_x, row_y in zip(x, y):  # each row is a real window of the corpus and y is its next token
        starts = (stream[: len(stream) - 32] == row_x[0]).nonzero().flatten()
        assert any(torch.equal(stream[s:s + 32], row_x) and torch.equal(stream[s + 1:s + 33], row_y) for s in starts)


def test_fixed_batches_ignore_the_seed_and_cover_the_stream():
    tokens = np.arange(10_000, dtype=np.uint16)
    a, b = Batches(tokens, 8, 16, 0), Batches(tokens, 8, 16, 99)
    firsts = []
    for i in range(4):
        x, y = a.fixed(i)
        assert torch.equal(x, b.fixed(i)[0]) and torch.equal(y, x + 1)
        firsts += x[:, 0].tolist()
    assert firsts[0] == 0 and len(set(firsts)) == 32
    assert max(np.diff(sorted(firsts + [10_000 - 16]))) < 2 * 10_000 / 32  # spread, not clustered at the head


def test_too_short_for_seq_len():
    with pytest.raises(DataError, match="seq_len=64"):
        Batches(np.arange(64, dtype=np.uint16), 2, 64, 0)
    Batches(np.arange(65, dtype=np.uint16), 2, 64, 0).get(0)  # exactly seq_len + 1 is enough


# --- statistics ----------------------------------------------------------------------------------------------


def test_wikitext_stats(wiki):
    """Real text, or the synthetic stand-in, which must be as skewed: the detector's premise."""
    d = corpus_stats(wiki, tokens_per_step=16384)
    assert 0.8 < d["zipf_exponent"] < 1.2  # 0.89 measured at 4096 tokens (synthetic: 1.04)
    assert d["zipf_ranks"] == [1, 1000]
    assert d["top1_share"] < d["top10_share"] < d["top100_share"] < d["top1000_share"] <= 1
    assert d["uniform_row_per_step"] == 4.0
    assert d["top_row_per_step"] > 100 * d["uniform_row_per_step"]  # 672 vs 4 measured (synthetic: 760)
    assert 0.9 < d["coverage"] <= 1 and d["tokens_train"] == len(wiki.train)
    text = format_stats(d)
    assert "Zipf exponent" in text and "uniform" in text
    json.dumps(d)  # the CLI may write it out
