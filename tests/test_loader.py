"""The candidate loader: every spec form, both calling conventions, and a clear one-line error for each bad form."""
from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest
import torch

from divergence.candidates.loader import load_candidate
from divergence.errors import CandidateError
from divergence.candidates.resolve import resolve
from divergence.slots import fused_embed_rmsnorm, rmsnorm
from divergence.slots.registry import sha256_of

CUDA = torch.cuda.is_available()
EMBED_INPUTS = "grad_output, input_ids, hidden_states_fp32, rstd, norm_weight"
EMBED_OUTPUTS = "grad_embed_weight, grad_norm_weight"


def write(tmp_path, name, body):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(body))
    return p


def embed_inputs(vocab=64, hidden=16):
    return fused_embed_rmsnorm.make_inputs(torch.Generator().manual_seed(0), batch=2, seq=32, hidden=hidden,
                                           vocab=vocab)


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------- conventions


def test_returning_python_file(tmp_path):
    p = write(tmp_path, "my_norm.py", '''
        """A plain rmsnorm."""
        import torch

        def run(x, weight, eps):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        ''')
    impl = load_candidate("rmsnorm", str(p))
    assert (impl.slot, impl.name, impl.role, impl.origin) == ("rmsnorm", "my_norm", "candidate", str(p))
    assert impl.sha256 == sha256_of([p])
    assert impl.meta == {"doc": "A plain rmsnorm.", "convention": "returning"}
    x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(0))
    out = impl.fn(x, w, eps)
    assert isinstance(out, torch.Tensor)  # one-output slots return a tensor, like the reference
    assert torch.equal(out, rmsnorm.reference(x, w, eps))


def test_destination_passing_outputs_start_as_nan(tmp_path):
    """Unwritten elements stay visible: the adapter pre-fills destinations with NaN."""
    p = write(tmp_path, "half.py", f'''
        def run({EMBED_INPUTS}, {EMBED_OUTPUTS}):
            grad_embed_weight[: grad_embed_weight.shape[0] // 2] = 0
            grad_norm_weight.zero_()
        ''')
    impl = load_candidate("fused_embed_rmsnorm", str(p))
    assert impl.meta["convention"] == "destination"
    ge, gw = impl.fn(*embed_inputs(vocab=64, hidden=16), vocab_size=64)
    assert ge.shape == (64, 16) and ge.dtype == torch.bfloat16 and gw.shape == (16,)
    assert ge[32:].isnan().all() and not ge[:32].isnan().any() and not gw.isnan().any()


def test_context_is_passed_only_to_a_run_that_names_it(tmp_path):
    p = write(tmp_path, "with_vocab.py", f'''
        import torch
        def run({EMBED_INPUTS}, vocab_size=65536):
            h = grad_output.shape[-1]
            return (torch.zeros(vocab_size, h, dtype=torch.bfloat16), torch.zeros(h, dtype=torch.bfloat16))
        ''')
    ge, _ = load_candidate("fused_embed_rmsnorm", str(p)).fn(*embed_inputs(), vocab_size=64)
    assert ge.shape[0] == 64


def test_returning_candidate_with_a_hardcoded_vocabulary_is_a_clear_error(tmp_path):
    p = write(tmp_path, "sol_style.py", f'''
        import torch
        VOCAB = 65536  # hard-coded, as real SOL-ExecBench submissions do
        def run({EMBED_INPUTS}):
            h = grad_output.shape[-1]
            return (torch.zeros(VOCAB, h, dtype=torch.bfloat16), torch.zeros(h, dtype=torch.bfloat16))
        ''')
    impl = load_candidate("fused_embed_rmsnorm", str(p))
    with pytest.raises(CandidateError) as e:
        impl.fn(*embed_inputs(), vocab_size=64)
    msg = one_line(e)
    assert "grad_embed_weight has shape (65536, 16), expected (64, 16)" in msg and "vocab_size is 64" in msg


def test_returning_candidate_with_the_wrong_dtype_is_a_clear_error(tmp_path):
    p = write(tmp_path, "fp32_out.py", '''
        def run(x, weight, eps):
            return x.double()
        ''')
    with pytest.raises(CandidateError, match="output y has dtype torch.float64, expected torch.float32"):
        load_candidate("rmsnorm", str(p)).fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))


def test_a_candidate_that_raises_is_one_line_naming_it(tmp_path):
    p = write(tmp_path, "boom.py", '''
        def run(x, weight, eps):
            raise RuntimeError("kernel launch failed: too many resources requested\\nsecond line")
        ''')
    with pytest.raises(CandidateError) as e:
        load_candidate("rmsnorm", str(p)).fn(*rmsnorm.make_inputs(torch.Generator().manual_seed(0)))
    assert one_line(e) == "rmsnorm: candidate boom failed: RuntimeError: kernel launch failed: too many resources requested"


