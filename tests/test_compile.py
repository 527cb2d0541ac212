"""`train.compile`: the model body and the lockstep metrics under torch.compile, candidates never inside a graph.

On the CPU, inductor generates C++ (a few seconds per graph at the tiny shapes); aot_eager traces without code
generation, enough to see what is inside a graph and what is not.
"""
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from divergence.errors import RecipeError
from divergence.detect.lockstep import Lockstep
from divergence.model import build_model
from divergence.recipe import load_recipe
from divergence.candidates.resolve import build_kernels
from divergence.slots import swiglu
from divergence.slots import fused_embed_rmsnorm as fer
from divergence.slots.registry import Impl

VOCAB = 512
# inductor on the CPU compiles C++: without a compiler those tests cannot run (the aot_eager ones still do)
needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler for inductor")


def _batch(r, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, r.model.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _losses(model, r, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    x, y = _batch(r)
    for _ in range(steps):  # one batch again and again: the loss must fall
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def test_recipe_names_an_unknown_compile_backend():
    with pytest.raises(RecipeError, match=r"train\.compile: unknown backend 'turbo'"):
        load_recipe("tiny", {"train": {"compile": "turbo"}})
    assert load_recipe("h200").train.compile == "inductor+cudagraphs"
    assert load_recipe("tiny").train.compile is None


@needs_cxx
def test_compiled_body_trains_as_the_eager_model():
    r = load_recipe("tiny")
    k = build_kernels({}, {"vocab_size": VOCAB})
    eager = _losses(build_model(r.model, VOCAB, k, 0), r)
    m = build_model(r.model, VOCAB, k, 0)
    m.compile_body("inductor")
    compiled = _losses(m, r)
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert eager[-1] < eager[0]  # it trained: three equal numbers would also match


def _graphs_of(model, r):
    """The FX graphs torch.compile builds for one training step of `model` (a recording backend)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.body = torch.compile(model._body, backend=record, dynamic=False)
    x, y = _batch(r)
    model(x, y).backward()
    return graphs


def _calls(graphs, name):
    return sum(name in str(n.target) for g in graphs for n in g.graph.nodes)


def test_candidates_run_outside_the_graph_and_plain_references_inside():
    r = load_recipe("tiny")
    plain = _graphs_of(build_model(r.model, VOCAB, build_kernels({}, {"vocab_size": VOCAB}), 0), r)
    assert len(plain) == 1 and _calls(plain, "silu") == r.model.n_layers  # the reference swiglu, fused in

    compiling = []

    def candidate(gate, up):
        compiling.append(torch.compiler.is_compiling())
        return swiglu.reference(gate, up)

    k = build_kernels({"swiglu": Impl(slot="swiglu", name="c", fn=candidate, role="candidate")}, {"vocab_size": VOCAB})
    graphs = _graphs_of(build_model(r.model, VOCAB, k, 0), r)
    assert compiling == [False] * r.model.n_layers  # called, and never while tracing
    assert _calls(graphs, "silu") == 0 and len(graphs) > 1  # the graph breaks at each candidate call

    # A reference someone watches (a lockstep tap) is not plain: it runs as written too, its tap never traced.
    for slot, op in (("swiglu", "silu"), ("rmsnorm", "rsqrt")):
        tapped = []
        k = build_kernels({}, {"vocab_size": VOCAB})
        k.add_tap(lambda *a: tapped.append(torch.compiler.is_compiling()), [slot])
        assert _calls(plain, op) > 0 and _calls(_graphs_of(build_model(r.model, VOCAB, k, 0), r), op) == 0, slot
        assert tapped and not any(tapped), slot


def _lockstep(compile_backend):
    r = load_recipe("tiny", {"train": {"compile": compile_backend}})
    rank = np.random.default_rng(0).permutation(VOCAB)
    rec = SimpleNamespace(current_step=0, lockstep=None)
    k = build_kernels({"fused_embed_rmsnorm": "zoo:embed_bf16_accum"}, {"vocab_size": VOCAB})
    return Lockstep(r, "fused_embed_rmsnorm", k, SimpleNamespace(rank=rank), rec)


def _embed_inputs():
    """Inputs and the candidate's (the bf16 kernel's) outputs on them."""
    g = torch.Generator().manual_seed(0)
    zipf = torch.distributions.Categorical(probs=1.0 / torch.arange(1, VOCAB + 1).double())
    torch.manual_seed(0)
    ids = zipf.sample((32, 128))  # ~600 contributions to the top row: where bf16 increments get lost
    inputs = fer.make_inputs(g, hidden=32, vocab=VOCAB, ids=ids)
    cand = build_kernels({"fused_embed_rmsnorm": "zoo:embed_bf16_accum"}, {"vocab_size": VOCAB})
    return inputs, cand("fused_embed_rmsnorm", *inputs)


@needs_cxx
def test_compiled_lockstep_metrics_equal_the_eager_ones():
    inputs, cand_out = _embed_inputs()
    eager, compiled = _lockstep(None), _lockstep("inductor")
    assert compiled.compiled and not eager.compiled
    a, b = eager._check(inputs, cand_out, inputs), compiled._check(inputs, cand_out, inputs)
    assert compiled.compile_fallback is None
    assert len(a) == len(eager.keys) and torch.allclose(a, b, rtol=1e-9, atol=0)
    vals = dict(zip(eager.keys, a.tolist()))
    assert vals["lockstep/top-10/err_candidate"] > 2 * vals["lockstep/top-10/err_reference"]  # wrong by the rule (RATIO)


def test_a_failing_compiled_check_falls_back_to_eager_and_says_so():
    inputs, cand_out = _embed_inputs()
    lk = _lockstep("aot_eager")

    def broken(*args):
        raise RuntimeError("CompilationError: at 18:4: boom")

    lk.measure = broken
    row = lk._check(inputs, cand_out, inputs)
    assert torch.equal(row, _lockstep(None)._check(inputs, cand_out, inputs))  # checked all the same
    s = lk.summary()
    assert not s["compiled_metrics"] and "CompilationError" in s["compile_fallback"] and s["error"] is None


def test_the_plain_rope_on_shared_tables_is_the_slots_reference_bit_for_bit():
    r = load_recipe("tiny")
    x, y = _batch(r)
    plain = build_model(r.model, VOCAB, build_kernels({}, {"vocab_size": VOCAB}), 0)
    watched = build_kernels({}, {"vocab_size": VOCAB})
    calls = []
    watched.add_tap(lambda slot, *_: calls.append(slot), ["rope"])  # not plain: each layer calls the slot
    assert torch.equal(plain(x, y), build_model(r.model, VOCAB, watched, 0)(x, y))
    assert calls == ["rope"] * r.model.n_layers


def _embed_grads(kernels, r, compile_backend=None):
    m = build_model(r.model, VOCAB, kernels, 0)
    if compile_backend:
        m.compile_body(compile_backend)
    x, y = _batch(r)
    m(x, y).backward()
    return m.embed.grad, m.embed_norm.grad


def test_the_compiled_embedding_runs_the_slots_reference_only_where_it_is_plain(monkeypatch):
    from divergence.slots.registry import Kernels

    r = load_recipe("tiny")
    dispatched = []
    real_call = Kernels.__call__

    def counting(self, slot, *inputs):
        dispatched.append(slot)
        return real_call(self, slot, *inputs)

    monkeypatch.setattr(Kernels, "__call__", counting)
    eager = _embed_grads(build_kernels({}, {"vocab_size": VOCAB}), r)
    assert dispatched.count("fused_embed_rmsnorm") == 1  # eager: the slot, through the registry
    dispatched.clear()
    compiled = _embed_grads(build_kernels({}, {"vocab_size": VOCAB}), r, "aot_eager")
    assert "fused_embed_rmsnorm" not in dispatched  # the plain reference, compiled (ops.CompiledEmbed)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(eager, compiled))
    # a null or a candidate, or a watched reference: through the registry, as written
    for spec in ("null-1", "zoo:embed_bf16_accum"):
        dispatched.clear()
        _embed_grads(build_kernels({"fused_embed_rmsnorm": spec}, {"vocab_size": VOCAB}), r, "aot_eager")
        assert dispatched.count("fused_embed_rmsnorm") == 1, spec
    watched = build_kernels({}, {"vocab_size": VOCAB})
    seen = []
    watched.add_tap(lambda slot, *_: seen.append(slot), ["fused_embed_rmsnorm"])
    _embed_grads(watched, r, "aot_eager")
    assert seen == ["fused_embed_rmsnorm"]
