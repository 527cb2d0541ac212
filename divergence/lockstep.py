"""Lockstep check: re-run the candidate on exactly the inputs the reference op saw, every k-th step of training.

Free-running A/B compares trajectories that drift apart by chaos and needs an optimizer that exposes the bug;
here the reference arm's own activations, token ids and upstream gradients are fed to the candidate, and both are
measured against the float64 oracle on those same inputs (the FlashAttention rule: a correct kernel stays within
about 2x the reference's own error, with an absolute floor near the output dtype's rounding).

Per checked step it adds to the arm's metrics: `lockstep/err_candidate`, `lockstep/err_reference` (relative L2
error against the oracle, worst output and worst call of the step), `lockstep/cos` (cosine similarity with the
oracle), and for embedding-gradient slots `lockstep/<bucket>/err_candidate|err_reference|norm_ratio` per
token-frequency bucket; for `attn_softcap`, `lockstep/max_abs_input` (error as a function of input magnitude).
"""
from __future__ import annotations

import torch

from .ab.compare import bucket_rows
from .slots import SLOTS, resolve
from .slots.contract import as_tuple, oracle_inputs

RATIO = 2.0  # allowed multiple of the reference's own error (FlashAttention's tests use about 2x)
WINDOW = 3  # consecutive checked steps over the limit before "wrong": one unlucky batch is not a verdict