def test_same_file_name_in_two_folders_does_not_clash(tmp_path):
    a = write(tmp_path, "a/kernel.py", "def run(gate, up):\n    return gate\n")
    b = write(tmp_path, "b/kernel.py", "def run(gate, up):\n    return up\n")
    ia, ib = load_candidate("swiglu", str(a)), load_candidate("swiglu", str(b))
    gate, up = torch.zeros(4, 8), torch.ones(4, 8)
    assert torch.equal(ia.fn(gate, up), gate) and torch.equal(ib.fn(gate, up), up)
    assert ia.sha256 != ib.sha256


def test_sibling_modules_of_a_candidate_import(tmp_path):
    write(tmp_path, "pkg/helpers.py", "def silu_mul(g, u):\n    return (g.float() * g.float().sigmoid() * u.float()).to(g.dtype)\n")
    p = write(tmp_path, "pkg/kernel.py", "from helpers import silu_mul\ndef run(gate, up):\n    return silu_mul(gate, up)\n")
    assert load_candidate("swiglu", str(p)).meta["convention"] == "returning"


def test_module_function_form(tmp_path, monkeypatch):
    write(tmp_path, "mykernels/__init__.py", "")
    write(tmp_path, "mykernels/act.py", '''
        """SwiGLU, another association."""
        import torch
        def swiglu(gate, up):
            g = gate.float()
            return (up.float() * g * torch.sigmoid(g)).to(gate.dtype)
        ''')
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = load_candidate("swiglu", "mykernels.act:swiglu")
    assert (impl.name, impl.origin, impl.meta["convention"]) == ("mykernels.act:swiglu", "mykernels.act:swiglu", "returning")
    assert impl.sha256 == sha256_of([tmp_path / "mykernels" / "act.py"])
    with pytest.raises(CandidateError, match="cannot import module 'nokernels.act'"):
        load_candidate("swiglu", "nokernels.act:swiglu")
    with pytest.raises(CandidateError, match="defines no function `geglu`"):
        load_candidate("swiglu", "mykernels.act:geglu")


def test_resolve_goes_through_the_loader():
    impl = resolve("fused_embed_rmsnorm", "zoo:embed_bf16_accum")
    assert impl.role == "candidate" and impl.name == "embed_bf16_accum"
    assert resolve("rmsnorm", None).role == "reference"


# -------------------------------------------------------------------------------------------- signature errors


@pytest.mark.parametrize("params, expect", [
    ("x, weight", r"missing parameter\(s\) eps; expected the returning convention run\(x, weight, eps\)"),
    ("x, w, eps", r"missing parameter\(s\) weight; extra parameter\(s\) without defaults w"),
    ("x, weight, eps, block", r"extra parameter\(s\) without defaults block"),
    ("weight, x, eps", r"parameters in the wrong order"),
    ("x, weight, eps, y, z", r"destination-passing convention run\(x, weight, eps, y\)"),
])
def test_wrong_signature_names_the_parameter(tmp_path, params, expect):
    p = write(tmp_path, "bad_sig.py", f"def run({params}):\n    pass\n")
    with pytest.raises(CandidateError, match=expect) as e:
        load_candidate("rmsnorm", str(p))
    msg = one_line(e)
    assert str(p) in msg and f"run({params})" in msg and "slot rmsnorm" in msg


def test_extra_parameters_with_defaults_and_kwargs_are_allowed(tmp_path):
    p = write(tmp_path, "ok_sig.py", "def run(x, weight, eps, block=128, **kwargs):\n    return x\n")
    assert load_candidate("rmsnorm", str(p)).meta["convention"] == "returning"


def test_star_args_are_refused(tmp_path):
    p = write(tmp_path, "star.py", "def run(*args):\n    pass\n")
    with pytest.raises(CandidateError, match=r"run\(\*args\) hides its parameters"):
        load_candidate("rmsnorm", str(p))


def test_destination_passing_missing_an_output_is_named(tmp_path):
    p = write(tmp_path, "dps.py", f"def run({EMBED_INPUTS}, grad_embed_weight):\n    pass\n")
    with pytest.raises(CandidateError, match=r"missing parameter\(s\) grad_norm_weight; expected the "
                                             r"destination-passing convention"):
        load_candidate("fused_embed_rmsnorm", str(p))


