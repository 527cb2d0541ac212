"""The import guard accuses the candidate only: torch's own lazy set-up (importing dynamo wraps
`torch.manual_seed`) and a candidate configuring its own compiler load; a candidate's own patch is refused even
after dynamo's; process-wide numerics settings made at import are named, not refused.

Each fixture loads in a fresh interpreter: torch wraps `torch.manual_seed` once per process, so a process that
had imported dynamo already (pytest's, after any compile) would hide the very case under test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "compiled"
LOAD = """
import json, sys, torch
assert "torch._dynamo" not in sys.modules  # the case under test: dynamo first imported by the candidate
from divergence.candidates.loader import load_candidate
from divergence.errors import CandidateError
try:
    impl = load_candidate("fused_embed_rmsnorm", sys.argv[1])
    print(json.dumps({"ok": True, "settings": impl.meta.get("settings", []),
                      "precision": torch.get_float32_matmul_precision(), "seeded": torch.initial_seed()}))
except CandidateError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""


@pytest.fixture(scope="module")
def loaded():
    names = ["compile_default", "compile_reduce_overhead", "dynamo_config", "triton_compiled_wrapper",
             "settings_at_import", "patches_seed"]

    def one(name):
        env = {**os.environ, "TRITON_INTERPRET": "1"}  # the Triton fixture loads on a CPU machine too
        p = subprocess.run([sys.executable, "-c", LOAD, str(FIXTURES / f"{name}.py")], capture_output=True, text=True,
                           timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        return name, json.loads(p.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, names))


@pytest.mark.parametrize("name", ["compile_default", "compile_reduce_overhead", "dynamo_config",
                                  "triton_compiled_wrapper"])
def test_module_level_compile_and_compiler_config_load(loaded, name):
    assert loaded[name] == {"ok": True, "settings": [], "precision": "highest", "seeded": loaded[name]["seeded"]}


def test_a_candidates_own_patch_is_refused_after_torchs(loaded):
    got = loaded["patches_seed"]
    assert not got["ok"] and "patches torch.manual_seed at import" in got["error"] and "refused" in got["error"]


def test_process_wide_settings_at_import_are_named_and_the_generator_put_back(loaded):
    got = loaded["settings_at_import"]
    assert got["ok"] and got["precision"] == "medium"  # left in place: the candidate's arm trains under it
    assert got["seeded"] != 1234  # the generator put back
    said = got["settings"][0]  # then the TF32 flag that precision implies
    assert said.startswith("sets float32 matmul precision highest -> medium at import: a process-wide setting")
    assert any(s.startswith("sets cuda matmul fp16 accumulation False -> True at import: a process-wide setting "
                            "that changes every other op in its process") for s in got["settings"]), got["settings"]


def test_the_blas_library_is_read_and_put_back():
    import torch

    from divergence.candidates import globalstate

    before = globalstate.snapshot()
    assert before["BLAS library"] in ("cublas", "cublaslt", "ck", "default")
    try:
        torch.backends.cuda.preferred_blas_library("ck")
        said = globalstate.put_back(before)
    finally:
        globalstate.restore(before, ["BLAS library"])
    assert said is not None and f"BLAS library {before['BLAS library']} -> ck" in said, said
    assert globalstate.snapshot()["BLAS library"] == before["BLAS library"]


def test_torch_own_tells_a_torch_wrapper_from_a_candidates():
    import functools

    import torch

    from divergence.candidates.guard import torch_own

    def mine(seed):
        return seed

    assert torch_own(mine, torch._disable_dynamo(mine))  # torch's wrapper, torch's file
    assert not torch_own(mine, functools.wraps(mine)(lambda s: s))  # a wrapper in another file
    assert not torch_own(torch.manual_seed, torch._disable_dynamo(mine))  # torch's wrapper around something else


@pytest.mark.parametrize("line", ["    _k[grid](x, n, BLOCK=128, waves_per_eu=2)",
                                  "CONFIGS = [triton.Config({'BLOCK': 64, 'matrix_instr_nonkdim': 16}, num_warps=4)]",
                                  "    _k[grid](x, n, kpack = 2)"])
def test_a_triton_kernel_written_for_amd_is_one_line_naming_the_option(tmp_path, line):
    from divergence.candidates.loader import load_candidate
    from divergence.errors import CandidateError

    p = tmp_path / "amd.py"
    p.write_text("import triton\n\n\ndef run(grad_output, input_ids, hidden_states_fp32, rstd, norm_weight):\n"
                 f"{line if line.startswith(' ') else '    pass'}\n\n{'' if line.startswith(' ') else line}\n")
    with pytest.raises(CandidateError) as e:
        load_candidate("fused_embed_rmsnorm", str(p))
    opt = next(o for o in ("waves_per_eu", "matrix_instr_nonkdim", "kpack") if o in line)
    assert f"written for AMD GPUs: the Triton option {opt} (line" in str(e.value) and "\n" not in str(e.value)


def test_amd_option_names_elsewhere_are_not_refused(tmp_path):
    from divergence.candidates.loader import load_candidate

    p = tmp_path / "ok.py"
    p.write_text("from divergence.slots.fused_embed_rmsnorm import reference as run\n"
                 "# triton would take waves_per_eu=2 on AMD\nkpack_count = 2\nif kpack_count == 2:\n    pass\n")
    assert load_candidate("fused_embed_rmsnorm", str(p)).name == "ok"
