"""Text without ../shared: the synthetic Zipfian stand-in, the fallback to it, and WikiText-2's hub copy (with
`datasets.load_dataset` replaced through its public name: no network here)."""
import collections
import io
import logging
from pathlib import Path

import numpy as np
import pytest

from divergence.data import corpus_stats, load_corpus
from divergence.data import hub, sources, synthetic
from divergence.errors import DataError
from divergence.recipe import DataConfig


def test_same_seed_same_text_other_seed_other_text():
    a, b, c = synthetic.generate(0, 20_000), synthetic.generate(0, 20_000), synthetic.generate(1, 20_000)
    assert a == b and a != c
    assert synthetic.generate(0, 50_000).startswith(a)  # max_chars takes a prefix: one stream per seed
    assert len(a) >= 20_000 and a.endswith(" . \n")  # WikiText-2's layout: " Words , words . \n"


def test_word_frequencies_follow_zipf_like_real_text():
    """Word-level slope over ranks 1..1000 in 1.0..1.15 (WikiText-2: 0.93; measured here 1.10), the head as
    heavy as WikiText-2's (its top word: 5.9% of words), sentences end with a full stop and start capitalised."""
    text = synthetic.generate(0)
    w = text.split()  # punctuation stands apart, as in WikiText-2
    freq = np.array(sorted(collections.Counter(w).values(), reverse=True), dtype=np.float64)
    ranks = np.arange(1, 1001)
    slope = -np.polyfit(np.log(ranks), np.log(freq[:1000]), 1)[0]
    assert 1.0 < slope < 1.15
    assert 0.04 < freq[0] / freq.sum() < 0.1
    assert len(freq) > 8_000  # a long tail before <unk> (WikiText-2: 18,327 words with <unk>; here 10,629)
    assert 0.04 < w.count("<unk>") / len(w) < 0.08  # 6.1% (WikiText-2: 5.9%)
    lines = text.splitlines()
    assert all(line.startswith(" ") and line.endswith(" . ") for line in lines)
    assert all(line[1].isupper() or line.startswith(" <unk>") for line in lines)
    assert 5 < w.count(".") / len(lines) < 12  # several sentences a line


def test_synthetic_source_trains_bpe_and_is_cached(tmp_path):
    cfg = DataConfig(source="synthetic:3", vocab_size=1024, max_chars=300_000, cache_dir=str(tmp_path))
    c = load_corpus(cfg)
    assert c.source.startswith("synthetic:3: seeded Zipfian text") and "300,000 chars" in c.source
    assert c.tokenizer.decode(np.concatenate([c.train, c.val]).tolist()) == synthetic.generate(3, 300_000)[:300_000]
    d = corpus_stats(c, tokens_per_step=1024)
    assert d["top_row_per_step"] > 20 * d["uniform_row_per_step"]  # Zipfian, not uniform: 34x measured
    assert load_corpus(cfg).key == c.key != load_corpus(DataConfig(**{**cfg.__dict__, "source": "synthetic"})).key


def test_bad_synthetic_seed_is_one_line():
    with pytest.raises(DataError, match=r"'synthetic:x'.*synthetic:SEED"):
        load_corpus(DataConfig(source="synthetic:x"))


@pytest.fixture
def no_local_text(tmp_path, monkeypatch):
    """A data root without wikitext-2, no fallback set: the name is found nowhere on disk."""
    (tmp_path / "root" / "other").mkdir(parents=True)
    monkeypatch.delenv(sources.FALLBACK_VAR, raising=False)
    return dict(root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"), vocab_size=300)


def test_fallback_stands_in_for_a_missing_known_corpus_only(no_local_text, monkeypatch, caplog):
    monkeypatch.setenv(sources.FALLBACK_VAR, "synthetic:2")
    cfg = DataConfig(source="wikitext-2", max_chars=50_000, **no_local_text)
    with caplog.at_level(logging.WARNING):
        c = load_corpus(cfg)
    assert c.source.startswith("synthetic:2:")
    assert "'wikitext-2': not found" in caplog.text and "DIVERGENCE_TEXT_FALLBACK" in caplog.text
    (Path(no_local_text["root"]) / "other" / "a.txt").write_text("real words here\n" * 40)
    found = load_corpus(DataConfig(source="other", **no_local_text))  # a name that exists is never replaced
    assert found.source.startswith("other: a.txt")
    with pytest.raises(DataError, match="'wikitxt-2': no such file"):  # nor is a typo, or any unknown name
        load_corpus(DataConfig(source="wikitxt-2", **no_local_text))


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset answering for WikiText-2 with a small in-memory Dataset, recording its calls."""
    datasets = pytest.importorskip("datasets")
    calls = []
    rows = [" = Valkyria Chronicles = \n", "", " The game began development in 2010 .\n"] * 200

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if fake.offline:
            raise ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub (LocalEntryNotFoundError)")
        return datasets.Dataset.from_dict({"text": rows})

    fake.offline = False
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub.socket, "create_connection", lambda *a, **k: io.BytesIO())  # "reachable"
    return fake, calls, "".join(r if r.endswith("\n") else r + "\n" for r in rows)


def test_wikitext_2_without_a_local_copy_is_fetched_once(no_local_text, fake_hub, caplog):
    fake, calls, text = fake_hub
    cfg = DataConfig(source="wikitext-2", **no_local_text)
    with caplog.at_level(logging.WARNING):
        c = load_corpus(cfg)
    assert calls == [(("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": "train", "streaming": False})]
    assert "no local copy" in caplog.text and "fetching hf:Salesforce/wikitext:wikitext-2-raw-v1" in caplog.text
    assert c.source.startswith("wikitext-2 (no local copy): hf:Salesforce/wikitext:wikitext-2-raw-v1 split=train")
    assert c.tokenizer.decode(np.concatenate([c.train, c.val]).tolist()) == text
    fake.offline = True  # cached: the second load neither reads nor fetches
    assert load_corpus(cfg).key == c.key and len(calls) == 1


def test_no_local_copy_and_no_network_is_one_line(no_local_text, fake_hub):
    fake, calls, _ = fake_hub
    fake.offline = True
    with pytest.raises(DataError) as e:
        load_corpus(DataConfig(source="wikitext-2", **no_local_text))
    msg = str(e.value)
    assert "\n" not in msg and len(calls) == 1
    for needle in ("'wikitext-2': no local copy", f"{no_local_text['root']}/wikitext-2", "ConnectionError: Couldn't",
                   "hf:Salesforce/wikitext:wikitext-2-raw-v1 cannot be fetched", "--set data.source=synthetic"):
        assert needle in msg


def test_unreachable_hub_fails_at_once_without_datasets(no_local_text, fake_hub, monkeypatch):
    """No network: one line after one connect attempt, not huggingface_hub's 25 s of retries."""
    fake, calls, _ = fake_hub

    def refused(address, timeout=None):
        assert address == ("huggingface.co", 443) and timeout <= 5
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(hub.socket, "create_connection", refused)
    with pytest.raises(DataError, match=r"cannot be fetched \(cannot reach huggingface.co:443: Name or service not"):
        load_corpus(DataConfig(source="wikitext-2", **no_local_text))
    assert calls == []
