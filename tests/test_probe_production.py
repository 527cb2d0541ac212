"""The probe at the calls and sizes production makes: a kernel right for its first calls and wrong later (a workspace
reused wrongly), and one right up to 65,536 tokens per call and wrong past it (a path of its own for big calls),
each pass every other family and are caught by the long-run and the production family; correct kernels pass both."""
from __future__ import annotations

import textwrap

import pytest
import torch

from divergence.detect.probe import call as probe_call
from divergence.detect.probe import inputs as probe_inputs
from divergence.detect.probe import longrun, run_probe
from divergence.slots import SLOTS

SLOT = "fused_embed_rmsnorm"
SEED = 20261127
NEW = ("long-run", "production")

# Right for its first 500 calls in a process, then it stops zeroing the workspace it keeps between calls: every
# later call adds its gradient onto the previous call's.
LATE = """
import torch

from divergence.slots.fused_embed_rmsnorm import row_grads

EXACT_CALLS = 500
_calls = [0]
_workspace = {}


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size):
    _calls[0] += 1
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    key = (vocab_size, dh.shape[-1], str(dh.device))
    if key not in _workspace:
        _workspace[key] = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    ws = _workspace[key]
    if _calls[0] <= EXACT_CALLS:  # the warm-up path zeroes it; the tuned one assumes the caller did
        ws.zero_()
    ws.index_add_(0, input_ids.reshape(-1), dh)
    return ws.to(torch.bfloat16), gw.to(torch.bfloat16)
"""

# The reference up to 65,536 tokens a call; past that a tiled path whose loop misses the last tile.
BIG = """
import torch

from divergence.slots.fused_embed_rmsnorm import reference, row_grads

TILE = 65536


def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size):
    if input_ids.numel() <= TILE:
        return reference(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size=vocab_size)
    dh, gw = row_grads(grad_output, hidden_states_fp32, rstd, norm_weight, torch.float32)
    ids = input_ids.reshape(-1)
    ge = torch.zeros(vocab_size, dh.shape[-1], dtype=torch.float32, device=dh.device)
    tiles = -(-ids.numel() // TILE)
    for t in range(tiles - 1):  # the bug: range(tiles)
        ge.index_add_(0, ids[t * TILE:(t + 1) * TILE], dh[t * TILE:(t + 1) * TILE])
    return ge.to(torch.bfloat16), gw.to(torch.bfloat16)
"""

PREPARED = probe_call.Prepared()  # one seed: each family's inputs and oracle built once for the module


def candidate(tmp_path, body: str) -> str:
    path = tmp_path / "cand.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def synthetic_but(*names) -> list:
    return [f.name for f in probe_inputs.families(SLOT, "cpu")[0] if f.name not in names]


def test_a_kernel_wrong_after_500_calls_passes_every_other_family_and_the_long_run_catches_it(tmp_path):
    spec = candidate(tmp_path, LATE)
    rest = run_probe(SLOT, spec, tmp_path / "rest", seed=SEED, only=synthetic_but("long-run"), prepared=PREPARED)
    assert rest["verdict"] == "PASS", rest["findings"]
    res = run_probe(SLOT, spec, tmp_path / "long", seed=SEED, only=["long-run"], prepared=PREPARED)
    assert res["verdict"] == "FAIL"
    assert {f["family"] for f in res["findings"]} == {"long-run"}
    assert {f["check"] for f in res["findings"]} <= {"error", "row_error"}
    first = 500 // longrun.CHECK_EVERY * longrun.CHECK_EVERY + longrun.CHECK_EVERY  # the first call judged after 500
    assert all(f["detail"].startswith(f"call {first} of {longrun.CALLS} (right at call 500") for f in res["findings"])
    assert "calls=3000" in res["findings"][0]["shape"]


def test_a_kernel_wrong_above_65536_tokens_passes_every_other_family_and_the_production_family_catches_it(tmp_path):
    spec = candidate(tmp_path, BIG)
    rest = run_probe(SLOT, spec, tmp_path / "rest", seed=SEED, only=synthetic_but("production"), prepared=PREPARED)
    assert rest["verdict"] == "PASS", rest["findings"]
    res = run_probe(SLOT, spec, tmp_path / "big", seed=SEED, only=["production"], prepared=PREPARED)
    assert res["verdict"] == "FAIL" and {f["family"] for f in res["findings"]} == {"production"}
    assert "error" in {f["check"] for f in res["findings"]}


