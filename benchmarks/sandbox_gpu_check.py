"""Which of the kernel server's confinements leave CUDA working on this machine: each variant in a fresh process
(capabilities dropped, Landlock, both), a CUDA op and an IPC import of a tensor the parent exported; then one
KernelServer call end to end. Prints one JSON line per variant. GPU only.

    python benchmarks/sandbox_gpu_check.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SERVER = Path(__file__).resolve().parent.parent / "divergence" / "sandbox" / "kernel_server.py"
CHILD = r"""
import importlib.util, json, sys, tempfile
spec = importlib.util.spec_from_file_location("ks", sys.argv[1]); ks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ks)
variant, handle = sys.argv[2], json.loads(sys.argv[3])
got = {"variant": variant}
scratch = tempfile.mkdtemp()
if "caps" in variant:
    got["caps"] = ks.drop_capabilities()
if "init-first" in variant:  # CUDA initialised before Landlock: what the server does on a GPU machine
    import torch
    torch.ones(1, device="cuda"); torch.cuda.synchronize()
if "landlock" in variant:
    got.update({k: str(v) for k, v in ks.confine(scratch, scratch).items()})
import torch
try:
    x = torch.ones(1024, device="cuda"); torch.cuda.synchronize(); got["cuda_op"] = float(x.sum())
except Exception as e:
    got["cuda_op"] = repr(e)[:200]
try:
    st = torch.UntypedStorage._new_shared_cuda(handle["device"], bytes.fromhex(handle["handle"]), handle["size"],
        handle["offset"], bytes.fromhex(handle["ref"]), handle["ref_off"], bytes.fromhex(handle["ev"]), handle["evsync"])
    t = torch.empty(0, device="cuda", dtype=torch.float32).set_(st, handle["offset_el"], (16,))
    got["ipc"] = float(t.sum())
except Exception as e:
    got["ipc"] = repr(e)[:200]
print(json.dumps(got))
"""


def main():
    src = torch.arange(16, dtype=torch.float32, device="cuda")
    st = src.untyped_storage()
    dev, h, size, off, ref, ref_off, ev, evsync = st._share_cuda_()
    handle = {"device": dev, "handle": h.hex(), "size": size, "offset": off, "ref": ref.hex(), "ref_off": ref_off,
              "ev": ev.hex(), "evsync": evsync, "offset_el": src.storage_offset()}
    for variant in ("plain", "caps", "landlock", "init-first+landlock"):
        p = subprocess.run([sys.executable, "-c", CHILD, str(SERVER), variant, json.dumps(handle)],
                           capture_output=True, text=True, timeout=120)
        print(p.stdout.strip() or json.dumps({"variant": variant, "rc": p.returncode, "err": p.stderr[-400:]}),
              flush=True)
    from divergence.sandbox.client import KernelServer  # noqa: F401
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from divergence.candidates.loader import load_candidate

    with tempfile.TemporaryDirectory() as d:
        k = Path(d) / "k.py"
        k.write_text("import torch\ndef run(x, weight, eps):\n    xf = x.float()\n"
                     "    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)\n")
        try:
            impl = load_candidate("rmsnorm", str(k))
            x, w = torch.randn(8, 64, device="cuda"), torch.ones(64, device="cuda")
            y = impl.fn(x, w, 1e-6)
            print(json.dumps({"variant": "KernelServer", "ok": bool(torch.isfinite(y).all()),
                              "meta": {k: str(v) for k, v in impl.meta.items() if k != "doc"}}), flush=True)
        except Exception as e:
            print(json.dumps({"variant": "KernelServer", "error": repr(e)[:400]}), flush=True)


if __name__ == "__main__":
    main()
