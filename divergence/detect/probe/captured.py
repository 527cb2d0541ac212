"""Captured families: every slot's live inputs from a short reference training run of a recipe's model, at a few
steps spread over training. Synthetic families feed what a contract's author imagined; these feed what
training feeds: upstream gradients that shrink as the loss falls, activations with the model's own outliers, the
training precision's dtypes.

The run is an arm: `train.arm.run_arm` with the reference in every slot and a watcher (`Capture`, passed as
run_arm's `watcher`, which builds it from `ArmSpec.lockstep` exactly as the A/B builds its lockstep check) that taps
every slot through `Kernels.add_tap`, as the lockstep check taps one. So the inputs come through the same model,
data, optimizer and autograd bridges as an A/B arm's; only `train.compile` is off (a tap on every slot would cut
the compiled graph at each of them; eager runs the same ops, rounding aside) and the run stops at MAX_STEPS.

At each capture step the first and the last call of the step are kept (one rmsnorm call per norm: the first layer's
and the final norm differ in scale), subsampled to at most MAX_ELEMENTS per tensor, on the CPU. They are cached
under the data cache (`<data.cache_dir>/captures/`), keyed by the recipe, the slot, the device and a hash of the
code that produces them, and written atomically: the second probe of a slot costs no training.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl  # (POSIX only, as gpu.py's locks)
import hashlib
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from ...errors import one_line
from ...names import SLOT_MODEL
from ...slots import SLOTS
from .inputs import Case, Family, frequent_rows

FORMAT = 1  # bump when the file layout changes
MAX_STEPS = 300  # a capture run stops here: the issue's "captured step 300"; the recipes' loss has fallen by then
EARLY = (1, 10)  # early steps captured besides the first and the last
MAX_ELEMENTS = 1 << 17  # per captured tensor (512 KiB in fp32): 8 records of a slot stay within a few MB
# The recipe a probe captures from when it is given none: every slot is called (a cap of 20 as in h200-softcap,
# so the softcap slot sees live scores too). CPU: the test recipe's shapes, 40 steps (~10 s on 2 busy cores).
DEFAULT_RECIPE = {"cpu": ("tiny", {"model": {"attn_softcap": 20.0}}), "cuda": ("h200-softcap", None)}
# The inputs that run over tokens (their leading axis is subsampled together); the rest (weights, inv_freq,
# scalars) are kept whole.
BATCHED = {
    "fused_embed_rmsnorm": ("grad_output", "input_ids", "hidden_states_fp32", "rstd"),
    "rmsnorm": ("x",),
    "rmsnorm_backward": ("grad_output", "x"),
    "add_rmsnorm": ("hidden_states", "residual"),
    "qkv_proj": ("hidden_states",),
    "rope": ("q", "k", "position_ids"),
    "rope_backward": ("grad_q_out", "grad_k_out", "q", "k", "position_ids"),
    "attn_softcap": ("scores",),
    "swiglu": ("gate", "up"),
    "swiglu_backward": ("grad_output", "gate", "up"),
    "geglu": ("gate", "up"),
    "cross_entropy": ("logits", "targets"),
}
# The code whose change changes what is captured: a new version is captured afresh.
CODE = ("recipe.py", "data", "slots", "candidates", "model", "train", "detect/probe/captured.py")


def capture_steps(steps: int) -> list:
    return sorted({0, steps - 1, *(s for s in EARLY if s < steps)})


def _subsample(slot: str, inputs: tuple) -> list:
    """Detached CPU copies; the batched inputs cut to evenly spaced rows of their leading axis so that none holds
    more than MAX_ELEMENTS (at least one row)."""
    names = SLOTS[slot].inputs
    batched = [x for n, x in zip(names, inputs) if n in BATCHED[slot]]
    lead = batched[0].shape[0]
    per_row = max(x[:1].numel() for x in batched)
    k = max(1, min(lead, MAX_ELEMENTS // max(1, per_row)))
    idx = None if k == lead else torch.linspace(0, lead - 1, k).round().long().unique().to(batched[0].device)
    out = []
    for n, x in zip(names, inputs):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if idx is not None and n in BATCHED[slot]:
                x = x[idx]
            x = x.to("cpu", copy=True).contiguous()
        out.append(x)
    return out


class Capture:
    """run_arm's watcher: taps the slots named in `choice` (ArmSpec.lockstep's keys) and keeps, at the capture
    steps, the first and the last call of each slot in the step (training passes only: an evaluation's activations
    require no gradient)."""

    def __init__(self, recipe, choice: dict, kernels, corpus, recorder):
        self.slots = list(choice)
        self.steps = set(capture_steps(recipe.train.steps))
        self.rec, self.context = recorder, dict(kernels.context)
        self.calls = {}  # (slot, step) -> {"first": inputs, "last": inputs, "n": calls}
        kernels.add_tap(self.tap, self.slots)

    def tap(self, slot, inputs, out):
        step = self.rec.current_step
        if step not in self.steps or not self._training(slot, inputs):
            return
        entry = self.calls.setdefault((slot, step), {"first": None, "last": None, "n": 0})
        entry["n"] += 1
        entry["first" if entry["first"] is None else "last"] = _subsample(slot, inputs)

    @staticmethod
    def _training(slot, inputs) -> bool:
        """A backward slot runs only in training; a forward slot's activations require grad only there (grad mode
        itself is off inside the autograd bridges' forward, training or not)."""
        if SLOTS[slot].kind == "backward":
            return True
        return any(isinstance(x, torch.Tensor) and x.requires_grad
                   for n, x in zip(SLOTS[slot].inputs, inputs) if n in BATCHED[slot])

    def summary(self) -> dict:  # goes into the arm's arm.json
        return {"captured": sorted(f"{s}@{t}" for s, t in self.calls)}

    def records(self, slot: str, losses: dict) -> list:
        out = []
        for (s, step), e in sorted(self.calls.items(), key=lambda kv: kv[0][1]):
            if s != slot:
                continue
            for which, call in (("first", 1), ("last", e["n"])):
                if e[which] is not None:
                    ctx = {k: self.context[k] for k in SLOTS[slot].context}
                    out.append({"step": step, "call": call, "calls": e["n"], "loss": losses.get(step),
                                "inputs": e[which], "context": ctx})
        return out