# ------------------------------------------------------------------------------------------------ load errors


def test_missing_file(tmp_path):
    with pytest.raises(CandidateError, match="candidate file not found: .*nowhere.py"):
        load_candidate("rmsnorm", str(tmp_path / "nowhere.py"))


def test_syntax_error_names_file_and_line(tmp_path):
    p = write(tmp_path, "broken.py", "import torch\n\ndef run(x, weight, eps)\n    return x\n")
    with pytest.raises(CandidateError, match=r"broken.py: syntax error at line 3") as e:
        load_candidate("rmsnorm", str(p))
    one_line(e)


def test_exception_at_import(tmp_path):
    p = write(tmp_path, "raises.py", "raise ValueError('HIDDEN must be 4096')\n")
    with pytest.raises(CandidateError, match=r"raises.py: import failed: ValueError: HIDDEN must be 4096"):
        load_candidate("rmsnorm", str(p))


def test_missing_import(tmp_path):
    p = write(tmp_path, "needs.py", "import flash_attn_nonexistent\n")
    with pytest.raises(CandidateError, match=r"needs.py: import failed: ModuleNotFoundError: No module named"):
        load_candidate("rmsnorm", str(p))


@pytest.mark.parametrize("body", ["def kernel(x, weight, eps):\n    return x\n", "run = 3\n"])
def test_no_run_function(tmp_path, body):
    p = write(tmp_path, "norun.py", body)
    with pytest.raises(CandidateError, match=r"norun.py: defines no function `run`"):
        load_candidate("rmsnorm", str(p))


@pytest.mark.skipif(CUDA, reason="on a GPU the source would compile")
def test_cuda_source_on_cpu(tmp_path):
    p = write(tmp_path, "k.cu", "// a kernel\n#include <torch/extension.h>\n")
    with pytest.raises(CandidateError, match=r"k.cu: CUDA source needs a GPU"):
        load_candidate("rmsnorm", str(p))


@pytest.mark.skipif(CUDA, reason="on a GPU Triton can launch")
def test_triton_kernel_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = write(tmp_path, "tk.py", '''
        import triton
        import triton.language as tl

        @triton.jit
        def _k(x_ptr):
            pass

        def run(x, weight, eps):
            _k[(1,)](x)
            return x
        ''')
    with pytest.raises(CandidateError, match=r"tk.py: .*Triton kernels? needs? a GPU") as e:
        load_candidate("rmsnorm", str(p))
    one_line(e)
    if importlib.util.find_spec("triton") is not None:
        return  # Triton is installed here: the check above already went through the import-then-refuse path
    # where Triton imports but there is no GPU (a CPU machine with triton installed), the same one line
    write(tmp_path, "fake/triton/__init__.py", """
        class JITFunction:
            def __init__(self, fn):
                self.fn = fn
        def jit(fn):
            return JITFunction(fn)
        """)
    write(tmp_path, "fake/triton/language.py", "")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    try:
        with pytest.raises(CandidateError, match=r"tk.py: a Triton kernel needs a GPU \(no CUDA device here; "
                                                 r"TRITON_INTERPRET=1 runs it slowly on the CPU\)"):
            load_candidate("rmsnorm", str(p))
    finally:  # leave no fake triton behind for other tests
        for k in [k for k in sys.modules if k.split(".")[0] == "triton"]:
            del sys.modules[k]


def test_unknown_forms():
    with pytest.raises(CandidateError, match="unknown zoo member 'nope'; known: .*embed_bf16_accum"):
        load_candidate("fused_embed_rmsnorm", "zoo:nope")
    with pytest.raises(CandidateError, match="zoo:softcap_omitted is a candidate for slot attn_softcap, not rope"):
        load_candidate("rope", "zoo:softcap_omitted")
    with pytest.raises(CandidateError, match="cannot tell what candidate 'what' is"):
        load_candidate("rope", "what")
    with pytest.raises(CandidateError, match="unknown slot 'conv'"):
        load_candidate("conv", "zoo:softcap_omitted")


# ------------------------------------------------------------------------------------------- solution.json


DPS_SOURCE = f'''
import torch

def run({EMBED_INPUTS}, {EMBED_OUTPUTS}):
    h = hidden_states_fp32.shape[-1]
    go, x, r = grad_output.float().reshape(-1, h), hidden_states_fp32.reshape(-1, h), rstd.reshape(-1, 1)
    g = go * norm_weight.float()
    dh = r * (g - x * r * r * (g * x).mean(-1, keepdim=True))
    acc = torch.zeros(grad_embed_weight.shape, dtype=torch.float32)
    acc.index_add_(0, input_ids.reshape(-1), dh)
    grad_embed_weight.copy_(acc)
    grad_norm_weight.copy_((go * x * r).sum(0))
'''


