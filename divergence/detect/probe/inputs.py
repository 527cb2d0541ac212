"""Input families per slot: the inputs real training produces and the ones benchmark verifiers forget.

A family is a name, the shape keywords it uses (for the findings table) and `build(gen, device) -> Case`. Every
family draws from its own generator, seeded from the run's seed and the family's name, so `--seed N` rebuilds
exactly the inputs of a finding. Shapes are the contract's own, odd ones, ones that are not multiples of 8, 16 or
128, a batch of one and long sequences, and a production micro-batch (`production`: 2^17 tokens a call); token ids
are uniform, Zipfian at several exponents, drawn from real text, or one id everywhere; magnitudes go from what
SOL-ExecBench fed (logits in (0, 1)) to |x| of 100 and beyond. One family per slot, `long-run`, is called thousands
of times (longrun.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from ...errors import one_line
from ...slots import (add_rmsnorm, attn_softcap, cross_entropy, fused_embed_rmsnorm, geglu, qkv_proj, rmsnorm,
                      rmsnorm_backward, rope, rope_backward, swiglu, swiglu_backward)
from . import longrun

FREQUENT_ROWS = 16  # rows checked one by one in a scatter output: the most frequent ids, those seen twice or more
# The vocabulary of the real text (`corpus` families: WikiText-2 through a byte-level BPE of this size, cached
# under data/ after the first run) and of the synthetic Zipf and one-id families set beside it: one vocabulary, so
# their ids differ only in how they are distributed (docs/story.md's op-level table makes that comparison at this size,
# with word-level ids: a bf16-accumulating kernel's error 3.39e-3 on uniform ids, 2.43e-2 on real text). Chosen,
# not tuned: the recipes' default tokenizer size (DataConfig.vocab_size). A declared vocabulary below it leaves
# the corpus family out (shapes.py): its ids would not fit.
VOCAB = 4096
# Tokens per call of the `production` families: training's micro-batches are 2^17 = 131,072 tokens and more, twice
# the GPU's `large` family and 8x the CPU's longest. A kernel with a path of its own for big calls (a split
# reduction switched on above 65,536 tokens, say) is judged on it only at that size. Kept cheap on the CPU by a
# narrow width: 0.1-0.7 s per slot for the float64 oracle (2-core CPU, 2026-11-27).
PRODUCTION_TOKENS = 1 << 17


@dataclass
class Case:
    inputs: tuple  # in the contract's order
    context: dict = field(default_factory=dict)  # keyword context, e.g. vocab_size
    rows: dict = field(default_factory=dict)  # output index -> LongTensor of its most frequent rows (scatter outputs)


@dataclass(frozen=True)
class Family:
    name: str  # e.g. zipf-1.1, logits-0-1, odd
    shape: dict  # the shape keywords, for the table
    build: Callable  # (generator, device) -> Case
    deep: bool = False  # also run the determinism and storage-reuse checks on it (they cost 5 more calls)
    gpu_only: bool = False  # too slow for the CPU budget
    calls: int = 1  # above 1: a long run, this many calls with a sample of them judged (longrun.py)

    def shape_str(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


def long_run(fam: Family) -> Family:
    """`fam` as the long-run family: longrun.CALLS calls on copies of two of its draws (longrun.py: which)."""
    return replace(fam, name="long-run", shape={**fam.shape, "calls": longrun.CALLS}, deep=False,
                   calls=longrun.CALLS)


def family_seed(seed: int, name: str) -> int:
    """The family's own seed: reproducible from the run's seed, different for every family."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62)


# ------------------------------------------------------------------------------------------------- token ids


def uniform_ids(gen, vocab, batch, seq):
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def zipf_ids(gen, vocab, batch, seq, s):
    """P(rank k) ~ 1/k^s, ranks scattered over the vocabulary by a random permutation (frequent ids are not 0..k)."""
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    ranks = torch.multinomial(p, batch * seq, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks].view(batch, seq)


def one_id(gen, vocab, batch, seq):
    """The adversarial extreme: one id everywhere, so one row takes every contribution."""
    return torch.full((batch, seq), int(torch.randint(0, vocab, (1,), generator=gen)), dtype=torch.long)


