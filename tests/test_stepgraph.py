"""The step graph (train/stepgraph.py): which arms get one, its warm-up, capture, replay and give-up on the CPU
through a stand-in for CUDA's capture, and on a GPU an arm with it against the same arm without."""
import pytest
import torch

from divergence.candidates.resolve import build_kernels
from divergence.recipe import load_recipe
from divergence.train.arm import ArmSpec, run_arm, step_graph_for
from divergence.train.metrics import read_metrics
from divergence.train.stepgraph import StepGraph


class _FakeGraph:
    """CUDA's capture stood in for: replay() runs the captured function on the captured inputs, into the captured
    outputs (as a real replay rewrites them)."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs, self.replays = fn, inputs, outputs, 0

    def pool(self):
        return ("pool of", id(self))

    def replay(self):
        self.replays += 1
        for dst, src in zip(self.outputs, self.fn(*self.inputs)):
            dst.copy_(src)


def _fake_capture(fn, inputs, stream, pool=None):
    outputs = tuple(torch.empty_like(o) for o in fn(*inputs))  # shapes only: a real capture runs nothing
    return _FakeGraph(fn, inputs, outputs), outputs


def test_warm_up_then_one_capture_then_replays_of_new_inputs():
    calls = []

    def fn(x, y):
        calls.append(x.clone())
        return x * 2 + y, (x * y).sum()

    g = StepGraph(warmup=3, capture=_fake_capture)
    for i in range(6):
        x, y = torch.full((3,), float(i)), torch.ones(3)
        a, b = g(fn, x, y)
        assert torch.equal(a, x * 2 + y) and b.item() == 3 * i  # every call answers for its own inputs
        a.add_(100)  # a copy: the caller's writes must not reach the captured outputs
    assert g.graph is not None and g.captured_at == 3 and g.graph.replays == 3  # steps 3 (capture), 4 and 5
    assert g.off is None and g.describe()["step_graph"] == "captured at step 3"
    assert [c[0].item() for c in calls[:3]] == [0.0, 1.0, 2.0]  # the warm-up ran eagerly, in order


def test_a_failed_capture_runs_that_step_eagerly_once_and_gives_the_graph_up():
    runs = []

    def fn(x):
        runs.append(x.item())
        return (x + 1,)

    def capture_that_fails(fn, inputs, stream, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    g = StepGraph(warmup=2, capture=capture_that_fails)
    outs = [g(fn, torch.tensor(float(i)))[0].item() for i in range(5)]
    assert outs == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert runs == [0.0, 1.0, 2.0, 3.0, 4.0]  # no step lost, none done twice
    assert g.graph is None and "operation not permitted when stream is capturing" in g.describe()["step_graph"]


def test_an_arm_that_ends_in_its_warm_up_says_so():
    g = StepGraph(warmup=3, capture=_fake_capture)
    g(lambda x: (x,), torch.zeros(1))
    assert "warm-up" in g.describe()["step_graph"]


def test_what_the_eager_steps_left_is_handed_back_before_the_side_stream_warm_up_and_the_capture():
    events = []

    def capture(fn, inputs, stream, pool=None):
        events.append("capture")
        return _fake_capture(fn, inputs, stream)

    g = StepGraph(warmup=2, capture=capture, before_capture=lambda: events.append("release"))
    for i in range(5):
        events.append(f"call {i}")
        g(lambda x: (x + 1,), torch.tensor(float(i)))
    # before the last warm-up (the side stream's) and before the capture
    assert events == ["call 0", "call 1", "release", "call 2", "release", "capture", "call 3", "call 4"]


def test_graphs_given_one_shared_pool_capture_into_the_first_ones_pool():
    from divergence.train.stepgraph import SharedPool

    seen = []

    def capture(fn, inputs, stream, pool=None):
        seen.append(pool)
        return _fake_capture(fn, inputs, stream)

    shared = SharedPool()
    first = StepGraph(warmup=1, pure=True, capture=capture, pool=shared)
    second = StepGraph(warmup=2, capture=capture, pool=shared)
    alone = StepGraph(warmup=1, pure=True, capture=capture)
    for g in (first, second, alone):
        for i in range(3):
            g(lambda x: (x + 1,), torch.tensor(float(i)))
    assert seen == [None, first.graph.pool(), None] and shared.handle == first.graph.pool()


def test_an_arm_drops_its_gradients_before_its_step_graph_captures():
    """The last eager step's gradients would otherwise stay reserved beside the ones the capture allocates in the
    graph's pool (benchmarks/arm_memory.py measures it on a GPU)."""
    from divergence.train.module import ArmModule

    r = load_recipe("tiny")
    g = StepGraph()
    m = ArmModule(r, "sgd", build_kernels({}, {"vocab_size": 512}), 512, sink=None, step_graph=g)
    assert g.before_capture == m.release_for_capture and m.eval_graph.before_capture is not None
    assert g.pool is m.eval_graph.pool is not None  # one memory pool for the arm's two graphs
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.optimizers = lambda: opt  # what Lightning hands the module inside fit
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    m.release_for_capture()
    assert all(p.grad is None for p in m.parameters())