# ------------------------------------------------------------------------------------------------------ cache


def code_version() -> str:
    from ...paths import code_version as sources_hash

    return sources_hash(CODE)[:16]


def capture_recipe(recipe, device: str, slot: Optional[str] = None):
    """The recipe the capture trains: `recipe` (a name, a Recipe or None for DEFAULT_RECIPE) on `device`, eager,
    at most MAX_STEPS steps, no progress bar; for a slot the model calls only under a setting (names.SLOT_MODEL:
    geglu), with that setting, as an A/B of the slot trains."""
    from ...recipe import load_recipe

    if recipe is None or isinstance(recipe, str):
        name, over = DEFAULT_RECIPE[device] if recipe is None else (recipe, None)
        recipe = load_recipe(name, over)
    r = copy.deepcopy(recipe)
    r.train.steps = min(r.train.steps, MAX_STEPS)
    r.train.device, r.train.compile, r.train.progress = device, None, False
    # Evaluations and snapshots feed no slot input the capture keeps: two of each, not one every few steps.
    r.train.val_every, r.train.snapshot_every = r.train.steps, 0
    for key, value in SLOT_MODEL.get(slot, {}).items():
        setattr(r.model, key, value)
    return r


# Slots whose tap changes the model's route: watched, every residual add goes through add_rmsnorm (rmsnorm then
# reads only the first block's input: 1 call a step instead of 2 x n_layers + 1), and qkv_proj's three projections
# replace the one (q and k then no views of one projection, as RoPE gets them in training). Captured in a run of
# their own, so that every other slot's inputs are the ones training hands it.
ROUTED = ("add_rmsnorm", "qkv_proj")


def capture_group(slot: Optional[str]) -> tuple:
    """The slots captured in one run with `slot` (None: the main run's)."""
    return ROUTED if slot in ROUTED else tuple(s for s in SLOTS if s not in ROUTED)


def cache_folder(recipe, device: str, slots: Optional[tuple] = None) -> Path:
    from ...data.cache import cache_dir

    slots = slots or capture_group(None)
    d = recipe.to_dict()
    d.pop("path", None)
    d.pop("ab", None)  # the A/B's settings change nothing a reference run computes, but for its optimizer:
    blob = json.dumps({"format": FORMAT, "recipe": d, "optimizer": _optimizer(recipe), "device": device,
                       "code": code_version(), "slots": list(slots)}, sort_keys=True, default=str)
    return cache_dir(recipe.data) / "captures" / f"{recipe.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def _save(path: Path, obj) -> None:
    from ...data.cache import _atomic_write  # the data cache's one atomic writer (temporary name, os.replace)

    _atomic_write(path, lambda f: torch.save(obj, f))


def _optimizer(recipe) -> str:
    """AdamW where the recipe has it (the loss falls fastest: tiny 6.93 -> 5.5 in 40 steps, SGD 6.13), else its
    first A/B optimizer."""
    return "adamw" if "adamw" in recipe.optimizers else recipe.ab.optimizers[0]