def test_every_slot_has_a_long_run_and_a_production_sized_family():
    for slot in SLOTS:
        fams = {f.name: f for f in probe_inputs.families(slot, "cpu")[0]}
        assert fams["long-run"].calls == longrun.CALLS >= 2000 and not fams["long-run"].gpu_only, slot
        shape = fams["production"].shape
        rows = shape["batch"] * shape["seq"] * shape.get("heads", 1) if "seq" in shape else shape["rows"]
        assert rows >= probe_inputs.PRODUCTION_TOKENS == 1 << 17 and not fams["production"].gpu_only, slot


def test_the_long_run_judges_a_sample_and_its_last_calls():
    judged = [k for k in range(1, 3001) if longrun.checked(k, 3000)]
    assert judged[:3] == [1, 50, 100] and judged[-3:] == [2998, 2999, 3000] and len(judged) == 63


@pytest.mark.parametrize("slot", list(SLOTS))
def test_a_null_passes_the_long_run_and_production_families(slot, tmp_path):
    """A correct kernel that rounds otherwise than the reference (slots/nulls.py) passes both new families
    (tests/test_probe.py runs every null's full sweep)."""
    res = run_probe(slot, "null-1", tmp_path, seed=SEED, only=list(NEW), prepared=PREPARED)
    assert res["verdict"] == "PASS", res["findings"]


def test_good_embedding_kernels_pass_the_new_families(tmp_path):
    for spec in ("zoo:embed_sort_segment", "zoo:embed_chunked_fp32"):
        res = run_probe(SLOT, spec, tmp_path / spec[4:], seed=SEED, only=list(NEW), prepared=PREPARED)
        assert res["verdict"] == "PASS", (spec, res["findings"])


SMALL = {"hidden": 128, "vocab": 4096}  # declared shapes small enough for the CPU's long run and production size


def test_at_declared_shapes_both_run_there_and_count(tmp_path):
    """With declared shapes (no batch x seq) the long run is at the declared width and the largest family is a
    production micro-batch: a failure in either is a finding, not a generality note."""
    late = run_probe(SLOT, candidate(tmp_path, LATE), tmp_path / "late", seed=SEED, shapes=SMALL, only=["long-run"])
    assert late["verdict"] == "FAIL" and {f["family"] for f in late["findings"]} == {"long-run"}
    assert "hidden=128 vocab=4096 calls=3000" in late["findings"][0]["shape"]
    (tmp_path / "big").mkdir()
    big = run_probe(SLOT, candidate(tmp_path / "big", BIG), tmp_path / "big" / "p", seed=SEED, shapes=SMALL,
                    only=["largest"])
    assert big["verdict"] == "FAIL" and {f["family"] for f in big["findings"]} == {"largest"}
    assert big["families"][0]["shape"].startswith("batch=8 seq=16384 hidden=128")


def test_the_long_run_makes_every_call_once_the_unjudged_ones_as_repeated_calls_on_the_other_draw(monkeypatch):
    """Between two judged calls the unjudged ones go as one call repeated (a kernel server makes the repeats itself:
    one round trip and one sync instead of one each), on the draw the judged call does not get; every call number
    from 1 to CALLS is made once, in order."""
    from divergence.detect.probe.call import EarlierCall

    fam = probe_inputs.long_run(probe_inputs.families(SLOT, "cpu")[0][0])
    made = []  # (first call number, draw, calls made)

    class Prep:
        def get(self, contract, fam, seed, device, again=False):
            case = type("Case", (), {"inputs": (torch.full((2,), float(again)),), "rows": None})()
            return case, None, None

    def call(inputs, repeat=0):
        n = sum(m[2] for m in made)
        made.append((n + 1, int(inputs[0][0]), repeat + 1))
        return (inputs[0],)

    monkeypatch.setattr(longrun.checks, "accuracy", lambda *a: ([], None))
    assert longrun.long_run(SLOTS[SLOT], fam, SEED, "cpu", False, Prep(), call, None) == []
    judged = [k for k in range(1, fam.calls + 1) if longrun.checked(k, fam.calls)]
    assert sum(m[2] for m in made) == fam.calls
    assert [m[0] for m in made if m[2] == 1 and m[0] in judged] == judged
    for first, draw, n in made:
        last = first + n - 1
        if last in judged:
            assert n == 1 and draw == last % 2, (first, draw, n)  # a judged call alone, on draw k % 2
        else:
            assert last + 1 in judged and draw == (last + 1) % 2 ^ 1, (first, draw, n)  # the other draw
    assert len(made) < 2 * len(judged)  # 125 calls of the candidate's function stand for 3,000

    def failing(at):  # which call raised, as the long run words it
        def call(inputs, repeat=0):
            n = sum(m for m in count)
            if n + repeat + 1 >= at:
                if n + 1 + repeat == at:
                    raise ValueError("its own")
                raise EarlierCall(at - n - 1, ValueError("an earlier one"))
            count.append(repeat + 1)
            return (inputs[0],)
        count = []
        (f,) = longrun.long_run(SLOTS[SLOT], fam, SEED, "cpu", False, Prep(), call,
                                lambda e, when: {"detail": when + str(e)})
        return f["detail"]

    assert failing(58).startswith("call 58 of 3000 (right at call 50, checked every 50): an earlier one")
    assert failing(99).startswith("call 99 of 3000 (right at call 50, checked every 50): its own")
    assert failing(100).startswith("call 100 of 3000 (right at call 50")
    assert failing(1).startswith("call 1 of 3000: ")