def test_only_arms_that_run_no_candidate_code_get_a_step_graph_on_cuda():
    h200 = load_recipe("h200")
    ref, null = build_kernels({}), build_kernels({"fused_embed_rmsnorm": "null-1"})
    zoo = build_kernels({"fused_embed_rmsnorm": "zoo:embed_bf16_accum"})
    assert isinstance(step_graph_for(h200, ArmSpec("reference", "sgd"), ref, "cuda"), StepGraph)
    assert isinstance(step_graph_for(h200, ArmSpec("null-1", "adafactor"), null, "cuda"), StepGraph)
    assert step_graph_for(h200, ArmSpec("candidate", "sgd"), zoo, "cuda") is None
    # a reference observed by the lockstep check, or a candidate under another arm's name: candidate code runs
    assert step_graph_for(h200, ArmSpec("x", "sgd", lockstep="fused_embed_rmsnorm"), ref, "cuda") is None
    assert step_graph_for(h200, ArmSpec("reference", "sgd"), zoo, "cuda") is None
    assert step_graph_for(h200, ArmSpec("reference", "sgd"), ref, "cpu") is None  # no CUDA graphs on the CPU
    off = load_recipe("h200", {"train": {"step_graph": False}})
    assert step_graph_for(off, ArmSpec("reference", "sgd"), ref, "cuda") is None
    no_graphs = load_recipe("h200", {"train": {"compile": "inductor"}})
    assert step_graph_for(no_graphs, ArmSpec("reference", "sgd"), ref, "cuda") is None


def test_the_arms_cache_never_builds_the_candidates_kernels():
    """arm_key runs in the orchestrating process, which never loads candidate code (ab/run.py): the candidate's arm
    is answered before its kernels are built (a path that does not exist would raise if it were loaded)."""
    from divergence.ab.share import arm_key

    spec = ArmSpec("candidate", "sgd", {"fused_embed_rmsnorm": "/nonexistent/candidate.py"},
                   lockstep="fused_embed_rmsnorm")
    assert arm_key(load_recipe("tiny"), spec, {}) is None


@pytest.mark.gpu
@pytest.mark.parametrize("arm,optimizer", [("null-1", "sgd"), ("null-1", "adamw"), ("null-1", "adafactor"),
                                           ("reference", "adamw")])