def capture(recipe, device: str, folder: Path, slots: Optional[tuple] = None) -> dict:
    """Train the capture run watching `slots` (capture_group; default the main run's) and write one file per slot
    into `folder` (cache_folder); returns {"seconds", "folder"}."""
    slots = slots or capture_group(None)
    from ...train.arm import ArmSpec, run_arm
    from ...train.metrics import read_metrics
    from ...train.quiet import quiet_lightning
    import lightning.pytorch  # noqa: F401 -- its import sets its loggers to INFO: quieten them after it

    quiet_lightning()
    threads = torch.get_num_threads()
    made = {}
    t0 = time.perf_counter()

    def watcher(*args):
        made["w"] = Capture(*args)
        return made["w"]

    spec = ArmSpec(name="capture", optimizer=_optimizer(recipe), lockstep={s: "reference" for s in slots})
    try:
        with tempfile.TemporaryDirectory(prefix="divergence-capture-") as tmp:
            info = run_arm(recipe, spec, tmp, progress=False, watcher=watcher)
            losses = {r["step"]: r["loss"] for r in read_metrics(Path(tmp) / "metrics.jsonl") if "loss" in r}
    finally:
        torch.set_num_threads(threads)  # run_arm sets the recipe's; the probe keeps its own
    seconds = time.perf_counter() - t0
    if info["status"] != "OK":
        raise RuntimeError(f"the capture run ended {info['status']}: {info.get('error', info.get('stop_where', ''))}")
    for slot in slots:
        _save(folder / f"{slot}.pt", {"format": FORMAT, "recipe": recipe.name, "device": device,
                                      "steps": recipe.train.steps, "optimizer": spec.optimizer,
                                      "seconds": seconds, "records": made["w"].records(slot, losses)})
    return {"seconds": seconds, "folder": folder}


def load_records(slot: str, recipe, device: str) -> tuple:
    """(the slot's capture, notes): from the cache, else from a capture run (which fills every file of the slot's
    capture group).
    `recipe` is capture_recipe's."""
    group = capture_group(slot)
    folder = cache_folder(recipe, device, group)  # hashes the sources once per load
    path = folder / f"{slot}.pt"
    notes = []
    if not path.is_file():
        with _one_at_a_time(folder):  # a soak's probes of one shape run at once: one trains, the rest read its files
            if not path.is_file():
                got = capture(recipe, device, folder, group)
                notes.append(f"captured live inputs: trained recipe {recipe.name} for {recipe.train.steps} steps "
                             f"on {device} in {got['seconds']:.1f} s, cached in {got['folder']} for the next probe")
    return torch.load(path, weights_only=True), notes


@contextlib.contextmanager
def _one_at_a_time(folder: Path):
    """An exclusive lock on `folder`'s capture (a file beside it), held until the capture is written."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------- families


def _shape_of(slot: str, rec: dict) -> dict:
    """Recipe, step, call, loss, then the first input's shape and dtype, for the table."""
    x = rec["inputs"][0]
    shape = {"step": rec["step"], "call": f"{rec['call']}/{rec['calls']}"}
    if rec["loss"] is not None and math.isfinite(rec["loss"]):
        shape["loss"] = f"{rec['loss']:.2f}"
    shape[SLOTS[slot].inputs[0]] = "x".join(map(str, x.shape))
    shape["dtype"] = str(x.dtype).replace("torch.", "")
    return shape


def _family(slot: str, rec: dict, recipe_name: str) -> Family:
    name = f"captured-step-{rec['step']}" + ("" if rec["call"] == 1 else f"-call-{rec['call']}")

    def build(gen, device):  # the same inputs whatever the seed: they are what training fed
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in rec["inputs"])
        rows = {}
        if "vocab_size" in rec["context"] and "input_ids" in SLOTS[slot].inputs:  # a scatter output's frequent rows
            ids = inputs[SLOTS[slot].inputs.index("input_ids")]
            rows = {0: frequent_rows(ids, rec["context"]["vocab_size"])}
        return Case(inputs, dict(rec["context"]), rows)

    return Family(name, {"recipe": recipe_name, **_shape_of(slot, rec)}, build)


def captured_families(slot: str, device: str, recipe=None) -> tuple:
    """(the slot's captured families, notes). A capture that cannot be had (no text, a failed run) skips them with
    a note, as a missing corpus skips the corpus family: the other families still run. A recipe that does not
    load is the user's error (RecipeError, exit 2)."""
    recipe = capture_recipe(recipe, device, slot)
    try:
        cap, notes = load_records(slot, recipe, device)
    except Exception as e:  # noqa: BLE001 -- reported, never fatal to the probe
        return [], [f"captured families skipped: {one_line(e)}"]
    if not cap["records"]:
        notes.append(f"captured families skipped: recipe {cap['recipe']}'s model never calls {slot}")
    return [_family(slot, r, cap["recipe"]) for r in cap["records"]], notes