def rounding_floor(dtype: torch.dtype) -> float:
    """Half an ulp at 1.0 of the output dtype: below this a relative error is rounding, not a bug."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def _diff(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """a - o in float64 (the promotion happens in the subtraction: no separate copy); NaN counts as huge."""
    return torch.nan_to_num(torch.sub(a, o), nan=1e30)


def _rel(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(_diff(a, o)) / torch.linalg.vector_norm(o).clamp_min(1e-300)


def _row_sq(x: torch.Tensor) -> torch.Tensor:
    """Per-row sums of squares of a 2-D tensor, in float64 (V,)."""
    return torch.linalg.vector_norm(x, dim=1, dtype=torch.float64) ** 2


class Lockstep:
    def __init__(self, recipe, choice: dict, kernels, corpus, recorder):
        (self.slot, spec), = choice.items()
        self.contract = SLOTS[self.slot]
        self.impl = resolve(self.slot, spec)
        self.every = max(1, recipe.ab.lockstep_every)
        self.kernels, self.rec = kernels, recorder
        vocab = kernels.context.get("vocab_size")
        self.buckets = None
        if "grad_embed_weight" in self.contract.outputs:
            self.buckets = {b: torch.as_tensor(r) for b, r in bucket_rows(corpus.rank, vocab).items()}
        self.step = -1
        self.rows = {}  # step -> {metric: tensor}
        self.history = []  # (step, wrong: bool, err_c, err_r) after each flush
        self.mutation = {}  # input name -> device flag: did the candidate write into it (no sync per step)
        self.error = None  # the candidate raised on live inputs: recorded once, checking stops
        self.floors = {}  # (floor, device) -> float64 scalar tensor
        kernels.add_tap(self.tap, [self.slot])
        recorder.lockstep = self

    def tap(self, slot, inputs, ref_out):
        step = self.rec.current_step
        if self.error or step % self.every or (self.contract.kind == "forward" and not torch.is_grad_enabled()):
            return  # evaluation passes run under no_grad: only training steps are checked
        try:
            with torch.no_grad():
                row = self._check(inputs, as_tuple(ref_out))
        except Exception as e:  # the candidate's exception must not end the reference arm
            self.error = f"step {step}: {type(e).__name__}: {e}".splitlines()[0][:300]
            return
        prev = self.rows.get(step)
        # Several calls per step (e.g. one rmsnorm per layer): keep the worst of each error.
        self.rows[step] = row if prev is None else {k: torch.maximum(v, prev[k]) if "err" in k else v
                                                    for k, v in row.items()}

    def _check(self, inputs, ref_out):
        ctx = {k: self.kernels.context[k] for k in self.contract.context}
        fresh = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        cand = as_tuple(self.impl.fn(*fresh, **ctx))
        for name, a, b in zip(self.contract.inputs, fresh, inputs):
            if isinstance(a, torch.Tensor):
                changed = (a != b) & ~(torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else (a != b)
                flag = self.mutation.get(name)
                self.mutation[name] = changed.any() if flag is None else flag | changed.any()
        orc = as_tuple(self.contract.oracle(*oracle_inputs(self.contract, inputs), **ctx))
        floor = max(rounding_floor(o.dtype) for o in ref_out if isinstance(o, torch.Tensor))
        dev = orc[0].device
        if self.buckets is not None:
            row = self._embedding_rows(cand, ref_out, orc)
            first_c, first_r = row.pop("_err_c"), row.pop("_err_r")
        else:
            c0, o0 = cand[0].to(torch.float64).flatten(), orc[0].flatten()
            row = {"lockstep/cos": torch.nn.functional.cosine_similarity(torch.nan_to_num(c0), o0, dim=0)}
            first_c, first_r = _rel(cand[0], orc[0]), _rel(ref_out[0], orc[0])
        err_c = torch.stack([first_c] + [_rel(c, o) for c, o in zip(cand[1:], orc[1:])]).max()
        err_r = torch.stack([first_r] + [_rel(r, o) for r, o in zip(ref_out[1:], orc[1:])]).max()
        if (floor, dev) not in self.floors:  # once: a blocking host-to-device copy per step would sync the GPU
            self.floors[(floor, dev)] = torch.tensor(floor, dtype=torch.float64, device=dev)
        row.update({"lockstep/err_candidate": err_c, "lockstep/err_reference": err_r,
                    "lockstep/floor": self.floors[(floor, dev)]})
        if self.slot == "attn_softcap":
            x = inputs[0]
            row["lockstep/max_abs_input"] = x.masked_fill(torch.isinf(x), 0).abs().max().to(torch.float64)
        return row

    def _embedding_rows(self, cand, ref_out, orc) -> dict:
        """Overall and per-bucket errors of an embedding gradient from per-row sums (V,): five passes over the
        (V, H) outputs, then only V-sized gathers per bucket, instead of copying each bucket's rows three times."""
        c, r, o = cand[0], ref_out[0], orc[0]
        if next(iter(self.buckets.values())).device != o.device:  # once: no host-to-device copy per step
            self.buckets = {b: rows.to(o.device) for b, rows in self.buckets.items()}
        cf = torch.nan_to_num(c.to(torch.float64))
        ec, er, oo, cc = _row_sq(_diff(c, o)), _row_sq(_diff(r, o)), _row_sq(o), _row_sq(cf)
        co = (cf * o).sum(1)
        tiny = 1e-300
        row = {"_err_c": (ec.sum() / oo.sum().clamp_min(tiny)).sqrt(),
               "_err_r": (er.sum() / oo.sum().clamp_min(tiny)).sqrt(),
               "lockstep/cos": co.sum() / (cc.sum() * oo.sum()).sqrt().clamp_min(tiny)}
        for b, rows in self.buckets.items():
            ob = oo[rows].sum().clamp_min(tiny)
            row[f"lockstep/{b}/err_candidate"] = (ec[rows].sum() / ob).sqrt()
            row[f"lockstep/{b}/err_reference"] = (er[rows].sum() / ob).sqrt()
            row[f"lockstep/{b}/norm_ratio"] = (cc[rows].sum() / ob).sqrt()
        return row

    def collect(self, step: int) -> dict:
        """Called by the recorder at flush time: this step's lockstep metrics as floats, and the rule applied."""
        row = self.rows.pop(step, None)
        if row is None:
            return {}
        vals = dict(zip(row, torch.stack([v.to(torch.float64).reshape(()) for v in row.values()]).cpu().tolist()))
        wrong = self._wrong(vals)
        vals["lockstep/wrong"] = float(wrong)
        self.history.append((step, wrong, vals["lockstep/err_candidate"], vals["lockstep/err_reference"]))
        return vals

    @staticmethod
    def _wrong(v: dict) -> bool:
        floor = v["lockstep/floor"]
        pairs = [("lockstep/err_candidate", "lockstep/err_reference")]
        pairs += [(k, k.replace("err_candidate", "err_reference")) for k in v
                  if k.endswith("/err_candidate") and k != "lockstep/err_candidate"]
        return any(not (v[c] <= RATIO * v[r] + floor) for c, r in pairs)  # NaN counts as wrong

    def summary(self) -> dict:
        run, first = 0, None
        for step, wrong, *_ in self.history:
            run = run + 1 if wrong else 0
            if run >= WINDOW and first is None:
                first = step - (WINDOW - 1) * self.every
        worst = max(self.history, key=lambda h: h[2] / max(h[3], 1e-30), default=None)
        return {
            "slot": self.slot, "candidate": self.impl.name, "checked_steps": len(self.history),
            "every": self.every, "wrong": first is not None, "first_wrong_step": first,
            "wrong_steps": sum(1 for h in self.history if h[1]),
            "worst_step": worst[0] if worst else None,
            "worst_err_candidate": worst[2] if worst else None,
            "worst_err_reference": worst[3] if worst else None,
            "mutated_input": next((n for n, f in self.mutation.items() if bool(f)), None),
            "error": self.error,
            "rule": f"err_candidate <= {RATIO} x err_reference + rounding floor, overall and per frequency "
                    f"bucket; wrong after {WINDOW} consecutive checked steps over it",
        }