def test_captured_and_uncaptured_arms_write_the_same_numbers_bit_for_bit(tmp_path, tiny_corpus, arm, optimizer,
                                                                        monkeypatch):
    """With deterministic algorithms (no atomics), an arm with its step and evaluation graphs, the same arm without
    them (the same plain-inductor body) and the arm under cudagraph trees (`train.step_graph: false`) write the same
    metrics, bit for bit: the graphs replay the very kernels of the eager step. (On the h200 model, null-2 under
    AdamW for 40 steps: the same, one H200, 2026-11-26.) Without deterministic algorithms the embedding's atomics
    make every GPU run differ a little, graphs or not."""
    from divergence.train import arm as armmod

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sets = {"steps": 12, "progress": False, "compile": "inductor+cudagraphs", "device": "cuda", "val_every": 5,
            "snapshot_every": 5}
    spec = ArmSpec(arm, optimizer, {"fused_embed_rmsnorm": arm} if arm != "reference" else {})
    real = armmod.step_graph_for
    rows, infos = {}, {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for name, step_graph, capture in (("graphs", True, True), ("no-graphs", True, False),
                                           ("trees", False, False)):
            monkeypatch.setattr(armmod, "step_graph_for", real if capture else (lambda *a, **k: None))
            r = load_recipe("tiny", {"train": {**sets, "step_graph": step_graph}})
            infos[name] = run_arm(r, spec, tmp_path / name, corpus=tiny_corpus)
            assert infos[name]["status"] == "OK", infos[name].get("error")
            rows[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    finally:
        torch.use_deterministic_algorithms(False)
    assert infos["graphs"]["timings"]["step_graph"] == "captured at step 3"
    assert infos["graphs"]["timings"]["eval_graph"] == "captured at evaluation 0"
    assert "step_graph" not in infos["no-graphs"]["timings"] and "step_graph" not in infos["trees"]["timings"]
    assert len(rows["graphs"]) == 13 and sum("val_loss" in row for row in rows["graphs"]) == 4
    assert rows["graphs"] == rows["no-graphs"] == rows["trees"]


@pytest.mark.gpu
def test_a_replayed_evaluation_reads_the_weights_as_they_are_now(tiny_corpus):
    """Under autocast, as in an arm: the replay equals an eager evaluation after the weights moved (a cast cached
    at capture, or inputs copied at capture, would not)."""
    from divergence.model import build_model

    r = load_recipe("tiny")
    model = build_model(r.model, tiny_corpus.vocab_size, build_kernels({}, {"vocab_size": tiny_corpus.vocab_size}),
                        0).cuda()
    x = torch.randint(0, tiny_corpus.vocab_size, (4, r.model.seq_len), device="cuda")

    @torch.no_grad()
    def evaluation():
        return (model(x, x).double(), torch.log_softmax(model(x[:1]).float(), -1))

    def region(fn):  # one autocast region per call, as Lightning's per training step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn()

    g = StepGraph(warmup=1, pure=True, unit="evaluation")
    first = region(lambda: g(evaluation))
    assert g.graph is not None, g.off
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    replayed, eager = region(lambda: g(evaluation)), region(evaluation)
    assert not torch.equal(first[0], eager[0])  # the weights moved
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))


def test_a_body_runs_under_cudagraph_trees_exactly_where_its_arm_has_no_step_graph():
    from divergence.train.module import ArmModule

    zoo = build_kernels({"fused_embed_rmsnorm": "zoo:embed_bf16_accum"}, {"vocab_size": 512})
    ref = build_kernels({}, {"vocab_size": 512})
    for step_graph in (True, False):
        r = load_recipe("tiny", {"train": {"compile": "inductor+cudagraphs", "step_graph": step_graph}})
        # the candidate's arm never gets a step graph: its body replays under cudagraph trees either way
        assert ArmModule(r, "sgd", zoo, 512, sink=None).cudagraphs is True
        graph = StepGraph() if step_graph else None
        assert ArmModule(r, "sgd", ref, 512, sink=None, step_graph=graph).cudagraphs is (not step_graph)
    plain = load_recipe("tiny", {"train": {"compile": "inductor"}})
    assert ArmModule(plain, "sgd", zoo, 512, sink=None).cudagraphs is False