def solution(tmp_path, spec=None, sources=None, **top):
    sol = {"name": "embed_fp32_python", "definition": "embedding_with_initial_layernorm_backward", "author": "test",
           "spec": {"language": "python", "target_hardware": ["LOCAL"], "entry_point": "main.py::run",
                    "destination_passing_style": True, **(spec or {})},
           "sources": sources if sources is not None else [{"path": "main.py", "content": DPS_SOURCE}], **top}
    p = tmp_path / "solution.json"
    p.write_text(json.dumps(sol))
    return p


def test_solution_json_destination_passing(tmp_path):
    p = solution(tmp_path)
    impl = load_candidate("fused_embed_rmsnorm", str(p))
    assert (impl.name, impl.origin, impl.sha256) == ("embed_fp32_python", str(p), sha256_of([p]))
    assert impl.meta["convention"] == "destination"
    inputs = embed_inputs()
    ge, gw = impl.fn(*inputs, vocab_size=64)
    ref = fused_embed_rmsnorm.reference(*inputs, vocab_size=64)
    assert torch.equal(ge, ref[0]) and torch.allclose(gw.float(), ref[1].float(), rtol=1e-2, atol=1e-5)


def test_solution_json_declared_convention_must_match(tmp_path):
    p = solution(tmp_path, spec={"destination_passing_style": False})
    with pytest.raises(CandidateError, match=r"expected the returning convention run\(grad_output, .*norm_weight\)"):
        load_candidate("fused_embed_rmsnorm", str(p))


@pytest.mark.parametrize("mutate, expect", [
    (lambda p: p.write_text("{not json"), r"not valid JSON \(line 1, column 2"),
    (lambda p: p.write_text("[]"), r"a solution must be a JSON object"),
    (lambda p: _edit(p, lambda s: s.pop("spec")), r"`spec` is missing"),
    (lambda p: _edit(p, lambda s: s["spec"].pop("entry_point")), r"spec.entry_point must be \"file::function\""),
    (lambda p: _edit(p, lambda s: s["spec"].update(entry_point="main.py:run")), r"spec.entry_point must be"),
    (lambda p: _edit(p, lambda s: s.update(sources=[])), r"`sources` must be a non-empty list"),
    (lambda p: _edit(p, lambda s: s["sources"][0].pop("content")), r"sources\[0\] must be an object with"),
    (lambda p: _edit(p, lambda s: s["sources"][0].update(path="../main.py")), r"must be relative, without '..'"),
    (lambda p: _edit(p, lambda s: s["spec"].update(entry_point="kernel.py::run")),
     r"entry file 'kernel.py' of spec.entry_point is not among `sources` \(main.py\)"),
    (lambda p: _edit(p, lambda s: s["spec"].update(entry_point="main.py::launch")), r"defines no function `launch`"),
    (lambda p: _edit(p, lambda s: s["spec"].update(language="rust")),
     r"spec.language: unknown language 'rust'; known: python, pytorch"),
    (lambda p: _edit(p, lambda s: s["spec"].update(destination_passing_style="yes")),
     r"destination_passing_style must be true or false"),
])
def test_malformed_solution_json(tmp_path, mutate, expect):
    p = solution(tmp_path)
    mutate(p)
    with pytest.raises(CandidateError, match=expect) as e:
        load_candidate("fused_embed_rmsnorm", str(p))
    assert one_line(e).startswith(str(p))


def _edit(p, fn):
    sol = json.loads(p.read_text())
    fn(sol)
    p.write_text(json.dumps(sol))


def test_missing_solution_json(tmp_path):
    with pytest.raises(CandidateError, match="candidate file not found"):
        load_candidate("fused_embed_rmsnorm", str(tmp_path / "solution.json"))


@pytest.mark.skipif(CUDA, reason="on a GPU the source would compile")
def test_cuda_solution_json_on_cpu(tmp_path):
    p = solution(tmp_path, spec={"language": "cuda", "entry_point": "kernel.cu::run", "binding": "torch"},
                 sources=[{"path": "kernel.cu", "content": "#include <torch/extension.h>\n"}])
    with pytest.raises(CandidateError, match="CUDA source needs a GPU"):
        load_candidate("fused_embed_rmsnorm", str(p))


# ------------------------------------------------------------------------------------------------------- GPU