def _corpus():
    """(token ids of WikiText-2's training split, vocabulary size), or the reason it cannot be had (22 ms from the
    data cache, memory-mapped)."""
    try:
        from ...data import load_corpus
        from ...recipe import DataConfig

        c = load_corpus(DataConfig(source="wikitext-2", vocab_size=VOCAB))  # cached under data/ after the first run
        return c.train, int(c.vocab_size)
    except Exception as e:  # no text, no tokenizers, unreadable cache: the family is skipped, not the probe
        return one_line(e)


class RealText:
    """The real text the `corpus` families draw from, loaded at most once by its holder: one per family list
    (`families` makes one; a probe builds its list once, a spawned worker its own), not memoised for the process."""

    def __init__(self):
        self._got = None

    def _get(self):
        if self._got is None:
            self._got = _corpus()
        return self._got

    def vocab(self) -> Optional[int]:
        c = self._get()
        return None if isinstance(c, str) else c[1]

    def note(self) -> Optional[str]:
        c = self._get()
        return c if isinstance(c, str) else None

    def ids(self, gen, vocab, batch, seq):
        """`batch` windows of `seq` consecutive tokens of real text, at random offsets."""
        train, _ = self._get()
        offsets = torch.randint(0, len(train) - seq, (batch,), generator=gen).tolist()
        return torch.stack([torch.from_numpy(train[o:o + seq].astype("int64")) for o in offsets])


def frequent_rows(ids, vocab) -> torch.Tensor:
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=vocab)
    top = counts.argsort(descending=True)[:FREQUENT_ROWS]
    return top[counts[top] > 1]


# -------------------------------------------------------------------------------------------------- per slot


def _shape(shape: dict, dtype: torch.dtype, **optional) -> dict:
    """The shape keywords for the table: `shape`, then each `optional` name=(value, default) as `value:g` where
    the value is not its default, then the dtype where it is not float32."""
    shape = {**shape, **{k: f"{v:g}" for k, (v, default) in optional.items() if v != default}}
    if dtype != torch.float32:
        shape["dtype"] = str(dtype).replace("torch.", "")
    return shape


def _embed(name, ids_fn, batch, seq, hidden, vocab, **kw):
    def build(gen, device):
        ids = ids_fn(gen, vocab, batch, seq)
        inputs = fused_embed_rmsnorm.make_inputs(gen, device, batch=batch, seq=seq, hidden=hidden, vocab=vocab,
                                                 ids=ids)
        return Case(inputs, {"vocab_size": vocab}, {0: frequent_rows(ids, vocab)})

    return Family(name, dict(batch=batch, seq=seq, hidden=hidden, vocab=vocab), build, **kw)


def _zipf(s):
    return lambda gen, vocab, batch, seq: zipf_ids(gen, vocab, batch, seq, s)