def test_a_pure_function_is_captured_right_after_its_warm_up_and_replayed_from_the_next_call():
    runs = []

    def evaluation():
        runs.append(1)
        return (torch.ones(2) * len(runs),)

    g = StepGraph(warmup=1, pure=True, capture=_fake_capture, unit="evaluation")
    first = g(evaluation)[0]
    assert g.graph is not None and g.graph.replays == 0 and g.describe()["step_graph"] == "captured at evaluation 0"
    assert first.tolist() == [1.0, 1.0]  # the eager run's own answer (the fake capture's dry run came after it)
    g(evaluation)
    g(evaluation)
    assert g.graph.replays == 2  # every later call a replay


@pytest.mark.gpu
def test_a_capture_that_syncs_is_given_up_with_its_own_reason_and_the_callers_stream_back():
    def syncing(x):
        return (x * float((x * 2).sum().item()),)  # .item() syncs: not allowed while capturing

    x = torch.ones(4, device="cuda")
    g = StepGraph(warmup=1)
    outs = [g(syncing, x)[0] for _ in range(3)]
    assert g.graph is None and "capture failed" in g.off and "previous error" not in g.off, g.off
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert all(torch.equal(o, torch.full((4,), 8.0, device="cuda")) for o in outs)
    # torch's CUDA generators left the failed capture's mode: random ops outside a graph work (they raised "Offset
    # increment outside graph capture encountered unexpectedly" in the next test, H200, 2026-11-26)
    assert torch.randn(8, device="cuda").isfinite().all()


@pytest.mark.gpu
def test_a_failed_capture_is_over_for_torchs_allocator_too():
    """Had torch's caching allocator still listed the failed capture as underway, the next empty_cache(), or any
    memory pool's end (a kernel server's staging pool, at exit), would abort the process."""
    from divergence.train.stepgraph import _cuda_capture

    x = torch.ones(4, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    with pytest.raises(Exception):
        _cuda_capture(lambda x: (x * float(x.sum().item()),), (x,), torch.cuda.Stream(), pool=pool)
    with pytest.raises(RuntimeError):  # the end was told already: a second one is refused
        torch._C._cuda_endAllocateToPool(x.device.index, pool)
    torch.cuda.empty_cache()


def test_an_evaluation_in_pieces_is_the_whole_batchs_loss_to_float_rounding():
    """The head and the loss of an evaluation, eval_rows sequences at a time (every arm alike), against the whole
    batch at once; the rest of the model sees the whole batch either way."""
    from divergence.model import build_model
    from divergence.model import transformer
    from divergence.train.module import eval_rows

    assert eval_rows(256, 65536) == 8 and eval_rows(64, 512) >= 32  # h200-shapes: 4 pieces; tiny: one
    r = load_recipe("tiny")
    model = build_model(r.model, 512, build_kernels({}, {"vocab_size": 512}), 0).eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 512, (8, 64), generator=g), torch.randint(0, 512, (8, 64), generator=g)
    seen = []
    real = transformer.call_forward_slot

    def spy(kernels, slot, *args, **kwargs):
        seen.append((slot, args[0].shape[0]))
        return real(kernels, slot, *args, **kwargs)

    seen_by_norm = []
    norm = model.final_norm.after_add

    def norm_spy(x, delta):
        seen_by_norm.append(x.shape[0])
        return norm(x, delta)

    with torch.no_grad():
        whole = model(x, y)
        assert torch.equal(model(x, y, loss_rows=8), whole)  # one piece: the same computation
        transformer.call_forward_slot, model.final_norm.after_add = spy, norm_spy
        try:
            pieces = model(x, y, loss_rows=3)  # 3 + 3 + 2 rows, weighted by rows
        finally:
            transformer.call_forward_slot = real
            del model.final_norm.after_add
    assert pieces.dtype == torch.float64 and abs(pieces.item() - whole.item()) < 1e-6 * whole.item()
    assert [n for slot, n in seen if slot == "cross_entropy"] == [3 * 64, 3 * 64, 2 * 64]
    assert seen_by_norm == [8]  # the blocks and the final norm: the whole batch, once