CUDA_RMSNORM = r'''
// rmsnorm, one block per row, fp32 math (returning convention)
#include <torch/extension.h>

__global__ void rms_kernel(const float* x, const float* w, float* y, int h, float eps) {
    const float* xr = x + blockIdx.x * h;
    float* yr = y + blockIdx.x * h;
    __shared__ float ss;
    if (threadIdx.x == 0) { float s = 0.f; for (int i = 0; i < h; ++i) s += xr[i] * xr[i]; ss = rsqrtf(s / h + eps); }
    __syncthreads();
    for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = xr[i] * ss * w[i];
}

torch::Tensor run(torch::Tensor x, torch::Tensor weight, double eps) {
    auto y = torch::empty_like(x);
    int h = x.size(-1), rows = x.numel() / h;
    rms_kernel<<<rows, 128>>>(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), h, (float)eps);
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, py::arg("x"), py::arg("weight"), py::arg("eps")); }
'''


@pytest.mark.gpu
@pytest.mark.slow  # about 2 minutes of nvcc on an H200 machine
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_source_compiles_and_runs(tmp_path):
    p = write(tmp_path, "rms.cu", CUDA_RMSNORM)
    impl = load_candidate("rmsnorm", str(p))
    assert impl.meta["convention"] == "returning" and impl.meta["doc"].startswith("rmsnorm, one block per row")
    x, w, eps = rmsnorm.make_inputs(torch.Generator().manual_seed(0), device="cuda")
    assert torch.allclose(impl.fn(x, w, eps), rmsnorm.reference(x, w, eps), rtol=1e-5, atol=1e-5)
    bad = write(tmp_path, "rms_bad.cu", CUDA_RMSNORM.replace('py::arg("eps")', 'py::arg("epsilon")'))
    with pytest.raises(CandidateError, match=r"missing parameter\(s\) eps"):
        load_candidate("rmsnorm", str(bad))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_bf16_index_add_on_cuda_rounds_per_add():
    """The premise of embed_bf16_accum on CUDA: index_add_ into bf16 rounds on every atomic add."""
    n = 32768
    src = torch.full((n, 1), 1e-3, device="cuda")
    acc = torch.zeros(1, 1, device="cuda", dtype=torch.bfloat16)
    acc.index_add_(0, torch.zeros(n, dtype=torch.long, device="cuda"), src.bfloat16())
    assert abs(acc.item() - n * 1e-3) / (n * 1e-3) > 0.1  # measured on an H200: 0.5 instead of 32.768


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_embed_bf16_accum_stays_bad_on_cuda_in_deterministic_mode():
    """Under use_deterministic_algorithms, CUDA's index_add_ into bf16 sums exactly (32.75 for the sum above): the
    zoo kernel then rounds per occurrence itself, so it stays the bug it models."""
    impl = load_candidate("fused_embed_rmsnorm", "zoo:embed_bf16_accum")
    ids = torch.zeros(4, 256, dtype=torch.long)  # one row, 1024 contributions
    inputs = [x.cuda() for x in fused_embed_rmsnorm.make_inputs(torch.Generator().manual_seed(0), batch=4, seq=256,
                                                                  hidden=16, vocab=8, ids=ids)]
    orc = fused_embed_rmsnorm.oracle(*inputs, vocab_size=8)[0]
    errs = []
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        try:
            out = impl.fn(*inputs, vocab_size=8)[0]
        finally:
            torch.use_deterministic_algorithms(False)
        errs.append(((out.double() - orc).norm() / orc.norm()).item())
    ref = fused_embed_rmsnorm.reference(*inputs, vocab_size=8)[0]
    ref_err = ((ref.double() - orc).norm() / orc.norm()).item()
    assert min(errs) > 4 * ref_err, (errs, ref_err)


def test_a_solutions_sources_are_never_seen_half_written(tmp_path):
    """The arms of one A/B load the same solution at once, into one folder: a reader must only ever see a whole
    file (a truncated kernel.py was imported as a module without `run`, failing a correct kernel's arm)."""
    import threading

    from divergence.candidates.loader import _materialise

    target = tmp_path / "kernel.py"
    versions = ["# a\n" + "x = 1\n" * 40_000, "# b\n" + "y = 2\n" * 40_000]
    _materialise(target, versions[0])
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            seen.add(len(target.read_text()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            _materialise(target, versions[i % 2])
    finally:
        stop.set()
        reader.join()
    assert seen <= {len(v) for v in versions}, sorted(seen)[:5]
    inode = target.stat().st_ino
    _materialise(target, versions[1])  # already there: left as it is
    assert target.stat().st_ino == inode and target.read_text() == versions[1]