def embed_families(text: RealText) -> list:
    z = _zipf(1.1)
    fams = [
        _embed("uniform", uniform_ids, 4, 128, 64, 512, deep=True),  # the contract's shapes
        _embed("zipf-0.8", _zipf(0.8), 4, 1024, 64, VOCAB),
        _embed("zipf-1.1", z, 4, 1024, 64, VOCAB, deep=True),
        _embed("zipf-1.4", _zipf(1.4), 4, 1024, 64, VOCAB),
        _embed("one-id", one_id, 2, 1024, 64, VOCAB),
        _embed("odd", z, 3, 37, 57, 1001),
        _embed("hidden-72", z, 4, 256, 72, 1000),  # a multiple of 8, not of 16
        _embed("hidden-400", z, 2, 256, 400, 1000),  # a multiple of 16, not of 128
        _embed("hidden-4096", z, 1, 128, 4096, 256),  # SOL-ExecBench L1/087's width
        _embed("batch-1", z, 1, 64, 64, 512),
        _embed("one-token", uniform_ids, 1, 1, 64, 512),
        _embed("long-seq", z, 1, 16384, 64, VOCAB),
        long_run(_embed("zipf-1.1", z, 4, 128, 64, 512)),  # the contract's shapes, with frequent rows
        _embed("production", z, 32, PRODUCTION_TOKENS // 32, 64, VOCAB),
        # NOTES' op-level shape: 65,536 tokens, hidden 384, vocabulary 16,384 (the bf16 CPU model is slow there)
        _embed("large", z, 16, 4096, 384, 16384, gpu_only=True),
    ]
    v = text.vocab()
    if v is not None:
        fams.insert(4, _embed("corpus", text.ids, 8, 2048, 64, v))  # 16k tokens: a training step of NOTES
    return fams


NORMED = ("x", "hidden_states", "residual")  # a norm slot's inputs whose rows it normalises (add_rmsnorm: their sum)


def _norm(mod, name, rows, hidden, scale=1.0, row_scales=False, dtype=torch.float32, **kw):
    """rmsnorm / rmsnorm_backward / add_rmsnorm: `scale` multiplies the normalised rows (x, or both terms of the
    sum); `row_scales` gives every row its own, 1e-4 to 1e4."""
    rows_at = [i for i, n in enumerate(mod.CONTRACT.inputs) if n in NORMED]

    def build(gen, device):
        inputs = list(mod.make_inputs(gen, device, rows=rows, hidden=hidden, scale=scale, dtype=dtype))
        if row_scales:
            s = torch.pow(10.0, torch.empty(rows, 1).uniform_(-4, 4, generator=gen)).to(device)
            for i in rows_at:
                inputs[i] = (inputs[i].float() * s).to(dtype)
        return Case(tuple(inputs))

    return Family(name, _shape(dict(rows=rows, hidden=hidden), dtype, scale=(scale, 1.0)), build, **kw)


def norm_families(mod) -> list:
    return [
        _norm(mod, "contract", 256, 64, deep=True),
        _norm(mod, "tiny-rows", 256, 64, scale=1e-4),  # mean(x^2) = 1e-8, below eps
        _norm(mod, "huge-rows", 256, 64, scale=1e4),
        _norm(mod, "mixed-rows", 256, 64, row_scales=True),
        _norm(mod, "bf16", 256, 64, dtype=torch.bfloat16),
        _norm(mod, "odd", 37, 57),
        _norm(mod, "hidden-72", 64, 72),
        _norm(mod, "hidden-4000", 16, 4000),  # a multiple of 16, not of 128
        _norm(mod, "batch-1", 1, 64),
        _norm(mod, "long", 16384, 64),
        long_run(_norm(mod, "contract", 256, 64)),
        _norm(mod, "production", PRODUCTION_TOKENS, 64),
    ]


def _qkv(name, batch, seq, hidden, heads, head_dim, kv_heads=None, scale=1.0, dtype=torch.float32, **kw):
    """qkv_proj: `scale` multiplies the activations; kv_heads < heads is grouped-query attention."""
    def build(gen, device):
        return Case(qkv_proj.make_inputs(gen, device, batch=batch, seq=seq, hidden=hidden, heads=heads,
                                         kv_heads=kv_heads, head_dim=head_dim, scale=scale, dtype=dtype),
                    {"head_dim": head_dim})

    shape = dict(batch=batch, seq=seq, hidden=hidden, heads=heads, head_dim=head_dim)
    if kv_heads and kv_heads != heads:
        shape["kv_heads"] = kv_heads
    return Family(name, _shape(shape, dtype, scale=(scale, 1.0)), build, **kw)


def qkv_families() -> list:
    return [
        _qkv("contract", 2, 64, 64, 4, 16, deep=True),
        _qkv("gqa", 2, 64, 64, 4, 16, kv_heads=2, deep=True),  # grouped-query: 4 query heads share 2 key heads
        _qkv("scale-30", 2, 64, 64, 4, 16, scale=30.0),
        _qkv("bf16", 2, 64, 64, 4, 16, dtype=torch.bfloat16),
        _qkv("odd", 3, 37, 72, 3, 24),
        _qkv("batch-1", 1, 64, 64, 4, 16),
        _qkv("long-seq", 1, 8192, 64, 4, 16),
        long_run(_qkv("contract", 2, 64, 64, 4, 16)),
        _qkv("production", 32, PRODUCTION_TOKENS // 32, 64, 4, 16),
    ]


def _rope(name, batch, heads, seq, head_dim, theta=10000.0, scaling=1.0, positions="arange", dtype=torch.float32,
          mod=rope, **kw):
    """rope / rope_backward (`mod`), whose inputs end with position_ids and inv_freq. `scaling` divides inv_freq
    (linear position interpolation); positions: arange, offset or packed."""
    def build(gen, device):
        inputs = list(mod.make_inputs(gen, device, batch=batch, heads=heads, seq=seq, head_dim=head_dim, theta=theta,
                                      dtype=dtype))
        pos = inputs[-2]
        if positions == "offset":  # decoding deep into a long context
            pos = pos + 100_000
        elif positions == "packed":  # documents packed into one row: positions restart at each boundary
            starts = torch.zeros(batch, seq, dtype=torch.long)
            starts[:, 1:] = (torch.rand(batch, seq - 1, generator=gen) < 0.02).long()
            idx = torch.arange(seq).expand(batch, seq)
            last = torch.cummax(torch.where(starts.bool(), idx, torch.zeros_like(idx)), dim=1).values
            pos = (idx - last).to(device)
        inputs[-2:] = pos, inputs[-1] / scaling
        return Case(tuple(inputs))

    shape = dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, theta=f"{theta:g}")
    return Family(name, _shape(shape, dtype, scaling=(scaling, 1.0)), build, **kw)


def rope_families(mod=rope) -> list:
    r = lambda *a, **kw: _rope(*a, mod=mod, **kw)  # noqa: E731
    return [
        r("contract", 2, 2, 64, 16, deep=True),
        r("theta-500k", 2, 2, 64, 16, theta=500000.0),  # Llama 3
        r("theta-1m", 2, 2, 64, 16, theta=1e6),
        r("theta-1234.5", 2, 2, 64, 16, theta=1234.5),  # in no table
        r("scaled-8", 2, 2, 64, 16, scaling=8.0),  # linear scaling: inv_freq / 8
        r("positions-offset", 2, 2, 64, 16, positions="offset"),
        r("packed", 2, 2, 256, 16, positions="packed"),
        r("bf16", 2, 2, 64, 16, dtype=torch.bfloat16),
        r("odd", 1, 3, 37, 24),
        r("head-dim-80", 2, 2, 64, 80),  # a multiple of 16, not of 128
        r("batch-1", 1, 2, 64, 16),
        r("long-seq", 1, 2, 8192, 64, theta=500000.0),
        long_run(r("contract", 2, 2, 64, 16)),
        r("production", 32, 1, PRODUCTION_TOKENS // 32, 16, theta=500000.0),  # 32 sequences of 4096
    ]


def _softcap(name, batch, heads, seq, scale=30.0, cap=20.0, causal=True, unit=False, dtype=torch.float32, **kw):
    """`unit`: scores uniform in (0, 1), what SOL-ExecBench fed; else normal with std `scale`."""
    def build(gen, device):
        s, c = attn_softcap.make_inputs(gen, device, batch=batch, heads=heads, seq=seq, scale=scale, cap=cap,
                                        causal=causal, dtype=dtype)
        if unit:
            u = torch.rand(batch, heads, seq, seq, generator=gen).to(device, dtype)
            s = torch.where(torch.isneginf(s), s, u)
        return Case((s, c))

    shape = dict(batch=batch, heads=heads, seq=seq, scale="U(0,1)" if unit else f"{scale:g}", cap=f"{cap:g}")
    if not causal:
        shape["causal"] = False
    return Family(name, _shape(shape, dtype), build, **kw)


def softcap_families() -> list:
    return [
        _softcap("contract", 2, 2, 64, deep=True),
        _softcap("logits-0-1", 2, 2, 64, unit=True),
        _softcap("scale-1", 2, 2, 64, scale=1.0),
        _softcap("scale-100", 2, 2, 64, scale=100.0),
        _softcap("scale-1000", 2, 2, 64, scale=1000.0),
        _softcap("cap-50", 2, 2, 64, scale=100.0, cap=50.0),
        _softcap("cap-5", 2, 2, 64, scale=30.0, cap=5.0),
        _softcap("no-mask", 2, 2, 64, causal=False),
        _softcap("bf16", 2, 2, 64, dtype=torch.bfloat16),
        _softcap("odd", 1, 3, 37),
        _softcap("batch-1", 1, 2, 64),
        _softcap("long-seq", 1, 1, 2048),
        long_run(_softcap("contract", 2, 2, 64)),
        # 131,072 query rows as 2,048 sequences of 64: a production call's row count, without its seq^2 scores
        _softcap("production", PRODUCTION_TOKENS // 64, 1, 64),
    ]


def _swiglu(name, rows, ff, scale=1.0, dtype=torch.float32, mod=swiglu, **kw):
    """swiglu / swiglu_backward / geglu (`mod`): `scale` multiplies the gate."""
    def build(gen, device):
        return Case(mod.make_inputs(gen, device, rows=rows, ff=ff, scale=scale, dtype=dtype))

    return Family(name, _shape(dict(rows=rows, ff=ff), dtype, scale=(scale, 1.0)), build, **kw)


def swiglu_families(mod=swiglu) -> list:
    s = lambda *a, **kw: _swiglu(*a, mod=mod, **kw)  # noqa: E731
    return [
        s("contract", 256, 176, deep=True),
        s("scale-0.01", 256, 176, scale=0.01),
        s("scale-30", 256, 176, scale=30.0),
        s("scale-1000", 256, 176, scale=1000.0),  # sigmoid saturates: exp overflows in fp32
        s("bf16", 256, 176, dtype=torch.bfloat16),
        s("odd", 37, 177),
        s("ff-4000", 16, 4000),
        s("batch-1", 1, 176),
        s("long", 16384, 176),
        long_run(s("contract", 256, 176)),
        s("production", PRODUCTION_TOKENS, 64),  # ff 64: the oracle of 176 took 1.7 s here
    ]


def _ce(name, rows, vocab, ids_fn=None, scale=3.0, dtype=torch.float32, **kw):
    """Targets are token ids too: `ids_fn` replaces the contract's uniform targets."""
    def build(gen, device):
        logits, targets = cross_entropy.make_inputs(gen, device, rows=rows, vocab=vocab, scale=scale, dtype=dtype)
        if ids_fn is not None:
            targets = ids_fn(gen, vocab, 1, rows).view(rows).to(device)
        return Case((logits, targets))

    return Family(name, _shape(dict(rows=rows, vocab=vocab), dtype, scale=(scale, 3.0)), build, **kw)


def ce_families(text: RealText) -> list:
    fams = [
        _ce("contract", 256, 512, deep=True),
        _ce("zipf-1.1", 2048, VOCAB, _zipf(1.1)),
        _ce("one-id", 256, 512, one_id),
        _ce("scale-30", 256, 512, scale=30.0),
        _ce("scale-300", 256, 512, scale=300.0),
        _ce("bf16", 256, 512, dtype=torch.bfloat16),
        _ce("odd", 37, 1001),
        _ce("vocab-50257", 64, 50257),  # GPT-2's: odd, and no power of two divides it
        _ce("batch-1", 1, 512),
        _ce("long", 8192, 512),
        long_run(_ce("contract", 256, 512)),
        _ce("production", PRODUCTION_TOKENS, 128),  # vocab 128: the oracle of 512 took 2.7 s here
    ]
    v = text.vocab()
    if v is not None:
        fams.insert(2, _ce("corpus", 2048, v, text.ids))
    return fams


FAMILIES: dict = {  # slot -> its families, given the real text (which only two slots draw from)
    "fused_embed_rmsnorm": embed_families,
    "rmsnorm": lambda text: norm_families(rmsnorm),
    "rmsnorm_backward": lambda text: norm_families(rmsnorm_backward),
    "qkv_proj": lambda text: qkv_families(),
    "rope": lambda text: rope_families(),
    "rope_backward": lambda text: rope_families(rope_backward),
    "attn_softcap": lambda text: softcap_families(),
    "add_rmsnorm": lambda text: norm_families(add_rmsnorm),
    "swiglu": lambda text: swiglu_families(),
    "swiglu_backward": lambda text: swiglu_families(swiglu_backward),
    "geglu": lambda text: swiglu_families(geglu),
    "cross_entropy": ce_families,
}

# Slots whose families draw real-text ids: without the corpus that family is skipped, with a note.
USES_CORPUS = ("fused_embed_rmsnorm", "cross_entropy")


def families(slot: str, device: str, text: Optional[RealText] = None) -> tuple:
    """(the families to run on `device`, notes on those left out); `text`: the real text of the `corpus`
    families (a fresh RealText if None)."""
    text = text or RealText()
    fams = FAMILIES[slot](text)
    notes = []
    if slot in USES_CORPUS and text.vocab() is None:
        notes.append(f"family corpus skipped: real-text ids unavailable ({text.note()})")
    cpu_skip = [f.name for f in fams if f.gpu_only and device != "cuda"]
    if cpu_skip:
        notes.append(f"GPU-only famil{'y' if len(cpu_skip) == 1 else 'ies'} skipped on {device}: {', '.join(cpu_skip)}")
    return [f for f in fams if not (f.gpu_only and device != "cuda")], notes