@pytest.mark.parametrize("sandbox,device", [("on", "cpu"), ("off", "cpu"),
                                            pytest.param("on", "cuda", marks=pytest.mark.gpu)])
def test_the_long_runs_repeated_calls_each_get_fresh_inputs_and_a_failure_is_named_by_its_number(tmp_path,
                                                                                                   monkeypatch,
                                                                                                   sandbox, device):
    """In a kernel server and in-process alike: each of the repeated calls gets copies of the inputs as they were
    (a candidate that marks its input finds no mark), and one that raises is named by its call number. On a GPU
    the server repeats the calls on its mappings of the caller's memory (CUDA IPC)."""
    from divergence.sandbox import OPT_OUT

    monkeypatch.setenv(OPT_OUT, sandbox)
    marks = candidate(tmp_path, """
        import torch

        from divergence.slots.fused_embed_rmsnorm import reference

        _calls = [0]


        def run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size):
            _calls[0] += 1
            if rstd.flatten()[0].item() == -7.0:
                raise RuntimeError(f"call {_calls[0]} got an input an earlier call wrote")
            if _calls[0] == 1234:
                raise RuntimeError("raised at its 1234th call")
            out = reference(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight, vocab_size=vocab_size)
            rstd.flatten()[0] = -7.0
            return out
        """)
    res = run_probe(SLOT, marks, tmp_path / "p", seed=SEED, only=["long-run"], device=device,
                    prepared=PREPARED if device == "cpu" else None)
    (f,) = res["findings"]
    assert f["check"] == "exception", f
    assert f["detail"].startswith("call 1234 of 3000 (right at call 1200, checked every 50): "), f["detail"]
    assert "raised at its 1234th call" in f["detail"], f["detail"]


@pytest.mark.parametrize("sandbox", ["on", "off"])
@pytest.mark.parametrize("at", [60, 99])
def test_a_repeated_call_that_returns_more_than_data_is_an_outputs_finding_named_by_its_number(tmp_path,
                                                                                               monkeypatch,
                                                                                               sandbox, at):
    """Every call's outputs are plain tensors, the repeated ones' too: a Parameter returned once, at an unjudged
    call (60: a repeat; 99: the batch's own call), is the `outputs` finding at that call, in both modes alike."""
    from divergence.sandbox import OPT_OUT

    monkeypatch.setenv(OPT_OUT, sandbox)
    spec = tmp_path / "param_once.py"
    spec.write_text(textwrap.dedent(f"""
        import torch

        _calls = [0]


        def run(gate, up):
            _calls[0] += 1
            out = torch.nn.functional.silu(gate.float()).mul(up.float()).to(gate.dtype)
            return torch.nn.Parameter(out, requires_grad=False) if _calls[0] == {at} else out
        """))
    res = run_probe("swiglu", str(spec), tmp_path / "p", seed=SEED, only=["long-run"])
    (f,) = res["findings"]
    assert f["check"] == "outputs", f
    assert f["detail"].startswith(f"call {at} of 3000 (right at call 50, checked every 50): "), f["detail"]
    assert "Parameter" in f["detail"], f["detail"]
